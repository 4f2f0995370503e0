"""The emulated link between replica groups (`JDP_FT_NETWORK`): when an all-reduce's result
and a quorum's answer would arrive, against the link's figures computed by hand."""
import pytest

from jdp.ft import _network


def test_a_link_is_read_from_gbit_and_latency_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.delenv(_network.ENV, raising=False)
    assert _network.link() is None
    monkeypatch.setenv(_network.ENV, "1,0.01")
    assert _network.link() == (1e9, 0.01)
    for bad in ("1", "0,0.01", "1,-1", "fast,slow"):
        monkeypatch.setenv(_network.ENV, bad)
        with pytest.raises(ValueError, match=rf"^{_network.ENV}={bad!r}: give GBIT,LATENCY"):
            _network.link()


def test_an_all_reduce_takes_the_latency_and_a_ring_of_its_bytes_and_a_quorum_the_latency():
    link = (1e9, 0.01)
    # 3 groups, 1.5 MB: latency + 2 (n - 1) / n x 12e6 bits / 1e9 bit/s = 0.01 + 0.016 s
    assert _network.ready_at(link, 100.0, 1_500_000, 3) == pytest.approx(100.026)
    assert _network.ready_at(link, 100.0, 1_500_000, 1) == 100.0   # alone: nothing crosses
    assert _network.ready_at(None, 100.0, 1_500_000, 3) == 100.0
    assert _network.quorum_at(link, 100.0) == pytest.approx(100.01)
    assert _network.quorum_at(None, 100.0) == 100.0
