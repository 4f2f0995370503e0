"""Every public call is listed in docs/api.md's table "Which calls every process makes" as
collective (announced at an agreement point) or local, and the module of every announced call
holds an agreement point: a new public call that waits for other processes cannot slip in
unannounced and undocumented."""
import inspect
import os
import re

import jdp
from jdp.checkpoint import Checkpointer

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "api.md")
ROW = re.compile(r"^\| (.+?) \| (announced|local|job start and end) \| .* \|$")
AGREES = re.compile(r"\b(agree|agree_once|_agree|broadcast_for|collective_call)\(")
PMAP_CALLS = ("replicate", "unreplicate", "shard", "train_step", "eval_step")


def listed() -> dict:
    """{call name: kind} from the table (`jdp.broadcast(state)` -> "jdp.broadcast")."""
    with open(DOCS) as f:
        text = f.read()
    table = text.split("### Which calls every process makes", 1)[1].split("\n## ", 1)[0]
    found = {}
    for line in table.splitlines():
        if m := ROW.match(line):
            for call in re.findall(r"`([^`]+)`", m[1]):
                found[call.split("(", 1)[0]] = m[2]
    return found


def public_calls() -> dict:
    """{name: object} of jdp's public callables, the pmap form's and Checkpointer's methods."""
    calls = {f"jdp.{n}": getattr(jdp, n) for n in jdp.__all__
             if callable(getattr(jdp, n)) and n not in ("pmap", "launch")}
    calls.update({f"jdp.data.{n}": getattr(jdp.data, n) for n in jdp.data.__all__})
    calls.update({f"jdp.pmap.{n}": getattr(jdp.pmap, n) for n in PMAP_CALLS})
    calls.update({f"Checkpointer.{n}": getattr(Checkpointer, n) for n in dir(Checkpointer)
                  if not n.startswith("_")})
    calls["jdp.checkpoint.Checkpointer"] = Checkpointer
    return {n: v for n, v in calls.items() if not isinstance(v, type) or
            not issubclass(v, BaseException)}


def test_every_public_call_is_listed_as_collective_or_local():
    table, calls = listed(), public_calls()
    named = {id(calls[n]) for n in table if n in calls}   # aliases: jdp.Loader = jdp.data.Loader
    missing = sorted(n for n, v in calls.items() if n not in table and id(v) not in named)
    assert not missing, f"add to docs/api.md's table of calls: {missing}"
    assert set(table.values()) == {"announced", "local", "job start and end"}


def test_every_announced_call_has_an_agreement_point_in_its_module():
    table, calls = listed(), public_calls()
    announced = [n for n, kind in table.items() if kind == "announced" and n in calls]
    assert len(announced) >= 12, announced
    for name in announced:
        source = inspect.getsource(inspect.getmodule(inspect.unwrap(calls[name])))
        assert AGREES.search(source), f"{name} is listed as announced, but its module has no " \
                                      "agreement point"
