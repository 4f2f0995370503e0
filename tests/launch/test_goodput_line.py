"""The goodput line says "steps redone" only for failed rounds a restart followed: the steps a
job's failed last round ran after its checkpoint were lost, not redone."""
import pytest

from jdp.launch import _goodput


def line(lost_steps, last_failed):
    summary = {"buckets_s": dict.fromkeys(_goodput.BUCKETS, 1.0), "goodput": 0.5,
               "wall_s": 10.0, "stragglers": [], "lost_steps": lost_steps,
               "last_round_failed": last_failed}
    return _goodput.Ledger("the launcher").line(summary)


@pytest.mark.parametrize("lost, last_failed, said, unsaid", [
    ([], False, [], ["redone", "lost in"]),
    ([3, 2], False, ["(5 steps redone after 2 restart(s))"], ["lost in"]),
    ([7], True, ["(7 steps since the last checkpoint lost in the failed last round)"],
     ["redone"]),
    ([3, 7], True, ["(3 steps redone after 1 restart(s); 7 steps since the last checkpoint "
                    "lost in the failed last round)"], []),
])
def test_redone_only_after_a_restart(lost, last_failed, said, unsaid):
    text = line(lost, last_failed)
    for words in said:
        assert words in text, text
    for words in unsaid:
        assert words not in text, text

