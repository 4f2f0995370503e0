"""Functions that tests hand to `jdp.spawn`: module-level, so spawned processes can import them."""
import json
import os
import time


def global_mean(rank: int, out_dir: str) -> None:
    """Write this rank's view of the cross-process mean of rank-dependent values to a file."""
    import jax
    import numpy as np

    n = jax.local_device_count()
    values = np.arange(n, dtype=np.float32) + 10.0 * jax.process_index()
    mean = jax.pmap(lambda v: jax.lax.pmean(v, "i"), axis_name="i")(values)
    result = {"rank": rank, "process_index": jax.process_index(),
              "process_count": jax.process_count(), "device_count": jax.device_count(),
              "mean": float(mean[0]), "pid": os.getpid()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def fail_on_rank(rank: int, bad_rank: int, pid_dir: str) -> None:
    """Rank `bad_rank` raises RuntimeError("boom"); the others wait (as if in a long step)."""
    with open(os.path.join(pid_dir, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == bad_rank:
        time.sleep(0.5)
        raise RuntimeError("boom")
    time.sleep(60)


def slow_to_interrupt(rank: int, pid_dir: str) -> None:
    """Wait as `fail_on_rank` does, but rank 1 takes 0.5 s to act on SIGINT (as a loaded
    machine may): its KeyboardInterrupt must still be its own, not process 0's exit."""
    import signal

    def late(signum, frame):
        time.sleep(0.5)
        raise KeyboardInterrupt

    if rank == 1:
        signal.signal(signal.SIGINT, late)
    fail_on_rank(rank, -1, pid_dir)


def killed_on_rank(rank: int, bad_rank: int) -> None:
    """Rank `bad_rank` dies by SIGKILL (no Python traceback); the others wait."""
    import signal
    if rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def stuck_at_step(rank: int, bad_rank: int, stuck_step: int) -> None:
    """Steps of a pmap psum, each recorded as progress; rank `bad_rank` sleeps at `stuck_step`."""
    import jax
    import numpy as np

    from jdp.job import rank as _rank

    step_fn = jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")
    x = np.ones(jax.local_device_count(), np.float32)
    for step in range(1, 10**6):
        _rank.record("data", step - 1)
        if rank == bad_rank and step == stuck_step + 1:
            time.sleep(10**6)   # STUCK HERE
        _rank.record("step", step)
        step_fn(x).block_until_ready()
