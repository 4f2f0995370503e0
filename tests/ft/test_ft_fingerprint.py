"""A replica group's fingerprint and what the groups of a quorum tell each other: the texts
against the trees' own leaves (counted here with JAX and optax), the first difference among
rows built by hand, the exchange's matrix against a peer's bytes written here with json, and
a fresh job's initial state against the source's own bytes."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from jdp.ft import _agreement, _fingerprint

torch = pytest.importorskip("torch")


def _params(width=4):
    return {"w": np.ones((3, width), np.float32), "b": np.zeros(width, np.float32)}


def _state(tx, width=4, **layout):
    state = jdp.TrainState.create(apply_fn=None, params=_params(width), tx=tx)
    return jdp.broadcast(state, **layout)


def test_tree_texts_count_the_leaves_and_name_the_optimizer_state():
    for tx in (optax.adam(0.1), optax.sgd(0.1)):
        opt_state = tx.init(_params())
        leaves = jax.tree.leaves(opt_state)
        text = _fingerprint.tree_text(opt_state)
        assert f"{len(leaves)} leaves" in text, text
        if leaves:
            assert f"{sum(np.size(x) for x in leaves)} values" in text, text
        for node in {type(s).__name__ for s in opt_state}:   # optax's state classes
            assert node in text, (node, text)
    adam, sgd = (_fingerprint.tree_text(tx.init(_params())) for tx in (optax.adam(1), optax.sgd(1)))
    assert adam != sgd


def test_equal_trees_have_equal_texts_whatever_their_values():
    a = {"w": np.zeros((3, 4), np.float32), "n": np.arange(2)}
    b = {"w": np.ones((3, 4), np.float32), "n": np.arange(2) + 7}
    assert _fingerprint.tree_text(a) == _fingerprint.tree_text(b)
    for other in ({"w": np.zeros((4, 3), np.float32), "n": np.arange(2)},      # a shape
                  {"w": np.zeros((3, 4), np.float16), "n": np.arange(2)},      # a dtype
                  {"v": np.zeros((3, 4), np.float32), "n": np.arange(2)}):     # a name
        assert _fingerprint.tree_text(other) != _fingerprint.tree_text(a)


@pytest.mark.parametrize("layout, pieces_per_leaf", [({}, 1), ({"shard_params": True}, 8)],
                         ids=["replicated", "fsdp"])
def test_held_counts_what_this_process_holds(layout, pieces_per_leaf):
    state = _state(optax.sgd(0.1), width=8, **layout)   # 8 devices here (conftest)
    params = _params(8)
    text = _fingerprint.held_text(state.params)
    assert text == (f"{sum(v.size for v in params.values())} float32 in "
                    f"{pieces_per_leaf * len(params)} pieces"), text


def test_step_options_name_only_what_differs_from_train_steps_defaults():
    assert _fingerprint.of_options({}) == "defaults"
    assert _fingerprint.of_options({"shard_optimizer": False, "grad_reduce": "mean",
                                    "donate": False, "max_in_flight": 1}) == "defaults"
    assert _fingerprint.of_options({"shard_params": np.int64(2),
                                    "compute_dtype": jnp.bfloat16}) == \
        "compute_dtype=bfloat16, shard_params=2"


def test_a_plain_sampler_is_this_groups_problem(monkeypatch):
    monkeypatch.setenv("JDP_REPLICA_GROUPS", "2")
    monkeypatch.setenv("JDP_REPLICA_GROUP", "1")
    data = {"x": np.arange(40, dtype=np.float32)}
    good = jdp.data.Loader(data, batch_size=8, sampler=jdp.ft.sampler(40, seed=3))
    fields, problem = _fingerprint.of_loader(good, 1, 2, 1, 0)
    assert problem is None
    assert fields == {"batch": "8 (drop_last=False)",
                      "sampler": "num_examples=40, seed=3, shuffle=True, drop_last=False"}
    plain = jdp.data.Loader(data, batch_size=8, sampler=jdp.data.DistributedSampler(40))
    _, problem = _fingerprint.of_loader(plain, 1, 2, 1, 0)
    assert "sampler is rank 0 of 1, not rank 1 of 2" in problem, problem
    assert "jdp.ft.sampler(len(source))" in problem


def _row(group, **fields):
    base = {"groups": "2", "processes": "1", "devices": "2", "opt_state": "A", "batch": "8"}
    return {"group": group, "fp": {**base, **fields}, "problem": None}


def test_the_first_difference_names_the_field_both_values_and_both_groups():
    assert _fingerprint.difference([_row(0), _row(1)]) is None
    line = _fingerprint.difference([_row(0, opt_state="adam", batch="8"),
                                    _row(1, opt_state="sgd", batch="16")])
    assert line == ("jdp.ft: replica groups 0 and 1 differ in the optimizer state's tree: adam "
                    "on group 0, sgd on group 1; start every group with the same script and "
                    "options")
    line = _fingerprint.difference([_row(1, devices="4"), _row(0, devices="2", groups="3")])
    assert "differ in the number of replica groups" in line and "3 on group 0" in line
    assert _fingerprint.difference([_row(0, options=None), _row(1, options="x")]) is None


def test_a_duplicated_group_and_a_groups_problem_are_named():
    line = _fingerprint.difference([_row(0), _row(1), _row(0)])
    assert "replica group 0 joined twice" in line and "--replica_group 0" in line
    problem = {**_row(1), "problem": "its sampler is wrong"}
    assert _fingerprint.difference([_row(0), problem]) == \
        "jdp.ft: replica group 1: its sampler is wrong"


def test_a_healing_state_of_another_tree_is_named_before_it_is_placed():
    mine = _fingerprint.of_state(_state(optax.adam(0.1)))
    assert _fingerprint.heal_difference(dict(mine), mine) is None
    theirs = _fingerprint.of_state(_state(optax.sgd(0.1)))
    line = _fingerprint.heal_difference(theirs, mine)
    assert line.startswith("jdp.ft: the state a live replica group served for this group's "
                           "heal differs in the optimizer state's tree: ")
    assert _fingerprint.heal_difference(None, mine) is not None   # an older jdp's peer


class FakeManager:
    """torchft's Manager as the exchange uses it, in a quorum of two where the peer's
    contribution is `peer` (the same shape): its all-reduce adds it."""

    def __init__(self, rank, peer, fail=False):
        self.rank, self.peer, self.fail, self.aborted = rank, peer, fail, False

    def num_participants(self):
        return 2

    def participating_rank(self):
        return self.rank

    def allreduce(self, tensor, reduce_op):
        if not self.fail:
            tensor += torch.from_numpy(self.peer)
        return self

    def wait(self):
        return True

    def errored(self):
        return "lost" if self.fail else None

    def abort(self):
        self.aborted = True


def test_the_exchange_gives_every_groups_row_in_quorum_order():
    peer_row = {"group": 1, "fp": {"devices": "4"}}
    peer = np.zeros((2, _agreement.ROW_BYTES), np.uint8)
    data = json.dumps(peer_row).encode()
    peer[0, :len(data)] = np.frombuffer(data, np.uint8)   # the peer is rank 0 of the quorum
    mine = {"group": 0, "fp": {"devices": "2"}}
    rows = _agreement.exchange(FakeManager(1, peer), None, mine)
    assert rows == [peer_row, mine]
    failing = FakeManager(1, peer, fail=True)
    assert _agreement.exchange(failing, failing, mine) is None and failing.aborted


def test_the_initial_state_is_the_sources_bytes_on_every_group():
    source = [[np.array([1.5, -0.0, np.nan], jnp.bfloat16), np.arange(3, dtype=np.float32)],
              [np.array([2 ** 31 + 5, 7], np.uint32)]]
    mine = [[np.zeros(3, jnp.bfloat16), np.ones(3, np.float32)], [np.zeros(2, np.uint32)]]
    peer = np.frombuffer(b"".join(v.tobytes() for values in source for v in values), np.uint8)
    got = _agreement.initial_state(FakeManager(1, peer.copy()), None, mine, source=False)
    for g, want in zip(sum(got, []), sum(source, []), strict=True):
        assert g.dtype == want.dtype and g.tobytes() == want.tobytes()
    zeros = np.zeros_like(peer)   # the source adds its own bytes to the others' zeros
    kept = _agreement.initial_state(FakeManager(0, zeros), None, source, source=True)
    pairs = zip(sum(kept, []), sum(source, []), strict=True)
    assert all(g.tobytes() == w.tobytes() for g, w in pairs)
