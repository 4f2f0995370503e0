"""Joining and leaving the job: `initialize()` from the environment, and `shutdown`.

`jdp.initialize()` reads the job from what its engine put in the environment (`_engines`: the
launcher's and torchrun's variables, JAX's, a Kubernetes Indexed Job or JobSet pod, srun,
mpirun, a Ray Train worker) and calls `jax.distributed.initialize` with it, with timeouts
short enough that a dead peer becomes an error within about a minute instead of JAX's five.
A single process (no engine's signs, or WORLD_SIZE=1) is a quiet no-op, so one script runs
unchanged with `python train.py` and under every engine; an engine seen without what it
needs is a one-line error, never N unrelated single-process jobs.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax

# Private, for want of a public API: JAX exposes no handle on the coordination-service client
# of `jax.distributed` (wanted: its timed `wait_at_barrier`; multihost_utils.sync_global_devices
# is a device collective with no timeout) nor the coordinator address a job was started with.
from jax._src import distributed as _jax_distributed  # no public API: see above

from jdp.distributed import _engines, _rendezvous, _watch
from jdp.job import env as _env
from jdp.job import malloc as _malloc
from jdp.job import net as _net
from jdp.job import rank as _rank
from jdp.job import run as _run
from jdp.job import values

WHO = "jdp.initialize"
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
    engine: str = "arguments"        # what started the job (`_engines`), said in the log
    late_dns: bool = False           # retry resolving the coordinator's name (Kubernetes)



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
    in order: the argument; the engine that started the process (the table "Starting a job"
    in docs/launch.md): the launcher's variables MASTER_ADDR:MASTER_PORT, WORLD_SIZE, RANK,
    with LOCAL_RANK binding a process to its GPU when LOCAL_WORLD_SIZE > 1 (unless
    JAX_LOCAL_DEVICE_IDS is set); JAX_COORDINATOR_ADDRESS with JAX_NUM_PROCESSES and
    JAX_PROCESS_ID; a Kubernetes Indexed Job or JobSet pod (JOB_COMPLETION_INDEX, its hostname
    and subdomain, WORLD_SIZE from the manifest; process 0's name resolved with retries); a
    Ray Train worker (Ray's context); else JAX's own cluster detection, used only when SLURM
    (srun, SLURM_NTASKS > 1) or Open MPI (mpirun, size > 1) is seen or when asked for through
    `cluster_detection_method` / JDP_CLUSTER_DETECTION ("auto", "slurm", "ompi", "mpi4py",
    "gketpu", ...; "k8s": jdp's Kubernetes reading). Nothing of the kind, or one process: a
    quiet no-op. Once joined, each process prints `jdp: joined as process k of n via <engine>`.

    Calling it again is a no-op; calling it again with a different job raises RuntimeError.
    It also tunes glibc's allocator so XLA:CPU reuses its per-step scratch memory (~1.7x on a
    CPU step, same results; `JDP_MALLOC_TUNING=0` turns it off; see `jdp.job.malloc`).
    Every process first reports to process 0 on the coordinator port (`_rendezvous`), so a
    missing process is named in a TimeoutError instead of JAX aborting process 0, and one
    started with another process count is refused (ValueError) on both sides; those
    connections stay open, so a process that dies later is named by the others
    (`jdp.job.peers`), and one whose script ended while others wait in a collective call is
    named by them at once. On a multi-process job an uncaught exception (code 1) or
    `sys.exit(n)` (code n) ends the process at once instead of waiting in JAX's exit
    handler, under mpirun/srun too (a bare `raise SystemExit(n)` still waits). With
    JDP_PROGRESS_TIMEOUT=S and no jdp launcher watching (srun, mpirun), a watchdog inside
    the job (`_watch`) names a rank that made no progress for S seconds, with its Python
    stack, and ends the job with status 124.

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
            MASTER_ADDR that does not resolve, ...), an engine seen without what it needs (a
            pod without WORLD_SIZE, ...), or processes started for different process counts.
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
    if replaced := _devices_flag_replaced(env):
        warnings.warn(replaced, stacklevel=2)
    _malloc.tune()  # before XLA's threads pick their malloc arenas; see jdp.job.malloc
    timeouts = {name: _timeout(name, value, *_TIMEOUT_ENV[name], env) for name, value in
                zip(_TIMEOUT_ENV, (initialization_timeout, heartbeat_timeout, shutdown_timeout),
                    strict=True)}
    if num_processes is not None:
        num_processes = values.integer(WHO, "num_processes", num_processes, minimum=1,
                                       fix="the job's number of processes (WORLD_SIZE)")
    if process_id is not None:
        process_id = values.integer(WHO, "process_id", process_id, minimum=0,
                                    fix="this process's index (RANK)")
    plan = _plan(coordinator_address, num_processes, process_id, local_device_ids,
                 cluster_detection_method, env)
    if plan is None or _already_initialized(plan):
        return
    _connect(plan, **timeouts)
    _rank.current().progress.open()   # a peer waiting in a collective call may ask where
    atexit.register(_rank.current().peers.script_finished)   # after JAX's: before its barrier
    _install_fail_fast_excepthook()
    _run.on_failure(_rank.current().peers.failing)   # peers name the error, not a lost rank
    _start_watchdog(env)


def _devices_flag_replaced(env: Mapping[str, str]) -> str | None:
    """A warning when the launcher's `--devices_per_process k` is no longer in XLA_FLAGS (the
    script set XLA_FLAGS itself, before JAX read it): this process would get another count of
    CPU devices than the launcher gave its peers. None when it is still there, or not asked."""
    asked = env.get(_env.DEVICES_PER_PROCESS)
    flags = env.get("XLA_FLAGS", "")
    given = [f.partition("=")[2] for f in flags.split()
             if f.partition("=")[0] == _env.HOST_DEVICES_FLAG]
    if not asked or given[-1:] == [asked]:
        return None
    now = f"{_env.HOST_DEVICES_FLAG}={given[-1]}" if given else f"no {_env.HOST_DEVICES_FLAG}"
    return (f"jdp: the launcher's --devices_per_process {asked} is overridden: XLA_FLAGS="
            f"{flags!r} ({now}), set by the script itself; add to XLA_FLAGS instead of replacing "
            "it (os.environ['XLA_FLAGS'] += ' --flag'), or drop --devices_per_process")


def _plan(coordinator_address, num_processes, process_id, local_device_ids,
          cluster_detection_method, env: Mapping[str, str]) -> _Plan | None:
    """Merge arguments and the engine found in the environment (`_engines`) into one plan;
    None when there is nothing to join."""
    _engines.check_local_world(env, num_processes, process_id)
    found = _engines.find(cluster_detection_method, env)
    given = (coordinator_address, num_processes, process_id)
    if found is None and given == (None, None, None):
        if alone := _engines.slurm_allocation(env):
            warnings.warn(alone, stacklevel=3)
        return None
    found = found or _engines.Found("arguments", None, None, None)
    coordinator_address, num_processes, process_id = (  # an argument wins over the engine
        arg if arg is not None else env_value
        for arg, env_value in zip(given, found[1:4], strict=True))
    if found.cluster and (coordinator_address, num_processes, process_id) == (None, None, None):
        return _Plan(None, None, None, local_device_ids, found.cluster, found.engine)
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"WORLD_SIZE / num_processes={num_processes} must be >= 1")
    if num_processes == 1 and process_id in (None, 0):
        return None
    missing = [name for name, value in (("MASTER_ADDR and MASTER_PORT (coordinator_address)",
                                         "Ray" if found.engine == "Ray Train" else
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
    if coordinator_address is not None:
        _net.split_host_port(coordinator_address)
    return _Plan(coordinator_address, num_processes, process_id,
                 _local_devices(local_device_ids, env), None, found.engine, found.late_dns)


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
    """The JAX cluster detection method to use, or None (jdp reads the job itself, or there
    is none). JAX's own detection is not consulted blindly: some of it (TPU metadata,
    Kubernetes) makes network calls, and a plain `python train.py` must not try to join."""
    found = _engines.find(method, env)
    return None if found is None else found.cluster


def _connect(plan: _Plan, *, initialization_timeout: int, heartbeat_timeout: int,
             shutdown_timeout: int) -> None:
    """Check the coordinator port, then call `jax.distributed.initialize`."""
    plan, bind, timeout = _meet(plan, initialization_timeout)
    if "JAX_ENABLE_PREEMPTION_SERVICE" not in os.environ:
        # The preemption service catches SIGTERM (a child outlived it by > 4 s): the launcher
        # stops ranks with SIGTERM, so it must stay off unless the user asks for it.
        jax.config.update("jax_enable_preemption_service", False)
    hint = _abort_hint(plan, timeout) if plan.coordinator is not None else None
    try:
        with warnings.catch_warnings():
            # JAX notes in every pod that its own Kubernetes bootstrapping needs the
            # `kubernetes` package; jdp read the job itself, so that note is noise.
            warnings.filterwarnings("ignore", "Kubernetes environment detected")
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
    print(f"jdp: joined as process {jax.process_index()} of {jax.process_count()} via "
          f"{plan.engine}", file=sys.stderr, flush=True)


def _meet(plan: _Plan, timeout: int) -> tuple[_Plan, str | None, int]:
    """Settle the coordinator's address (agreed through Ray, or a pod name resolved late),
    check it, and hold the roll call; (plan, process 0's bind address, seconds left)."""
    start, bind = time.monotonic(), None
    if plan.coordinator is None and plan.engine == "Ray Train":
        plan = plan._replace(coordinator=_engines.ray_coordinator())
    if plan.coordinator is None and plan.cluster in ("ompi", "slurm"):
        coordinator, count, pid, local = _engines.cluster_coordinates(plan.cluster, timeout)
        plan = plan._replace(coordinator=coordinator, num_processes=count, process_id=pid,
                             local_device_ids=plan.local_device_ids or local or None,
                             cluster=None)
    if plan.coordinator is None:
        return plan, None, timeout
    host, port = _net.split_host_port(plan.coordinator)
    if plan.late_dns:   # pod 0's name is often published after the other pods start
        host = _engines.wait_for_address(host, timeout)
        plan = plan._replace(coordinator=_net.join_host_port(host, port))
    if not _net.resolves(host):
        raise ValueError(f"MASTER_ADDR={host!r} does not resolve to an address; set it to "
                         "the IP address or host name of the machine that runs process 0")
    if plan.process_id == 0:
        if problem := _net.port_problem(host, port):
            _rendezvous.second_zero(host, port, plan.num_processes)   # RANK=0 twice?
            raise ValueError(problem)
        bind = plan.coordinator  # this interface only, not every interface of the host
    left = max(1.0, timeout - (time.monotonic() - start))
    return plan, bind, _roll_call(host, port, plan, left)


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


def _roll_call(host: str, port: int, plan: _Plan, timeout: float) -> int:
    """Every process reports to process 0 (`_rendezvous.roll_call`) before JAX's join, and
    the connections stay open to name a lost process (`jdp.job.peers`); the seconds left."""
    conns, left = _rendezvous.roll_call(host, port, plan.process_id, plan.num_processes,
                                        timeout)
    _rank.current().peers.watch(conns, plan.process_id)
    return left


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
    same = current[1:] == wanted[1:] and (  # agreed (Ray) or resolved (pods) when joining
        plan.coordinator is None or plan.late_dns or current[0] == wanted[0])
    if plan.cluster is None and not same:
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
        lost = _rank.current().peers.lost(exc)
        if lost is not None and hasattr(exc, "add_note"):
            exc.add_note(lost)   # the failed collective's own message names no process
        _run.report_failure(_run.failure_code(exc), exc)

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
    _rank.current().peers.goodbye()
    jax.distributed.shutdown()


def _timeout(name: str, value: Any, env_name: str, default: int, env: Mapping[str, str]) -> int:
    """A timeout in whole seconds from the argument `name` (an int, NumPy's too: JAX takes
    integers), else `env_name`, else `default`."""
    if value is not None:
        return values.integer(WHO, name, value, minimum=1, maximum=int(_env.MAX_SECONDS),
                              fix=f"whole seconds (JAX takes integers), e.g. {default}")
    value = env.get(env_name, default)
    try:
        seconds = int(value)
    except (TypeError, ValueError):
        seconds = -1
    if seconds < 1:
        raise ValueError(f"{env_name}={value!r} must be a whole number of seconds >= 1 "
                         f"(JAX takes integers); e.g. {env_name}={default}")
    return seconds


_env_int = _engines.integer   # an integer variable, or ValueError naming it
