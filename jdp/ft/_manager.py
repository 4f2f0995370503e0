"""torchft's `Manager` for this process of this replica group, on a gloo process group.

The Manager asks the Lighthouse for each step's quorum (through the group's manager server,
run by the group's process 0), reconfigures the process group that spans the groups, serves
this process's state to a healing peer and fetches a peer's when this group heals. It needs a
TCPStore per group: the group's process 0 runs one on a free port and broadcasts the port to
the group's other processes.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import warnings
from collections.abc import Callable
from datetime import timedelta

import jax
import numpy as np

from jdp.distributed import broadcast_for
from jdp.ft import lighthouse as _lighthouse
from jdp.ft._coords import Coordinates

HEARTBEAT_MS = 100     # the manager server's heartbeat to the Lighthouse
OP_TIMEOUT_S = 10      # default: an all-reduce, a commit vote, a state transfer
SETUP_TIMEOUT_S = 1    # default: the process group's set-up across a quorum's groups
CONNECT_TIMEOUT_S = 10
ACCESS_LOG = "jdp.ft.checkpoint_server"   # torchft's checkpoint server's access lines
SUM_LOG = "jdp.ft.sum"   # the traceback of a failed all-reduce across groups (`Sum`)


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


def torchft_log(events: str | None, index: int) -> str | None:
    """Send torchft's own log, the traceback of every failed all-reduce across groups (`Sum`)
    and torchft's checkpoint server's access log ("GET /checkpoint/0/full") to
    `torchft.K.log` beside the group's events file (K: this process's index in the group),
    or, without an events file, to the logger `jdp.ft.torchft` at debug level. The console
    keeps jdp's one line per discarded step. Returns the file's path (None: none)."""
    path = (os.path.join(os.path.dirname(events), f"torchft.{index}.log")
            if events else None)
    handler: logging.Handler = _Relay()
    if path is not None:
        try:
            handler = logging.FileHandler(path)
        except OSError:
            path = None
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name, level in (("torchft", logging.WARNING), (SUM_LOG, logging.WARNING),
                        (ACCESS_LOG, logging.INFO)):
        log = logging.getLogger(name)
        for old in [h for h in log.handlers if getattr(h, "_jdp", False)]:
            log.removeHandler(old)
            old.close()
        handler._jdp = True
        log.addHandler(handler)
        log.setLevel(level)
        log.propagate = False
    return path


class _Relay(logging.Handler):
    """torchft's records, passed on at debug level under `jdp.ft.torchft`."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("jdp.ft.torchft").debug(self.format(record))


def _quiet_access_log(m) -> None:
    """torchft's checkpoint server writes an access line per request, and a traceback for a
    peer that went away mid-transfer, to stderr (the standard library's defaults): to the
    ACCESS_LOG logger instead. The server is a private attribute of torchft's HTTP transport;
    without it the lines stay on stderr."""
    server = getattr(getattr(m, "_checkpoint_transport", None), "_server", None)
    handler = getattr(server, "RequestHandlerClass", None)
    if handler is not None:
        handler.log_message = _log_request
        server.handle_error = _log_error


def _log_error(request, client_address) -> None:
    logging.getLogger(ACCESS_LOG).warning("a request from %s failed", client_address,
                                          exc_info=True)


def _log_request(self, format: str, *args) -> None:   # noqa: A002 - the library's name
    logging.getLogger(ACCESS_LOG).info("%s %s", self.address_string(), format % args)


def manager(coords: Coordinates, state_dict: Callable, load_state_dict: Callable,
            quorum_timeout_s: float, timeout_s: float = OP_TIMEOUT_S,
            setup_timeout_s: float = SETUP_TIMEOUT_S):
    """`(manager, process_group, store)`: a torchft Manager for this process, healing
    through `state_dict` / `load_state_dict`, on a gloo process group across the groups.

    The quorum is synchronous (a healing group loads its peer's state before it computes).
    torchft's `init_sync` stays off, so no quorum at step 0 moves a state: a fresh job's
    groups poll many quorums while they wait for each other, and the first step gives every
    group one state itself, once (`_agreement.initial_state`).
    """
    os.environ.setdefault("RUST_LOG", "warn")   # torchft's servers log every quorum at info
    _quiet_torchft()
    _lighthouse.server_class()   # the one-line ImportError without the extra
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo
    host = host_name()
    store, port = group_store(host)
    pg = bounded_set_up(ProcessGroupGloo, setup_timeout_s)(timeout=timedelta(seconds=timeout_s))
    m = Manager(pg=pg, load_state_dict=load_state_dict, state_dict=state_dict,
                min_replica_size=1, use_async_quorum=False,
                timeout=timedelta(seconds=timeout_s),
                quorum_timeout=timedelta(seconds=quorum_timeout_s),
                connect_timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
                rank=jax.process_index(), world_size=jax.process_count(),
                store_addr=host, store_port=port, lighthouse_addr=coords.lighthouse,
                replica_id=f"jdp_group_{coords.group}", hostname=host,
                heartbeat_interval=timedelta(milliseconds=HEARTBEAT_MS), init_sync=False)
    _quiet_access_log(m)
    return m, pg, store


