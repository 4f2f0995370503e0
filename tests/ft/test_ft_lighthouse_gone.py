"""A Lighthouse that does not answer, met by torchft's real Manager in this process: one jdp
line, final (exit 78) for a group whose record shows it had trained under that Lighthouse
(it is gone: its launcher ended), the fix for a first start."""
from types import SimpleNamespace

import pytest
from conftest import free_port

from jdp.ft import _coords, _manager, _replicas
from jdp.job import run as _run

pytest.importorskip("torchft")


def _torchft_error(monkeypatch, address: str) -> RuntimeError:
    monkeypatch.setattr(_manager, "CONNECT_TIMEOUT_S", 1)
    coords = _coords.Coordinates(0, 2, address)
    with pytest.raises(RuntimeError) as caught:
        _manager.manager(coords, dict, lambda state: None, quorum_timeout_s=5.0)
    return caught.value


def test_a_lighthouse_that_does_not_answer_is_named_and_a_group_that_trained_stops(
        monkeypatch):
    address = f"http://127.0.0.1:{free_port()}"
    error = _torchft_error(monkeypatch, address)
    gone = _manager.unreachable(error, address, past=22)
    assert gone.startswith(f"jdp.ft: the Lighthouse at {address} did not answer within 1 s, "
                           "and this group had committed 22 steps under it: it is gone"), gone
    assert gone.endswith("python -m jdp.ft.lighthouse) for a long job") and "\n" not in gone
    first = _manager.unreachable(error, address, past=0)
    assert first.startswith(f"jdp.ft: the Lighthouse at {address} did not answer within 1 s: "
                            "start one"), first
    assert _manager.unreachable(error, "http://127.0.0.1:1", past=22) is None   # not its own
    assert _manager.unreachable(RuntimeError("gloo: timed out"), address, past=22) is None


@pytest.mark.parametrize("past, code", [(22, _run.FINAL_EXIT), (0, 1)])
def test_the_group_raises_the_line_with_its_exit_status(monkeypatch, past, code):
    """`Replicas`' own call: a group that had trained stops for good, a first start does not."""
    monkeypatch.setattr(_manager, "CONNECT_TIMEOUT_S", 1)
    me = SimpleNamespace(past=past)
    group = SimpleNamespace(coords=_coords.Coordinates(0, 2, f"http://127.0.0.1:{free_port()}"),
                            _me=me, _state_dict=dict, _load_state_dict=lambda state: None)
    with pytest.raises(RuntimeError, match="^jdp.ft: the Lighthouse at ") as caught:
        _replicas.Replicas._torchft(group, 5.0, 5.0, 1.0)
    assert _run.failure_code(caught.value) == code
