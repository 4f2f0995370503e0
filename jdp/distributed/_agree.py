"""Agreement points in the coordination service's key-value store, at O(1) requests a process.

An agreement point is the n-th call of `jdp.distributed._group.agree` for one topic ("broadcast",
"loader", "checkpoint-save"): every process must have passed the same facts. Per point each
process makes four requests: it notes where it waits (`at/RANK`, overwritten: one key per
process for the whole job), sets a 32-character hash of its facts, increments the point's
arrival counter, and waits for the point's verdict. The process whose increment makes the
count whole reads every hash at once (one directory read), writes the verdict (agreed, or the
two first groups of processes that differ) and deletes the hashes and the previous point's
keys, so the store holds the `at` keys and one point per topic whatever the job's length.
Only on a difference are facts sent, by one process on each side, to name the first fact
that differs; process 0 then raises only once every process has named it (`_all_named`).

Nothing waits forever: while a process waits for a verdict it looks, once every `poll_s`,
where process 0 waits; process 0 looks where the missing processes wait (one directory
read). A process that waits at a point this one has not begun means the processes took
different paths through the program: that deadlock is named at once (each process finds it
in its own wait), and a process that never comes is named after `timeout_s`. Process 0
writes such a finding as the verdict, so every process raises the same error; it prints it
before it lingers for the others to read theirs.

A process that is not at the point at all is asked where it is (over the roll call's
connections, `Peers`): one whose script has ended is named at once; after `ANNOUNCE_S` one that
went past this call (more steps run than the waiting process) is named too, and the job ends
on every process with one line naming the call, the missing processes, where they are and the
fix; one that is still on its way (behind, in start-up, data or a step it has not passed) is
waited for up to `timeout_s`, with a notice. The processes named are told the verdict, so each
prints it and exits 1 rather than being aborted later in a collective or at exit.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from jdp.job import run as _run

PREFIX = "jdp/agree/"
POLL_S = 1.0
SHOWN = 8             # ranks named per side of a difference
NAMED_WAIT_S = 5.0    # the most process 0 waits for the others to name a difference
ANNOUNCE_S = 10.0     # a process missing from a call this long is asked where it is
LINGER_S = 2 * POLL_S  # process 0 holds the store this long after an error verdict


class Process(NamedTuple):
    """One process of the job as agreement sees it; `rounds` counts the points it began, per
    topic, so the n-th call for a topic on one process meets the n-th on the others; `peers`
    (a `jdp.job.peers.Peers`, or None) says where the processes missing from a point are."""
    rank: int
    count: int
    rounds: dict
    peers: Any = None


class _Point(NamedTuple):
    topic: str
    n: int
    who: str
    keys: str         # this point's key directory, ending in "/"
    deadline: float
    since: float      # when this process arrived
    asked: list       # when the missing processes were asked where they are (each ANNOUNCE_S)


_ERRORS = {"RuntimeError": RuntimeError, "TimeoutError": TimeoutError}


def agree_in_store(client: Any, me: Process, topic: str, facts: Sequence[tuple[str, str]],
                   who: str, fix: str, timeout_s: float, poll_s: float = POLL_S) -> None:
    """Raise on every process unless all passed the same `facts` (see the module docstring).

    `client` is JAX's coordination client or anything with its key-value methods (the
    counting double in tests/doubles/memstore.py).
    """
    n = me.rounds[topic] = me.rounds.get(topic, 0) + 1
    now = time.monotonic()
    here = _Point(topic, n, who, f"{PREFIX}{topic}/{n}/", now + timeout_s, now, [])
    text = json.dumps([list(f) for f in facts])
    client.key_value_set(f"{PREFIX}at/{me.rank}", json.dumps([topic, n, who]),
                         allow_overwrite=True)
    client.key_value_set(f"{here.keys}hash/{me.rank}",
                         hashlib.sha256(text.encode()).hexdigest()[:32])
    if int(client.key_value_increment(f"{here.keys}arrived", 1)) == me.count:
        _judge(client, here)
    verdict = _verdict(client, me, here, timeout_s, poll_s)
    if "error" in verdict:
        _leave(me, verdict["message"])
        raise _ERRORS[verdict["error"]](verdict["message"])
    if "differ" in verdict:
        _name_difference(client, me, here, text, verdict["differ"], fix, timeout_s)


def _leave(me: Process, message: str) -> None:
    """Before raising an error verdict, say it, then let the other processes find theirs:
    process 0, which holds the store, lets them read it (at this point, or naming the same
    deadlock at theirs); another process waits two looks (`POLL_S`), so that a launcher that
    stops the job at the first failure (SIGTERM ends a rank at once) does not end a process
    before it has named the problem too. The raised error then says it again."""
    if me.peers is None:
        return
    print(message, file=sys.stderr, flush=True)
    time.sleep(LINGER_S if me.rank == 0 else 2 * POLL_S + 0.5)


def _judge(client: Any, here: _Point) -> None:
    """The last process to arrive: compare every hash, write the verdict, delete what no
    process will read again (this point's hashes, the previous point's keys)."""
    groups: dict[str, list[int]] = {}
    for key, digest in client.key_value_dir_get(f"{here.keys}hash/"):
        groups.setdefault(digest, []).append(int(key.rsplit("/", 1)[1]))
    sides = sorted((sorted(ranks) for ranks in groups.values()), key=lambda r: r[0])
    verdict = {"agreed": True} if len(sides) == 1 else {
        "differ": [[side[:SHOWN + 1], len(side)] for side in sides[:2]]}
    client.key_value_delete(f"{here.keys}hash/")   # first: once the verdict is out, process
    if here.n > 1:   # 0 may leave the job and take the store with it; every process has
        client.key_value_delete(f"{PREFIX}{here.topic}/{here.n - 1}/")   # left the last point
    _publish(client, here, verdict)


def _publish(client: Any, here: _Point, verdict: dict) -> None:
    """Write the verdict once (a second finding of the same point keeps the first)."""
    try:
        client.key_value_set(f"{here.keys}verdict", json.dumps(verdict))
    except Exception as e:  # noqa: BLE001 - ALREADY_EXISTS: another process judged first
        if "ALREADY_EXISTS" not in str(e):
            raise


def _verdict(client: Any, me: Process, here: _Point, timeout_s: float, poll_s: float) -> dict:
    """This point's verdict, waited for in slices of `poll_s`; between them, look for a
    deadlock or a process that never comes (see `_look`)."""
    late = 2 * poll_s + 1.0   # the others wait a little longer than process 0, which names
    while True:               # the missing processes
        left = here.deadline + (0 if me.rank == 0 else late) - time.monotonic()
        try:
            return json.loads(client.blocking_key_value_get(
                f"{here.keys}verdict", max(1, int(1000 * min(poll_s, max(left, 0.001))))))
        except Exception as e:  # noqa: BLE001 - JAX raises JaxRuntimeError for both
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
        if (found := _look(client, me, here, timeout_s, left <= 0)) is not None:
            return found


def _look(client: Any, me: Process, here: _Point, timeout_s: float, late: bool) -> dict | None:
    """An error verdict when a process this one waits for waits elsewhere, skipped this call
    (`_skipped`) or timed out."""
    if me.rank != 0:
        at = _at(client, 0)
        if at is not None and _not_begun(me, at):
            return _error("RuntimeError", _deadlock(here, me.rank, 0, at))
        if at != [here.topic, here.n, here.who] and (found := _skipped(client, me, here, [0])):
            return found
        if not late:
            return None
        return _error("TimeoutError", f"{here.who}: the processes did not all reach this call "
                      f"within {timeout_s:g} s (process {me.rank} waited; process 0, which "
                      "names the missing ones, did not answer)")
    arrived = {int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get(f"{here.keys}hash/")}
    missing = [r for r in range(me.count) if r not in arrived]
    if not missing or not arrived:   # judged meanwhile: the verdict is there
        return None
    wait_at = {int(k.rsplit("/", 1)[1]): json.loads(v)
               for k, v in client.key_value_dir_get(f"{PREFIX}at/")}
    for rank in missing:
        if rank in wait_at and _not_begun(me, wait_at[rank]):
            return _published(client, here, _error(
                "RuntimeError", _deadlock(here, 0, rank, wait_at[rank])))
    if (found := _skipped(client, me, here, missing)) is not None:
        return found
    if not late:
        return None
    return _told(me, missing, _published(client, here, _error(
        "TimeoutError", f"{here.who}: process(es) {_ranks(missing, len(missing))} did not reach "
        f"this call within {timeout_s:g} s (process 0 waited): slow, stuck, dead or on another "
        "path through the program")))


def _skipped(client: Any, me: Process, here: _Point, missing: list[int]) -> dict | None:
    """The error verdict when a process missing from this point will never come: its script
    ended, or (asked after ANNOUNCE_S) it has run more steps than this one; else None, with a
    notice once that the others are still awaited."""
    peers = me.peers
    if peers is None:
        return None
    ended = {r: peers.finished[r] for r in missing if r in peers.finished}
    gone: dict[int, str] = {r: f"process {r} finished its script" + _after(s)
                            for r, s in ended.items()}
    if not gone and time.monotonic() - here.since >= ANNOUNCE_S * (len(here.asked) + 1):
        here.asked.append(time.monotonic())
        mine = peers.place().get("step", -1)
        places = peers.locate(missing[:SHOWN])
        gone = {r: f"process {r} went on to {_where(p)}" for r, p in places.items()
                if p.get("step", -1) > mine}
        if not gone and len(here.asked) == 1:
            print(f"jdp: {here.who} (call {here.n}): process {me.rank} has waited "
                  f"{ANNOUNCE_S:g} s for process(es) {_ranks(missing, len(missing))} ("
                  + "; ".join(f"process {r}: {_where(p)}" for r, p in places.items())
                  + ")", file=sys.stderr, flush=True)
    if not gone:
        return None
    text = (f"{here.who}: process(es) {_ranks(sorted(gone), len(gone))} skipped this call "
            f"(call {here.n}), which process {me.rank} waits in: {'; '.join(gone.values())}. "
            f"Every process must call {here.who}: remove the `if jax.process_index() == 0:` "
            "(or other test of the rank) around it")
    return _told(me, sorted(gone), _published(client, here, _error("RuntimeError", text)))


def _told(me: Process, ranks: list[int], verdict: dict) -> dict:
    """`verdict`, sent to `ranks` (processes not at this point, which would not read it):
    each prints it and exits 1 rather than be aborted when the store's holder leaves."""
    if me.peers is not None and "error" in verdict:
        me.peers.end_job(ranks, verdict["message"])
    return verdict


