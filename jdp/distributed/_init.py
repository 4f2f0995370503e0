"""Joining and leaving the job: `initialize()` from the environment, `barrier`, `shutdown`.

`jdp.initialize()` reads the variables the launcher sets (MASTER_ADDR, MASTER_PORT,
WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE) and calls `jax.distributed.initialize` with
them, with timeouts short enough that a dead peer becomes an error within about a minute
instead of JAX's five. A single process (no such variables, or WORLD_SIZE=1) is a quiet no-op,
so one script runs unchanged with `python train.py` and under the launcher.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax

# Private, for want of a public API: JAX exposes no handle on the coordination-service client
# of `jax.distributed` (wanted: its timed `wait_at_barrier`; multihost_utils.sync_global_devices
# is a device collective with no timeout) nor the coordinator address a job was started with.
from jax._src import distributed as _jax_distributed  # no public API: see above

from jdp.distributed import _rendezvous, _watch
from jdp.launch import _env, _malloc, _net, _run

# argument -> (environment variable, default seconds). The shutdown timeout is long on purpose:
# a rank that finishes waits there for the others, and JAX aborts *every* process when it runs
# out (measured), e.g. while process 0 still writes its last checkpoint. Dead peers are caught
# by the heartbeat, not by it.
_TIMEOUT_ENV = {"initialization_timeout": (_env.INIT_TIMEOUT, 60),
                "heartbeat_timeout": (_env.HEARTBEAT_TIMEOUT, 30),
                "shutdown_timeout": (_env.SHUTDOWN_TIMEOUT, 300)}


class _Plan(NamedTuple):
    """What `initialize` hands to `jax.distributed.initialize`."""
    coordinator: str | None          # "host:port"; None when JAX's cluster detection finds it
    num_processes: int | None
    process_id: int | None
    local_device_ids: list[int] | None
    cluster: str | None              # JAX cluster_detection_method ("auto" = JAX decides)



def coordination_client():
    """JAX's coordination-service client (its key-value store and barriers), or None before
    `initialize()`: the one use of the private module imported above."""
    return _jax_distributed.global_state.client

def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids: Sequence[int] | None = None,
               *, initialization_timeout: int | None = None, heartbeat_timeout: int | None = None,
               shutdown_timeout: int | None = None,
               cluster_detection_method: str | None = None) -> None:
    """Join this process to the job's other processes (`jax.distributed.initialize`).

    Call it first in `main`, before anything touches a JAX device. Each setting comes from,
    in order: the argument; the launcher's variables MASTER_ADDR:MASTER_PORT,
    WORLD_SIZE, RANK, with LOCAL_RANK binding a process to its GPU when LOCAL_WORLD_SIZE > 1
    (unless JAX_LOCAL_DEVICE_IDS is set); else JAX's own cluster detection, used only when
    SLURM (srun, SLURM_NTASKS > 1) or Open MPI (mpirun, size > 1) is seen or when asked for
    through `cluster_detection_method` / JDP_CLUSTER_DETECTION ("auto", "slurm", "ompi",
    "mpi4py", "gketpu", ...). Nothing of the kind, or one process: a quiet no-op.

    Calling it again is a no-op; calling it again with a different job raises RuntimeError.
    It also tunes glibc's allocator so XLA:CPU reuses its per-step scratch memory (~1.7x on a
    CPU step, same results; `JDP_MALLOC_TUNING=0` turns it off; see `jdp.launch._malloc`).
    Every process first reports to process 0 on the coordinator port (`_rendezvous`), so a
    missing process is named in a TimeoutError instead of JAX aborting process 0. On a
    multi-process job an uncaught exception (code 1) or `sys.exit(n)` (code n) ends the
    process at once instead of waiting in JAX's exit handler, under mpirun/srun too (a bare
    `raise SystemExit(n)` still waits). With JDP_PROGRESS_TIMEOUT=S and no jdp launcher
    watching (srun, mpirun), a watchdog inside the job (`_watch`) names a rank that made no
    progress for S seconds, with its Python stack, and ends the job with status 124.

    Args:
        coordinator_address: "host:port" of process 0's coordinator service.
        num_processes: number of processes in the job (WORLD_SIZE).
        process_id: this process's index, 0 <= process_id < num_processes (RANK).
        local_device_ids: local devices this process uses (GPU ids).
        initialization_timeout: seconds to wait for all processes to join (JDP_INIT_TIMEOUT,
            default 60). A coordinator that never answers raises TimeoutError.
        heartbeat_timeout: seconds without a heartbeat before a process counts as dead and
            JAX aborts the others (JDP_HEARTBEAT_TIMEOUT, default 30).
        shutdown_timeout: seconds a finished process waits at exit for the others
            (JDP_SHUTDOWN_TIMEOUT, default 300; JAX aborts every process when it runs out).
        cluster_detection_method: JAX's cluster detection method to use (see above).

    Raises:
        ValueError: an inconsistent setting (RANK >= WORLD_SIZE, a bad or busy port, a
            MASTER_ADDR that does not resolve, ...).
        TimeoutError: the coordinator did not answer within `initialization_timeout`, or
            (on process 0) some processes never reported; the message names them.
        RuntimeError: called after JAX started its backend, or again for a different job.

    Example:
        >>> import jdp
        >>> jdp.initialize()     # one process, no launcher: returns quietly
        >>> jax.process_count()  # under `python -m jdp.launch --nproc_per_node 2 ...`: 2
        1
    """
    env = os.environ
    _env.check_settings(env)  # a bad JDP_* value is an error here, even on one process
    _malloc.tune()  # before XLA's threads pick their malloc arenas; see jdp.launch._malloc
    timeouts = {name: _timeout(value, *_TIMEOUT_ENV[name], env) for name, value in
                zip(_TIMEOUT_ENV, (initialization_timeout, heartbeat_timeout, shutdown_timeout),
                    strict=True)}
    plan = _plan(coordinator_address, num_processes, process_id, local_device_ids,
                 cluster_detection_method, env)
    if plan is None or _already_initialized(plan):
        return
    _connect(plan, **timeouts)
    _install_fail_fast_excepthook()
    _start_watchdog(env)


def _plan(coordinator_address, num_processes, process_id, local_device_ids,
          cluster_detection_method, env: Mapping[str, str]) -> _Plan | None:
    """Merge arguments and environment into one plan; None when there is nothing to join."""
    if coordinator_address is None and _env.MASTER_ADDR in env and _env.MASTER_PORT in env:
        port = _env_int(env, _env.MASTER_PORT,
                        "the coordinator's TCP port (e.g. MASTER_PORT=29500)")
        coordinator_address = _net.join_host_port(env[_env.MASTER_ADDR], port)
    if num_processes is None and _env.WORLD_SIZE in env:
        num_processes = _env_int(env, _env.WORLD_SIZE, "the number of processes")
    if process_id is None and _env.RANK in env:
        process_id = _env_int(env, _env.RANK, "this process's index, 0 <= RANK < WORLD_SIZE")
    if coordinator_address is None and num_processes is None and process_id is None:
        cluster = _detect_cluster(cluster_detection_method, env)
        return None if cluster is None else _Plan(None, None, None, local_device_ids, cluster)
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"WORLD_SIZE / num_processes={num_processes} must be >= 1")
    if num_processes == 1 and process_id in (None, 0):
        return None
    missing = [name for name, value in (("MASTER_ADDR and MASTER_PORT (coordinator_address)",
                                         coordinator_address),
                                        ("WORLD_SIZE (num_processes)", num_processes),
                                        ("RANK (process_id)", process_id)) if value is None]
    if missing:
        raise ValueError(f"a multi-process job needs {', '.join(missing)} as well; set them, or "
                         "start it with `python -m jdp.launch --nproc_per_node N script.py`")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"RANK / process_id={process_id} is outside 0..{num_processes - 1} "
                         f"(WORLD_SIZE={num_processes}); give each process a distinct RANK below "
                         "WORLD_SIZE")
    _net.split_host_port(coordinator_address)
    return _Plan(coordinator_address, num_processes, process_id,
                 _local_devices(local_device_ids, env), None)


def _local_devices(local_device_ids, env: Mapping[str, str]) -> list[int] | None:
    """Explicit ids; else one GPU per process (LOCAL_RANK) when several share a node."""
    if local_device_ids is not None:
        return [int(i) for i in local_device_ids]
    if "JAX_LOCAL_DEVICE_IDS" in env or _env.LOCAL_RANK not in env:
        return None  # JAX reads JAX_LOCAL_DEVICE_IDS itself
    local_rank = _env_int(env, _env.LOCAL_RANK, "this process's index on its node")
    local_world = _env_int(env, _env.LOCAL_WORLD_SIZE, "processes per node") if (
        _env.LOCAL_WORLD_SIZE in env) else 1
    if not 0 <= local_rank < max(local_world, 1):
        raise ValueError(f"LOCAL_RANK={local_rank} is outside 0..{local_world - 1} "
                         f"(LOCAL_WORLD_SIZE={local_world}); set LOCAL_RANK below LOCAL_WORLD_SIZE")
    # Only sets jax_cuda/rocm_visible_devices: one GPU per process, harmless on CPU.
    return [local_rank] if local_world > 1 else None


def _detect_cluster(method: str | None, env: Mapping[str, str]) -> str | None:
    """The JAX cluster detection method to use, or None for a plain single process.

    JAX's own detection is not consulted blindly: some of it (TPU metadata, Kubernetes)
    makes network calls, and a plain `python train.py` must not try to join anything.
    """
    method = method or env.get(_env.CLUSTER_DETECTION) or None
    if method:
        return method
    if all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID")) and (
            _env_int(env, "SLURM_NTASKS", "the number of SLURM tasks") > 1):
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and _env_int(
            env, "OMPI_COMM_WORLD_SIZE", "the Open MPI world size") > 1:
        return "ompi"
    return None


def _connect(plan: _Plan, *, initialization_timeout: int, heartbeat_timeout: int,
             shutdown_timeout: int) -> None:
    """Check the coordinator port, then call `jax.distributed.initialize`."""
    bind, timeout = None, initialization_timeout
    if plan.coordinator is not None:
        host, port = _net.split_host_port(plan.coordinator)
        if not _net.resolves(host):
            raise ValueError(f"MASTER_ADDR={host!r} does not resolve to an address; set it to "
                             "the IP address or host name of the machine that runs process 0")
        if plan.process_id == 0:
            if problem := _net.port_problem(host, port):
                raise ValueError(problem)
            bind = plan.coordinator  # this interface only, not every interface of the host
        timeout = _roll_call(host, port, plan, initialization_timeout)
    if "JAX_ENABLE_PREEMPTION_SERVICE" not in os.environ:
        # The preemption service catches SIGTERM (a child outlived it by > 4 s): the launcher
        # stops ranks with SIGTERM, so it must stay off unless the user asks for it.
        jax.config.update("jax_enable_preemption_service", False)
    hint = _abort_hint(plan, timeout) if plan.coordinator is not None else None
    try:
        jax.distributed.initialize(
            coordinator_address=plan.coordinator, num_processes=plan.num_processes,
            process_id=plan.process_id, local_device_ids=plan.local_device_ids,
            cluster_detection_method=None if plan.cluster == "auto" else plan.cluster,
            initialization_timeout=timeout, heartbeat_timeout_seconds=heartbeat_timeout,
            shutdown_timeout_seconds=shutdown_timeout, coordinator_bind_address=bind)
    except RuntimeError as e:   # JAX's "too late", made to say what to do
        if "before any JAX" not in str(e) and "must be called before" not in str(e):
            raise
        raise RuntimeError("jdp.initialize() must run before anything uses a JAX device "
                           "(jax.devices(), creating an array, jit, ...); call it first in "
                           "main") from None
    finally:
        if hint is not None:
            hint.cancel()


def _start_watchdog(env: Mapping[str, str]) -> None:
    """The in-job watchdog, when JDP_PROGRESS_TIMEOUT asks for one and no supervisor reads
    this rank's progress slot (jdp.launch and jdp.spawn watch from outside)."""
    raw = env.get(_env.PROGRESS_TIMEOUT)
    if not raw or _env.PROGRESS_FILE in env:
        return
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{_env.PROGRESS_TIMEOUT}={raw!r} is not a number of seconds > 0; "
                         f"e.g. {_env.PROGRESS_TIMEOUT}=600")
    state = _jax_distributed.global_state
    _watch.start(state.client, state.process_id, state.num_processes, seconds)


