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