def bounded_set_up(gloo: type, seconds: float = SETUP_TIMEOUT_S) -> type:
    """torchft's gloo process group whose set-up across a new quorum's groups (the store's
    rendezvous and gloo's full mesh) waits at most `seconds` (and `timeout`), its
    collectives still `timeout`. The quorum reaches every group at once, so a set-up takes
    milliseconds, unless a group died after it asked for the quorum: the others then waited
    the whole `timeout` for it before the next quorum (a 10 s stall); now `seconds`, and a
    set-up that fails is one discarded attempt."""
    import torch  # the ft extra's, as `gloo` is

    class BoundedSetUp(gloo):
        def configure(self, store_addr: str, *args, **kwargs) -> None:
            limit = min(self._timeout, timedelta(seconds=seconds))
            reached(store_addr, limit.total_seconds())
            # torchft's wrapper reads its private `_timeout` for the store client and gloo's
            # set-up alike; the torch backend it made then takes the collectives' timeout
            timeout = self._timeout
            self._timeout = limit
            try:
                super().configure(store_addr, *args, **kwargs)
            finally:
                self._timeout = timeout
            # `_get_backend` is torch's (private) way to the gloo backend of a process group
            self._pg._get_backend(torch.device("cpu")).set_timeout(timeout)
    return BoundedSetUp


def reached(store_addr: str, seconds: float) -> None:
    """Raise TimeoutError unless the quorum's store (`HOST:PORT/prefix`, torchft's form)
    takes a client within `seconds`, a deadline. torch's store client retries a connection
    with pauses between tries, each try up to its timeout, so a store whose process was
    dying when the quorum formed held the set-up 2.4 s with a 1 s timeout. The trial client
    runs on a thread of its own, left to fail alone when it is late."""
    from torch.distributed import TCPStore
    host, _, port = store_addr.partition("/")[0].rpartition(":")
    done, took = threading.Event(), []

    def connect() -> None:
        with contextlib.suppress(Exception):   # a failure is the same as lateness
            TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                     timeout=timedelta(seconds=seconds))
            took.append(True)
        done.set()
    threading.Thread(target=connect, daemon=True, name="jdp-ft-store").start()
    if not done.wait(seconds) or not took:
        raise TimeoutError(f"jdp.ft: the quorum's store at {host}:{port} took no client "
                           f"within {seconds:g} s (the group that holds it died?)")


def unreachable(error: Exception, lighthouse: str, past: int) -> str | None:
    """The one line for torchft's failure to reach the Lighthouse at `lighthouse` (None: the
    error is another). A group whose record shows `past` > 0 steps had trained under that
    Lighthouse in this job: it is gone (the launcher that started it ended, or its machine),
    no quorum can form again, and the caller stops for good; a first start names the fix."""
    text = str(error)
    if "failed to connect" not in text or lighthouse.rstrip("/") not in text:
        return None
    if past > 0:
        return (f"jdp.ft: the Lighthouse at {lighthouse} did not answer within "
                f"{CONNECT_TIMEOUT_S} s, and this group had committed {past} steps under it: "
                "it is gone (the launcher that started it with --ft_lighthouse start has "
                "ended, or its machine), so no quorum can form; restart the job from a "
                "checkpoint, with a Lighthouse that outlives every group (python -m "
                "jdp.ft.lighthouse) for a long job")
    return (f"jdp.ft: the Lighthouse at {lighthouse} did not answer within {CONNECT_TIMEOUT_S} "
            "s: start one (jdp.launch --ft_lighthouse start on one group's launcher, or python "
            "-m jdp.ft.lighthouse) and give every group its HOST:PORT (--ft_lighthouse, or "
            "JDP_FT_LIGHTHOUSE)")


class Sum:
    """An all-reduce (sum) of host tensors across the quorum's groups, in place, started now
    and waited for later: one tensor's collective at a time, on a thread of its own.

    One at a time, not all in flight at once: with several in flight, a process whose first
    collectives failed when a group died could wait on a later one its peers would never
    finish, and keep them waiting with it (for seconds, up to the collectives' timeout).
    With one, the process that sees the failure has nothing else in flight: it closes its
    links at once (`pg.abort`), which fails every survivor's collective too, and they all
    go on to the next quorum. torchft's rules are kept: nothing is sent after an error in
    this quorum (the attempt is lost anyway), and a group that heals in this quorum adds
    zeros."""

    def __init__(self, manager, pg, tensors: list):
        self._manager, self._pg, self._thread = manager, pg, None
        if manager.errored():
            return
        manager.wait_quorum()
        if not manager.is_participating():
            for t in tensors:
                t.zero_()
        self._thread = threading.Thread(target=self._run, args=(tensors,), daemon=True,
                                        name="jdp-ft-sum")
        self._thread.start()

    def _run(self, tensors: list) -> None:
        from torch.distributed import AllreduceOptions, ReduceOp
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        try:
            for t in tensors:
                self._pg.allreduce([t], opts).wait()
        except Exception as e:   # noqa: BLE001 - any failure is the attempt's, as in torchft
            self._manager.report_error(e)
            self._pg.abort()
            logging.getLogger(SUM_LOG).warning("the all-reduce across groups failed",
                                               exc_info=True)

    def wait(self) -> bool:
        """Wait for the sum (the collectives' own timeout bounds it); False when it failed
        (reported to torchft: the attempt is discarded)."""
        if self._thread is not None:
            self._thread.join()
        elif self._manager.errored() is not None:
            self._pg.abort()   # the error came before: its links may still be open
        return self._manager.errored() is None
