"""The process group: `initialize()` from the environment, and process-level helpers.

For jdp's other packages (the step core, data, checkpoint, the pmap form), not re-exported by
jdp: `require_job` (the check every entry point makes), `agree` (that every process asks the
same) and `broadcast_for` (process 0's values, the caller named in the errors).
"""
from jdp.distributed._group import (
    AGREE_TIMEOUT_S,
    agree,
    barrier,
    broadcast_for,
    broadcast_from_primary,
    is_primary,
    process_count,
    process_index,
    require_job,
)
from jdp.distributed._init import initialize, shutdown
from jdp.distributed._log import get_logger, print0
from jdp.distributed._node import devices_per_node, processes_per_node
from jdp.distributed._pieces import agree_once

__all__ = ["AGREE_TIMEOUT_S", "agree", "agree_once", "barrier", "broadcast_for",
           "broadcast_from_primary", "devices_per_node",
           "get_logger", "initialize", "is_primary", "print0", "process_count", "process_index",
           "processes_per_node", "require_job", "shutdown"]