def _roll_call(host: str, port: int, plan: _Plan, timeout: int) -> int:
    """Every process reports to process 0 (`_rendezvous`) before JAX's join; the seconds left."""
    start = time.monotonic()
    if plan.process_id == 0:
        _rendezvous.gather(host, port, plan.num_processes, timeout)
    else:
        _rendezvous.report(host, port, plan.process_id, timeout)
    return max(1, int(timeout - (time.monotonic() - start) + 0.999))


def _abort_hint(plan: _Plan, timeout: int) -> threading.Timer:
    """A timer that names the settings to check when JAX's join times out (JAX then aborts,
    SIGABRT ~5 s later, with a C++ message that names none)."""
    message = (f"jdp: process {plan.process_id} has waited {timeout} s for all "
               f"{plan.num_processes} processes to join at {plan.coordinator}; JAX will abort "
               "shortly. Check that every rank was started with the same MASTER_ADDR, "
               "MASTER_PORT and WORLD_SIZE, or raise JDP_INIT_TIMEOUT.")
    timer = threading.Timer(timeout, print, (message,), {"file": sys.stderr, "flush": True})
    timer.daemon = True
    timer.start()
    return timer


def _already_initialized(plan: _Plan) -> bool:
    """True when jax.distributed already runs this job; RuntimeError when it runs another."""
    if not jax.distributed.is_initialized():
        return False
    state = _jax_distributed.global_state
    current = (state.coordinator_address, state.num_processes, state.process_id)
    wanted = (plan.coordinator, plan.num_processes, plan.process_id)
    if plan.cluster is None and current != wanted:
        raise RuntimeError(
            f"jdp.initialize() was already called for coordinator={current[0]}, num_processes="
            f"{current[1]}, process_id={current[2]}; it cannot switch to {wanted} within one "
            "process (call it once, or start a new process)")
    return True


