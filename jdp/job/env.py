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
STOP_GRACE = "JDP_STOP_GRACE"
COMPILATION_CACHE = "JAX_COMPILATION_CACHE_DIR"

# Between a supervisor and its ranks (internal).
PROGRESS_FILE = "JDP_PROGRESS_FILE"       # the rank's progress slot (_progress.py)
INTERNAL_VARS = (SUPERVISOR_PID, ERROR_FILE, SPAWN_BOOTSTRAP, PROGRESS_FILE, STACK_FILE)