def _after(step: int) -> str:
    return f" after step {step}" if step is not None and step >= 0 else ""


def _where(place: dict) -> str:
    """A peer's place as words: its phase and step, or the call it waits in."""
    if place.get("in"):
        who, n = place["in"]
        return f"{who} (call {n})"
    step = place.get("step", -1)
    return f"step {step}" if place.get("phase") == "step" else (
        f"phase {place.get('phase', 'start')}" + _after(step))


def _published(client: Any, here: _Point, verdict: dict) -> dict:
    _publish(client, here, verdict)
    return json.loads(client.key_value_try_get(f"{here.keys}verdict"))


def _at(client: Any, rank: int) -> list | None:
    """[topic, n, who] of the agreement point `rank` last began, None if none."""
    try:
        return json.loads(client.key_value_try_get(f"{PREFIX}at/{rank}"))
    except Exception:  # noqa: BLE001 - NOT_FOUND: it has begun none
        return None


def _not_begun(me: Process, at: list) -> bool:
    topic, n, _ = at
    return me.rounds.get(topic, 0) < n


def _deadlock(here: _Point, me: int, rank: int, at: list) -> str:
    topic, n, who = at
    return (f"{here.who}: process {me} waits here (call {here.n}) while process {rank} waits in "
            f"{who} (call {n}), which process {me} has not reached: the processes took "
            "different paths through the program; make every process make the same jdp calls "
            "in the same order (a call under `if jax.process_index() == 0:` is made by one "
            "process only)")