def _install_fail_fast_excepthook() -> None:
    """Make a failing process leave at once: uncaught exceptions exit 1, `sys.exit(n)` exits n.

    Otherwise it would sit in JAX's exit handler until every peer exits, then die by SIGABRT,
    hiding the error and its code. An uncaught SystemExit of the replaced `sys.exit` ends the
    process before atexit (`_run.PromptExit`); a caught one changes nothing. Interactive
    sessions keep Python's behaviour.
    """
    if getattr(sys.excepthook, "_jdp_previous", None) or hasattr(sys, "ps1"):
        return
    previous = sys.excepthook

    def fail_fast(exc_type, exc, tb):
        _run.report_failure(130 if issubclass(exc_type, KeyboardInterrupt) else 1, exc)

    fail_fast._jdp_previous = previous  # type: ignore[attr-defined]
    fail_fast._jdp_sys_exit = sys.exit  # type: ignore[attr-defined]
    sys.excepthook = fail_fast
    sys.exit = _run.prompt_sys_exit


def shutdown() -> None:
    """Leave the job: the counterpart of `initialize`.

    Waits, up to the shutdown timeout, until every process has called it. Optional: JAX
    already calls it at exit. Safe to call twice and on a single process. After it, JAX
    cannot be initialised again in this process.

    Example:
        >>> import jdp
        >>> jdp.shutdown()
    """
    hook = sys.excepthook
    if getattr(hook, "_jdp_previous", None):
        sys.excepthook = hook._jdp_previous  # type: ignore[attr-defined]
        sys.exit = hook._jdp_sys_exit  # type: ignore[attr-defined]
    jax.distributed.shutdown()


