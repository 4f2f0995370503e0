"""The environment variables a jdp job is run with: one home for their names.

The launcher and `jdp.spawn` set them for each rank; `jdp.initialize`, the rank-side runner
(jdp/_run.py) and the progress recorder read them. Standard library only: the runner loads
this file before jax may be imported.
"""
from __future__ import annotations

# torchrun's variables, in the order rank_env fills them.
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

# Settings a user may put in the environment.
INIT_TIMEOUT = "JDP_INIT_TIMEOUT"
HEARTBEAT_TIMEOUT = "JDP_HEARTBEAT_TIMEOUT"
SHUTDOWN_TIMEOUT = "JDP_SHUTDOWN_TIMEOUT"
CLUSTER_DETECTION = "JDP_CLUSTER_DETECTION"
PROGRESS_TIMEOUT = "JDP_PROGRESS_TIMEOUT"
STOP_GRACE = "JDP_STOP_GRACE"
COMPILATION_CACHE = "JAX_COMPILATION_CACHE_DIR"

# Between a supervisor and its ranks (internal).
SUPERVISOR_PID = "JDP_SUPERVISOR_PID"     # the rank dies with this process (Linux)
ERROR_FILE = "JDP_ERROR_FILE"             # a failing rank writes its traceback here
SPAWN_BOOTSTRAP = "JDP_SPAWN_BOOTSTRAP"   # set while a jdp.spawn rank imports the parent's main
PROGRESS_FILE = "JDP_PROGRESS_FILE"       # the rank's progress slot (jdp/_progress.py)
STACK_FILE = "JDP_STACK_FILE"             # where the rank dumps its Python stacks on SIGUSR1
INTERNAL_VARS = (SUPERVISOR_PID, ERROR_FILE, SPAWN_BOOTSTRAP, PROGRESS_FILE, STACK_FILE)