def _error(kind: str, message: str) -> dict:
    return {"error": kind, "message": message}


def _name_difference(client: Any, me: Process, here: _Point, text: str, sides: list, fix: str,
                     timeout_s: float) -> None:
    """One process of each side sends its facts; every process names the first difference."""
    (ranks_a, count_a), (ranks_b, count_b) = sides
    if me.rank in (ranks_a[0], ranks_b[0]):
        client.key_value_set(f"{here.keys}facts/{me.rank}", text)
    facts = []
    for rank in (ranks_a[0], ranks_b[0]):
        left = max(1, int(1000 * (here.deadline - time.monotonic())))
        try:
            facts.append(json.loads(client.blocking_key_value_get(
                f"{here.keys}facts/{rank}", left)))
        except Exception as e:  # noqa: BLE001 - JAX raises JaxRuntimeError
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
            raise TimeoutError(f"{here.who}: the processes disagree, but process {rank} did not "
                               f"say on what within {timeout_s:g} s") from None
    name, value_a, value_b = _first_difference(*facts)
    _all_named(client, me, here)
    raise _run.shared(ValueError(
        f"{here.who}: the processes disagree on {name}: {value_a} on process(es) "
        f"{_ranks(ranks_a, count_a)} but {value_b} on process(es) {_ranks(ranks_b, count_b)}; "
        f"{fix}"))


def _all_named(client: Any, me: Process, here: _Point) -> None:
    """Process 0 holds the store, and an uncaught error ends a process at once: it raises only
    when every process has read what it needs to name the difference (or after NAMED_WAIT_S),
    so that none is aborted by the store's end before it can say why."""
    if int(client.key_value_increment(f"{here.keys}named", 1)) == me.count:
        # process 0 may end the store the moment the key is in, before this call's answer
        # comes back ("Socket closed"): the key is set either way, and this process names
        # the difference next
        with contextlib.suppress(Exception):
            client.key_value_set(f"{here.keys}all_named", "1")
    if me.rank != 0:
        return
    try:
        client.blocking_key_value_get(f"{here.keys}all_named", int(1000 * NAMED_WAIT_S))
    except Exception as e:  # noqa: BLE001 - JAX raises JaxRuntimeError
        if "DEADLINE_EXCEEDED" not in str(e):
            raise


def _first_difference(a: list, b: list) -> tuple[str, str, str]:
    """(name, value in a, value in b) of the first fact that differs ('absent' if missing)."""
    da, db = dict(map(tuple, a)), dict(map(tuple, b))
    for name in [k for k, _ in a] + [k for k, _ in b]:
        if da.get(name) != db.get(name):
            return name or "<root>", da.get(name, "absent"), db.get(name, "absent")
    return "the order of the leaves", str([k for k, _ in a][:4]), str([k for k, _ in b][:4])


def _ranks(ranks: list[int], count: int) -> str:
    return ", ".join(map(str, ranks[:SHOWN])) + (", ..." if count > SHOWN else "")