def barrier(name: str = "jdp.barrier", timeout_s: float = 300.0) -> None:
    """Wait until every process reaches the barrier `name`, or raise after `timeout_s`.

    Unlike a device collective it cannot hang forever: a process that is dead or stuck
    elsewhere turns into a TimeoutError. All processes must pass the same names in the same
    order. A single process returns at once.

    Args:
        name: the barrier's id; the same name may be used again once all have passed.
        timeout_s: seconds to wait for the slowest process.

    Example:
        >>> import jdp
        >>> if jdp.is_primary():
        ...     print("preparing the dataset")   # one process writes, the others wait
        preparing the dataset
        >>> jdp.barrier("dataset-ready", timeout_s=60)
    """
    client = coordination_client()
    if client is None:
        return
    try:
        client.wait_at_barrier(name, int(timeout_s * 1000))
    except jax.errors.JaxRuntimeError as e:
        if "DEADLINE_EXCEEDED" not in str(e):
            raise
        raise TimeoutError(f"barrier {name!r} timed out after {timeout_s} s on process "
                           f"{jax.process_index()}: another process is slow, stuck or dead (see "
                           "its log), or did not call barrier with this name") from None


def _timeout(value: int | None, env_name: str, default: int, env: Mapping[str, str]) -> int:
    """A timeout in whole seconds from the argument, else `env_name`, else `default`."""
    source = "argument" if value is not None else env_name
    if value is None:
        value = env.get(env_name, default)
    try:
        seconds = int(value)
    except (TypeError, ValueError):
        seconds = -1
    if seconds < 1 or (isinstance(value, float) and value != seconds):
        raise ValueError(f"timeout {source}={value!r} must be a whole number of seconds >= 1 "
                         f"(JAX takes integers), e.g. {env_name}={default}")
    return seconds


def _env_int(env: Mapping[str, str], name: str, meaning: str) -> int:
    """Integer environment variable `name`; ValueError naming it and what it means."""
    raw = env[name]
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; it must be {meaning}") from None
    if value < 0:
        raise ValueError(f"{name}={value} is negative; it must be {meaning}")
    return value
