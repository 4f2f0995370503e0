"""A replica group's events file read back as the summary's "ft" section and its line: every
number below is worked out by hand from the hand-written events."""
import json

# private: the launcher's summary of the events has no public name
from jdp.launch import _cli, _ft

WHO = _cli.WHO   # jdp.launch

T = 1000.0


def commit(step, groups, seconds, at):
    return {"event": "commit", "step": step, "groups": groups, "seconds": seconds, "time": T + at}


def discard(step, groups, seconds, at):
    return {"event": "discard", "step": step, "groups": groups, "seconds": seconds,
            "time": T + at, "error": "peer lost"}


# Group 1 of 3. Group 2 is killed in step 3 (one discarded attempt, then steps 3-4 with groups
# 0 and 1), heals back for steps 5-6; group 0 leaves between steps (step 7 with groups 1 and 2,
# no discard); group 1 itself restarts and heals at step 7; an attempt at step 9 is discarded
# and the job ends before any commit after it.
EVENTS = [
    {"event": "join", "group": 1, "restart": 0, "time": T},
    commit(1, [0, 1, 2], 0.5, 1.0),
    commit(2, [0, 1, 2], 0.5, 1.5),
    discard(3, [0, 1, 2], 0.25, 2.0),
    commit(3, [1, 0], 0.5, 3.5),        # stall: 1003.5 - 0.5 - 1001.5 = 1.5 s
    commit(4, [0, 1], 0.5, 4.0),
    commit(5, [0, 1, 2], 0.5, 4.5),
    commit(6, [0, 1, 2], 0.5, 5.0),
    commit(7, [1, 2], 0.5, 7.5),        # a drop with no discard: 1007.5 - 0.5 - 1005.0 = 2.0 s
    {"event": "join", "group": 1, "restart": 1, "time": T + 9.0},
    {"event": "heal", "step": 7, "seconds": 0.375, "time": T + 10.0},
    commit(8, [0, 1, 2], 0.5, 10.5),    # a group coming back is no failure
    discard(9, [0, 1, 2], 0.125, 11.0),
]


def test_the_section_counts_commits_discards_steps_with_fewer_groups_and_heals():
    ft = _ft.section(EVENTS, group=1, groups=3)
    assert ft["group"] == 1 and ft["groups"] == 3
    assert ft["committed"] == 8                 # steps 1..8
    assert ft["discarded"] == 2                 # at steps 3 and 9
    assert ft["discarded_s"] == 0.375           # 0.25 + 0.125
    assert ft["fewer_groups_steps"] == 3        # steps 3, 4 ([0, 1]) and 7 ([1, 2])
    assert ft["heals"] == [{"step": 7, "seconds": 0.375}]


def test_quorums_are_the_runs_of_the_committed_steps_group_sets():
    assert _ft.section(EVENTS, 1, 3)["quorums"] == [
        [1, 2, [0, 1, 2]], [3, 4, [0, 1]], [5, 6, [0, 1, 2]], [7, 7, [1, 2]], [8, 8, [0, 1, 2]]]


def test_a_step_redone_after_a_restart_from_an_older_step_starts_a_new_run():
    events = [commit(1, [0], 1, 1), commit(2, [0], 1, 2), commit(2, [0], 1, 9)]
    assert _ft.quorums(events) == [[1, 2, [0]], [2, 2, [0]]]


def test_failures_are_each_discard_and_each_unexplained_drop_with_its_stall():
    assert _ft.section(EVENTS, 1, 3)["failures"] == [
        {"step": 3, "stall_s": 1.5, "groups_after": [0, 1]},
        {"step": 7, "stall_s": 2.0, "groups_after": [1, 2]},
        {"step": 9, "stall_s": None, "groups_after": []},
    ]


def test_a_discard_before_any_commit_stalls_from_the_start_of_its_attempt():
    events = [{"event": "join", "group": 0, "restart": 0, "time": T},
              discard(1, [0, 1], 2.0, 10.0),    # its attempt began at 1008.0
              commit(1, [0], 1.0, 12.0)]        # 1012.0 - 1.0 - 1008.0 = 3.0 s
    ft = _ft.section(events, group=0, groups=2)
    assert ft["failures"] == [{"step": 1, "stall_s": 3.0, "groups_after": [0]}]
    assert ft["fewer_groups_steps"] == 1


def test_two_discards_before_one_commit_are_two_failures_with_the_same_stall():
    events = [commit(1, [0, 1, 2], 1.0, 1.0), discard(2, [0, 1, 2], 0.5, 1.5),
              discard(2, [0, 2], 0.5, 2.5), commit(2, [0], 1.0, 5.0)]   # 5 - 1 - 1 = 3.0 s
    assert _ft.failures(events) == [{"step": 2, "stall_s": 3.0, "groups_after": [0]}] * 2


