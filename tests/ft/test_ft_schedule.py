"""When a semi-synchronous group's fragments sync (`jdp.ft._outer.Outer.due`): each fragment
every H steps at its offset, and at the run's end every fragment once, in place of the
regular syncs the end follows within H steps, so that no run sends more than one model per
H steps."""
import pytest

from jdp.ft._outer import Outer


@pytest.mark.parametrize("every, fragments", [(20, 4), (8, 2), (6, 3), (5, 1), (4, 1)])
def test_a_fragment_syncs_every_h_steps_and_a_run_sends_at_most_a_model_per_h(every,
                                                                                fragments):
    outer = Outer(every, None, fragments)
    stride = every // fragments
    for steps in range(every, 4 * every + 1):
        due = {s: outer.due(s, steps) for s in range(1, steps)}
        for f in range(fragments):
            regular = [s for s, g in due.items() if g == f]
            offsets = range((f + 1) * stride, steps - every + 1, every)   # s + H <= the end
            assert regular == list(offsets), (steps, f, regular)
            last = regular[-1] if regular else 0   # the start is a sync too
            assert steps - last < 2 * every, (steps, f, last)
        syncs = sum(g is not None for g in due.values()) + fragments   # the end: every one
        assert syncs / fragments <= steps / every, (steps, syncs)
