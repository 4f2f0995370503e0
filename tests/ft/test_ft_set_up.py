"""The process group across a quorum's groups (`_manager.bounded_set_up`): its set-up waits at
most `SETUP_TIMEOUT_S` for a group that never comes (one that died after it asked for the
quorum), while its collectives keep the `timeout` they were given. A real TCPStore and torchft's
gloo process group in this process."""
import time
from datetime import timedelta

import pytest

from jdp.ft import _manager

pytest.importorskip("torchft")
torch = pytest.importorskip("torch")


def test_a_set_up_waits_one_second_for_a_missing_group_and_collectives_keep_their_timeout():
    from torch.distributed import TCPStore
    from torchft.process_group import ProcessGroupGloo
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = _manager.bounded_set_up(ProcessGroupGloo)(timeout=timedelta(seconds=10))
    pg.configure(f"127.0.0.1:{store.port}/quorum/1", "group_0", 0, 1)   # alone: at once
    backend = pg._pg._get_backend(torch.device("cpu"))
    assert backend.options._timeout == timedelta(seconds=10)   # the collectives' timeout
    x = torch.ones(3)
    pg.allreduce([x], torch.distributed.AllreduceOptions()).wait()
    assert x.tolist() == [1.0, 1.0, 1.0]
    began = time.monotonic()
    with pytest.raises(Exception, match="timeout"):   # the second group never comes
        pg.configure(f"127.0.0.1:{store.port}/quorum/2", "group_0", 0, 2)
    waited = time.monotonic() - began
    assert _manager.SETUP_TIMEOUT_S <= waited < _manager.SETUP_TIMEOUT_S + 2, waited
    assert pg._timeout == timedelta(seconds=10)   # and the next set-up's collectives too


def test_a_store_that_takes_no_client_fails_the_set_up_by_its_deadline():
    """A quorum's store whose process is dying still completes connections in the kernel and
    never answers: torch's client retries with pauses, each try up to its timeout (2.4 s seen
    at a 1 s timeout); the set-up gives up at SETUP_TIMEOUT_S, naming the store."""
    import socket

    from torchft.process_group import ProcessGroupGloo
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)   # connections complete, nothing ever reads or answers them
    port = mute.getsockname()[1]
    pg = _manager.bounded_set_up(ProcessGroupGloo)(timeout=timedelta(seconds=10))
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=f"store at 127.0.0.1:{port} took no client"):
        pg.configure(f"127.0.0.1:{port}/quorum/1", "group_0", 0, 2)
    waited = time.monotonic() - began
    mute.close()
    assert _manager.SETUP_TIMEOUT_S <= waited < _manager.SETUP_TIMEOUT_S + 0.5, waited


def test_the_sum_across_groups_adds_every_tensor_and_a_failure_is_reported(caplog):
    """`_manager.Sum` (one collective at a time, on its own thread) on a real gloo process
    group of one: every tensor, of either dtype, comes back (the sum over one group is itself);
    on a process group that fails, the error reaches torchft's manager, its traceback the
    group's torchft log (`SUM_LOG`), and `wait` says False.
    The sums across groups are checked against replays in tests/system/ft."""
    from torch.distributed import TCPStore
    from torchft.process_group import ProcessGroupGloo

    class Manager:   # what Sum asks of torchft's manager
        def __init__(self):
            self.error = None

        def errored(self):
            return self.error

        def wait_quorum(self):
            pass

        def is_participating(self):
            return True

        def report_error(self, e):
            self.error = e

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = _manager.bounded_set_up(ProcessGroupGloo)(timeout=timedelta(seconds=10))
    pg.configure(f"127.0.0.1:{store.port}/quorum/1", "group_0", 0, 1)
    tensors = [torch.arange(4.0), torch.ones(2, dtype=torch.float64)]
    manager = Manager()
    assert _manager.Sum(manager, pg, tensors).wait() and manager.error is None
    assert tensors[0].tolist() == [0.0, 1.0, 2.0, 3.0] and tensors[1].tolist() == [1.0, 1.0]
    pg.abort()   # its collectives now fail
    with caplog.at_level("WARNING", logger=_manager.SUM_LOG):
        assert not _manager.Sum(manager, pg, [torch.ones(3)]).wait()
    assert manager.error is not None
    assert "all-reduce across groups failed" in caplog.text and "Traceback" in caplog.text


def test_the_set_up_deadline_is_an_option_checked_in_one_line():
    """`Replicas(setup_timeout=S)` sets the deadline of `bounded_set_up`; a bad value is one
    line naming it (checked before anything joins)."""
    from torchft.process_group import ProcessGroupGloo

    from jdp.ft import Replicas
    mute = __import__("socket").socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    pg = _manager.bounded_set_up(ProcessGroupGloo, 0.3)(timeout=timedelta(seconds=10))
    began = time.monotonic()
    with pytest.raises(TimeoutError, match="within 0.3 s"):
        pg.configure(f"127.0.0.1:{mute.getsockname()[1]}/quorum/1", "group_0", 0, 2)
    assert time.monotonic() - began < 0.8
    mute.close()
    with pytest.raises(ValueError, match="setup_timeout"):
        Replicas({"w": 0.0}, setup_timeout=-1)
