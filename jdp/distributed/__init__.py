"""The process group: `initialize()` from the environment, and process-level helpers."""
from jdp.distributed._group import broadcast_from_primary, is_primary, process_count, process_index
from jdp.distributed._init import barrier, initialize, shutdown
from jdp.distributed._log import get_logger, print0

__all__ = ["barrier", "broadcast_from_primary", "get_logger", "initialize", "is_primary",
           "print0", "process_count", "process_index", "shutdown"]