def test_the_line_says_it_all_in_one_line():
    line = _ft.line(WHO, _ft.section(EVENTS, 1, 3))
    assert line == ("jdp.launch: ft group 1 of 3: 8 steps committed (3 with fewer groups), "
                    "2 discarded, 1 heal (0.4 s at step 7), down 3.0 s in 1 restart, stalls "
                    "3.5 s (1.5 s, 2.0 s, none after step 9 (no later commit))")


def test_a_stall_whose_wait_is_inside_the_next_commit_counts_the_wait():
    """The attempt after a kill waits in its quorum for the dead group: its own seconds hold
    the wait, so the stall is the gap between commits less an ordinary step (the median)."""
    events = [commit(1, [0, 1, 2], 0.25, 1.0), commit(2, [0, 1, 2], 0.25, 1.25),
              commit(3, [0, 1], 1.25, 2.5),     # 1.0 s of wait inside its 1.25 s
              commit(4, [0, 1], 0.25, 2.75)]
    assert _ft.failures(events) == [{"step": 3, "stall_s": 1.0, "groups_after": [0, 1]}]


def test_a_groups_own_restart_is_downtime_not_a_stall():
    events = [commit(1, [0, 1], 0.5, 1.0), commit(2, [0, 1], 0.5, 1.5),
              {"event": "join", "group": 1, "restart": 1, "time": T + 50.0},
              {"event": "heal", "step": 40, "seconds": 0.5, "time": T + 58.0},
              commit(41, [0, 1], 0.5, 59.0)]    # 1059.0 - 1001.5 = 57.5 s down
    assert _ft.failures(events) == []
    assert _ft.downtimes(events) == [{"step": 41, "downtime_s": 57.5}]


def test_a_healed_group_redid_no_step():
    s = {**summary(steps=6.0, lost=0.5), "lost_steps": [1404], "last_round_failed": False}
    assert _ft.amend(s, _ft.section(EVENTS, 1, 3))["lost_steps"] == [0]
    unhealed = _ft.section(EVENTS[:6], 1, 3)
    assert _ft.amend(s, unhealed)["lost_steps"] == [1404]


def test_the_line_of_a_quiet_run():
    ft = _ft.section([commit(1, [0, 1], 0.5, 1.0)], group=0, groups=2)
    assert _ft.line(WHO, ft) == ("jdp.launch: ft group 0 of 2: 1 step committed "
                                          "(0 with fewer groups), 0 discarded, 0 heals, "
                                          "no stalls")


def test_the_line_of_one_failure_gives_its_stall_alone():
    ft = _ft.section(EVENTS[:6], group=1, groups=3)
    assert _ft.line(WHO, ft).endswith(", 1 discarded, 0 heals, stalls 1.5 s")


def summary(steps, lost, wall=10.0):
    buckets = {"startup": 1.0, "steps": steps, "data": 0.0, "eval": 0.0, "checkpoint": 0.0,
               "lost": lost, "other": wall - 1.0 - steps - lost}
    return {"wall_s": wall, "buckets_s": buckets, "goodput": steps / wall,
            "ranks": {"0": {"buckets_s": dict(buckets), "phases_s": {}}}}


def test_discarded_attempts_move_from_steps_to_lost_work_in_the_goodput():
    ft = _ft.section(EVENTS, 1, 3)              # 0.375 s discarded
    out = _ft.amend(summary(steps=6.0, lost=0.5), ft)
    assert out["ft"] is ft
    for buckets in (out["buckets_s"], out["ranks"]["0"]["buckets_s"]):
        assert buckets["steps"] == 5.625 and buckets["lost"] == 0.875
        assert buckets["other"] == 2.5          # untouched: 10 - 1 - 6 - 0.5
    assert out["goodput"] == 0.5625             # 5.625 / 10


def test_no_more_than_the_steps_time_moves():
    out = _ft.amend(summary(steps=0.25, lost=0.0), _ft.section(EVENTS, 1, 3))
    assert out["buckets_s"]["steps"] == 0.0 and out["buckets_s"]["lost"] == 0.25
    assert out["goodput"] == 0.0


def test_no_events_no_section():
    assert _ft.section([], 0, 2) is None
    s = summary(steps=6.0, lost=0.0)
    assert _ft.amend(s, None) is s


def test_the_file_is_read_past_a_truncated_last_line(tmp_path):
    path = tmp_path / "ft_events.jsonl"
    lines = [json.dumps(e) for e in EVENTS[:4]]
    lines.insert(2, json.dumps({"event": "commit", "step": 9}))   # fields missing: skipped
    path.write_text("\n".join(lines) + '\n{"event": "commit", "step": 3, "gro')
    assert _ft.read_events(str(path)) == EVENTS[:4]


def test_an_absent_or_empty_file_is_no_events(tmp_path):
    assert _ft.read_events(str(tmp_path / "absent.jsonl")) == []
    assert _ft.read_events(None) == []
    (tmp_path / "empty.jsonl").write_text("")
    assert _ft.read_events(str(tmp_path / "empty.jsonl")) == []
