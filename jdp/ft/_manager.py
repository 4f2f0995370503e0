"""torchft's `Manager` for this process of this replica group, on a gloo process group.

The Manager asks the Lighthouse for each step's quorum (through the group's manager server,
run by the group's process 0), reconfigures the process group that spans the groups, serves
this process's state to a healing peer and fetches a peer's when this group heals. It needs a
TCPStore per group: the group's process 0 runs one on a free port and broadcasts the port to
the group's other processes.
"""
from __future__ import annotations

import logging
import os
import socket
import warnings
from collections.abc import Callable
from datetime import timedelta

import jax
import numpy as np

from jdp.distributed import broadcast_for
from jdp.ft import lighthouse as _lighthouse
from jdp.ft._coords import Coordinates

HEARTBEAT_MS = 100     # the manager server's heartbeat to the Lighthouse
OP_TIMEOUT_S = 10      # default: an all-reduce, a commit vote, a state transfer, a set-up
CONNECT_TIMEOUT_S = 10


def host_name() -> str:
    """The name other groups reach this group at: MASTER_ADDR when the launcher gave a
    routable one (a group of several nodes), else this machine's name."""
    addr = os.environ.get("MASTER_ADDR", "")
    return addr if addr and not addr.startswith("127.") and addr != "localhost" \
        else socket.gethostname()


def group_store(host: str):
    """The group's TCPStore: served by its process 0, joined by the others."""
    from torch.distributed import TCPStore
    if jax.process_index() == 0:
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        port = store.port
    else:
        store, port = None, 0
    if jax.process_count() > 1:
        port = int(broadcast_for(np.int32(port), "jdp.ft.Replicas"))
    return store, port


def _quiet_torchft() -> None:
    """Drop two messages that say nothing on CPU: torchft's note that it cannot reset NCCL's
    flight recorder (at every new quorum) and torch's warning that a healed buffer arrived
    read-only (it is copied into the group's devices at once)."""
    log = logging.getLogger("torchft.manager")
    if _no_flight_recorder not in log.filters:
        log.addFilter(_no_flight_recorder)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def _no_flight_recorder(record: logging.LogRecord) -> bool:
    return "flight recorder" not in record.getMessage()


def manager(coords: Coordinates, state_dict: Callable, load_state_dict: Callable,
            quorum_timeout_s: float, timeout_s: float = OP_TIMEOUT_S):
    """`(manager, process_group, store)`: a torchft Manager for this process, healing
    through `state_dict` / `load_state_dict`, on a gloo process group across the groups.

    The quorum is synchronous (a healing group loads its peer's state before it computes),
    and a fresh job's first step syncs every group's state from one of them (`init_sync`).
    """
    os.environ.setdefault("RUST_LOG", "warn")   # torchft's servers log every quorum at info
    _quiet_torchft()
    _lighthouse.server_class()   # the one-line ImportError without the extra
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo
    host = host_name()
    store, port = group_store(host)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))
    m = Manager(pg=pg, load_state_dict=load_state_dict, state_dict=state_dict,
                min_replica_size=1, use_async_quorum=False,
                timeout=timedelta(seconds=timeout_s),
                quorum_timeout=timedelta(seconds=quorum_timeout_s),
                connect_timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
                rank=jax.process_index(), world_size=jax.process_count(),
                store_addr=host, store_port=port, lighthouse_addr=coords.lighthouse,
                replica_id=f"jdp_group_{coords.group}", hostname=host,
                heartbeat_interval=timedelta(milliseconds=HEARTBEAT_MS), init_sync=True)
    return m, pg, store
