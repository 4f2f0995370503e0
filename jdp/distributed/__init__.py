"""The process group: `initialize()` from the environment, and process-level helpers."""
from jdp.distributed._group import broadcast_from_primary, is_primary, process_count, process_index
from jdp.distributed._init import barrier, initialize, shutdown
from jdp.distributed._log import get_logger, print0

# For jdp's other packages (the step core, data, checkpoint, the pmap form); not re-exported by
# jdp: the job check every entry point makes, the cross-process agreement, and the broadcast
# that names its caller in its errors.
from jdp.distributed._group import AGREE_TIMEOUT_S, agree, require_job
from jdp.distributed._group import broadcast as broadcast_for

__all__ = ["AGREE_TIMEOUT_S", "agree", "barrier", "broadcast_for", "broadcast_from_primary",
           "get_logger", "initialize", "is_primary", "print0", "process_count", "process_index",
           "require_job", "shutdown"]
