"""The environment variables a jdp job is run with: one home for their names.

The launcher and `jdp.spawn` set them for each rank; `jdp.initialize` and the progress
recorder read them. The rank-side runner (`run.py`, run by path, importing no sibling) owns
the four it reads itself; they are re-exported here.
"""
from __future__ import annotations

from jdp.job.run import ERROR_FILE, SPAWN_BOOTSTRAP, STACK_FILE, SUPERVISOR_PID

# The variables that place a rank in its job, in the order rank_env fills them.
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
NODE_RANK = "NODE_RANK"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RESTART_COUNT = "JDP_RESTART_COUNT"
RANK_VARS = (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR,
             MASTER_PORT, RESTART_COUNT)
"""Every variable the launcher sets to place a rank in its job (tests clear these)."""
NNODES = "JDP_NNODES"   # the launcher's nodes in this round (elastic jobs change it)

# Settings a user may put in the environment.
INIT_TIMEOUT = "JDP_INIT_TIMEOUT"
HEARTBEAT_TIMEOUT = "JDP_HEARTBEAT_TIMEOUT"
SHUTDOWN_TIMEOUT = "JDP_SHUTDOWN_TIMEOUT"
CLUSTER_DETECTION = "JDP_CLUSTER_DETECTION"
PROGRESS_TIMEOUT = "JDP_PROGRESS_TIMEOUT"
STARTUP_TIMEOUT = "JDP_STARTUP_TIMEOUT"   # with a progress timeout: the most a round waits
                                          # for its first record (default 600 s)
STOP_GRACE = "JDP_STOP_GRACE"
PROFILE_STEPS = "JDP_PROFILE_STEPS"   # "A:B": trace training steps A..B on every rank
PROFILE_DIR = "JDP_PROFILE_DIR"       # where the ranks write their traces (rank.K below it)
COMPILATION_CACHE = "JAX_COMPILATION_CACHE_DIR"

# Fault-tolerant replica groups (jdp.ft): set by `jdp.launch --replica_group G --replica_groups
# R [--ft_lighthouse ...]`, by the user under srun/mpirun.
REPLICA_GROUP = "JDP_REPLICA_GROUP"      # this group's index, 0..R-1
REPLICA_GROUPS = "JDP_REPLICA_GROUPS"    # the job's number of replica groups R
FT_LIGHTHOUSE = "JDP_FT_LIGHTHOUSE"      # torchft's Lighthouse: http://HOST:PORT
FT_EVENTS = "JDP_FT_EVENTS"              # the JSON-lines file the group's process 0 appends
                                         # its events to (join, commit, discard, heal)

# Between a supervisor and its ranks (internal).
PROGRESS_FILE = "JDP_PROGRESS_FILE"       # the rank's progress slot (_progress.py)
DEVICES_PER_PROCESS = "JDP_DEVICES_PER_PROCESS"   # --devices_per_process, to check XLA_FLAGS
INTERNAL_VARS = (SUPERVISOR_PID, ERROR_FILE, SPAWN_BOOTSTRAP, PROGRESS_FILE, STACK_FILE,
                 DEVICES_PER_PROCESS)
HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"   # XLA's simulated CPU devices


# --- the user's settings, parsed at start (a bad one is a one-line error, never ignored) ---
_WHOLE_SECONDS = {INIT_TIMEOUT: 60, HEARTBEAT_TIMEOUT: 30, SHUTDOWN_TIMEOUT: 300}
_SECONDS = {PROGRESS_TIMEOUT: 600, STOP_GRACE: 30, STARTUP_TIMEOUT: 600}
MAX_SECONDS = 7 * 24 * 3600.0   # a week: beyond it a wait is a mistake (and past ~292 years,
                                # threading's TIMEOUT_MAX, an OverflowError in a waiting thread)
_SWITCHES = {"JDP_MALLOC_TUNING": ("0", "1", "off", "on", "false", "true", "no", "yes")}


def seconds(env, name: str) -> float | None:
    """`name`'s value as a finite number of seconds > 0 (None when unset or empty); a
    ValueError naming the variable, its value and an example otherwise."""
    raw = env.get(name, "")
    if not raw.strip():
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    whole = name in _WHOLE_SECONDS
    if not (0 < value <= MAX_SECONDS) or whole and (value < 1 or value != int(value)):
        kind = ("a whole number of seconds >= 1" if whole else "a number of seconds > 0") + \
            f" and <= {MAX_SECONDS:g} (a week)"
        example = _WHOLE_SECONDS.get(name) or _SECONDS.get(name)
        raise ValueError(f"{name}={raw!r} must be {kind}; set e.g. {name}={example}, or unset it")
    return value


def check_settings(env) -> None:
    """Parse every JDP_* setting a user may give (timeouts, the stop grace, switches), so a bad
    value stops the job at start instead of turning a feature silently off."""
    for name in (*_WHOLE_SECONDS, *_SECONDS):
        seconds(env, name)
    for name, allowed in _SWITCHES.items():
        if env.get(name, "1").strip().lower() not in allowed:
            raise ValueError(f"{name}={env[name]!r} is not one of {', '.join(allowed)}; "
                             f"set {name}={allowed[0]} to turn it off, or unset it")
