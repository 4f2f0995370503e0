"""`Replicas.train(loss_fn, num_steps)`, the replica groups' loop in one call, runs the same
attempts as `replicas.train_step`'s step called in `for batch in replicas.batches(n)`: the same
batches reach the gradient (a discarded attempt's again in its retry), the same `(state,
metrics)` come out, bitwise, synchronous and semi-synchronous (LocalSGD, Streaming DiLoCo);
both equal single-device optax on the loader's batches (1e-6); a group that heals goes on from
the peer's state and the batch after the peer's position in either form. The real `Replicas`,
its quorums, exchanges, sums and votes, on a stand-in for torchft in this process (one group;
votes scripted). Real groups: tests/system/ft (the example trains with `train`)."""
import threading
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
import jdp.ft
from jdp.ft import _buffers, _exchange, _manager, _replicas

torch = pytest.importorskip("torch")   # the exchange's host buffers are torch tensors

FEATURES, EXAMPLES, BATCH, LR = 4, 256, 16, 0.1


class Torchft:
    """torchft's Manager and process group for a group alone: every quorum new, every sum
    over the group itself (left as it is), the commit votes as scripted (True once `votes`
    is spent); a commit moves the step. `heal`: (step, the peer's `_state_dict()`) loaded in
    the first quorum, as torchft heals a group behind."""

    def __init__(self, votes=(), heal=None):
        self.votes, self.heal, self.steps, self._quorum_id = list(votes), heal, 0, 0
        self.load = None

    def start_quorum(self):
        self._quorum_id += 1
        if self.heal is not None:
            (self.steps, saved), self.heal = self.heal, None
            self.load(saved)

    def should_commit(self):
        ok = self.votes.pop(0) if self.votes else True
        self.steps += ok
        return ok

    def current_step(self):
        return self.steps

    def allreduce(self, *args, **kwargs):   # the manager's and the process group's
        return self

    def wait(self):
        return True

    def num_participants(self):
        return 1

    def participating_rank(self):
        return 0

    def is_participating(self):
        return True

    def errored(self):
        return None

    def wait_quorum(self):
        pass

    def abort(self):
        pass

    def shutdown(self, wait=True):
        pass


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
    return {"x": x, "y": (x @ rng.normal(size=(FEATURES, 1))).astype(np.float32)}


def _params():
    return {"w": np.full((FEATURES, 1), 0.1, np.float32), "b": np.zeros((1,), np.float32)}


def _loader():
    sampler = jdp.ft.sampler(EXAMPLES, seed=0, group=0, groups=1)
    return jdp.data.Loader(_data(), batch_size=BATCH, sampler=sampler, drop_last=True)


@pytest.fixture
def group(monkeypatch):
    """`group(torchft, **options) -> (Replicas, the batches its gradient saw)`: a real
    Replicas (one group) on `torchft`, its TrainStep's first half recording each batch (its
    rows' x and y side by side)."""
    for name in ("JDP_FT_EVENTS", "JDP_FT_NETWORK"):
        monkeypatch.delenv(name, raising=False)
    made = _replicas.train_step

    def recording(loss_fn, **options):
        whole = made(loss_fn, **options)

        def gradients(state, batch):
            seen.append(np.concatenate([np.asarray(batch["x"]), np.asarray(batch["y"])], 1))
            return whole.gradients(state, batch)
        return SimpleNamespace(gradients=gradients, update=whole.update, options=whole.options)
    monkeypatch.setattr(_replicas, "train_step", recording)

    def make(torchft, **options):
        def connect(coords, state_dict, load_state_dict, *timeouts):
            torchft.load = load_state_dict
            return torchft, torchft, None
        monkeypatch.setattr(_manager, "manager", connect)
        seen.clear()
        state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=_params(),
                                                    tx=optax.sgd(LR)))
        replicas = _replicas.Replicas(state, _loader(), group=0, groups=1,
                                      lighthouse="127.0.0.1:1", **options)
        return replicas, seen
    seen: list = []
    return make


def _run(replicas, form, num_steps):
    """[(committed, loss)] of every attempt, and the final state, in `form`."""
    out = []
    if form == "train":
        for state, metrics in replicas.train(_loss, num_steps):
            out.append((replicas.committed, float(metrics["loss"])))
            last = state
        return out, last
    step, state = replicas.train_step(_loss), replicas.state
    for batch in replicas.batches(num_steps):
        state, metrics = step(state, batch)
        out.append((replicas.committed, float(metrics["loss"])))
    return out, state


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(jdp.unshard(state.params))]


def _optax(batches):
    """Single-device SGD on the global batches the gradient saw, in order."""
    params, tx = jax.tree.map(jnp.asarray, _params()), optax.sgd(LR)
    opt = tx.init(params)
    for rows in batches:
        grads = jax.grad(_loss)(params, {"x": rows[:, :FEATURES], "y": rows[:, FEATURES:]})
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    return jax.tree.leaves(params)


def _same_runs(group, votes, num_steps, **options):
    """Both forms on the same votes: the same batches seen and the same attempts, bitwise.
    Returns the batches the gradient saw (the warm-up's first) and the final state."""
    runs = {}
    for form in ("batches", "train"):
        replicas, seen = group(Torchft(votes), **options)
        attempts, state = _run(replicas, form, num_steps)
        runs[form] = list(seen), attempts, _leaves(state), replicas.history
        assert all(a.tobytes() == b.tobytes() for a, b in zip(_leaves(replicas.state),
                                                              runs[form][2], strict=True))
    (seen, attempts, final, history), new = runs["batches"], runs["train"]
    assert len(new[0]) == len(seen) and all(
        a.tobytes() == b.tobytes() for a, b in zip(new[0], seen, strict=True))
    assert new[1] == attempts and new[3] == history
    assert all(a.tobytes() == b.tobytes() for a, b in zip(new[2], final, strict=True))
    return seen, attempts, final


def test_one_call_runs_the_same_attempts_and_a_discarded_one_retries_its_batch(group):
    seen, attempts, final = _same_runs(group, [True, False, True, True], 3)
    assert [committed for committed, _ in attempts] == [True, False, True, True]
    assert attempts[1][1] == attempts[2][1]   # the retry: the same loss, same state and batch
    warm, b0, b1, b1_again, b2 = seen   # the warm-up compiles on the first step's batch
    for a, b in ((warm, b0), (b1, b1_again)):
        assert a.tobytes() == b.tobytes()
    assert len({b0.tobytes(), b1.tobytes(), b2.tobytes()}) == 3
    for got, want in zip(final, _optax([b0, b1, b2]), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("options", [
    {"sync_every": 2},
    {"sync_every": 4, "fragments": 2, "overlap": 1,
     "outer": optax.sgd(0.7, momentum=0.9, nesterov=True)}], ids=["localsgd", "streaming"])
def test_one_call_runs_the_same_semi_synchronous_steps_and_syncs(group, options):
    """Votes: the start, then each sync; the first real sync is discarded once and redone
    with the same values (never the steps): each own step takes the next batch."""
    seen, attempts, final = _same_runs(group, [True, False], 5, **options)
    assert [committed for committed, _ in attempts] == [True] * 5
    assert len(seen) == 6 and seen[0].tobytes() == seen[1].tobytes()
    assert len({b.tobytes() for b in seen[1:]}) == 5
    if "outer" not in options:   # LocalSGD of one group: plain SGD
        for got, want in zip(final, _optax(seen[1:]), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("form", ["batches", "train"])
def test_a_group_that_heals_goes_on_from_the_peer_and_the_batch_after_its_position(group,
                                                                                    form):
    alone, seen = group(Torchft())
    _, state = _run(alone, "train", 4)
    want, batches = _leaves(state), list(seen[1:])
    peer, _ = group(Torchft())
    _run(peer, "train", 2)
    saved = peer._state_dict()
    back, seen = group(Torchft(heal=(2, saved)))
    attempts, state = _run(back, form, 4)
    assert [c for c, _ in attempts] == [True, True] and back.history[0][0] == 3
    assert [b.tobytes() for b in seen[1:]] == [b.tobytes() for b in batches[2:]]
    for got, w in zip(_leaves(state), want, strict=True):
        assert got.tobytes() == w.tobytes()


def test_the_step_outside_batches_and_a_batch_without_a_step_are_named(group):
    replicas, _ = group(Torchft())
    step = replicas.train_step(_loss)
    with pytest.raises(RuntimeError, match="the step ran outside `for batch in replicas"):
        step(replicas.state, None)
    with pytest.raises(RuntimeError, match="a batch went by without a step"):
        for _ in replicas.batches(2):
            pass
    state = replicas.state
    for batch in replicas.batches(2):
        state, _ = step(state, batch)
        break
    with pytest.raises(RuntimeError, match="the step ran outside"):   # after the loop
        step(state, batch)


@pytest.mark.parametrize("num_steps, error", [(0, ValueError), (1.5, TypeError)])
def test_the_one_calls_num_steps_is_checked_as_batches_is(num_steps, error):
    for who, run in (("train", lambda: jdp.ft.Replicas.train(None, _loss, num_steps)),
                     ("batches", lambda: jdp.ft.Replicas.batches(None, num_steps))):
        with pytest.raises(error, match=rf"^jdp\.ft\.Replicas\.{who}: num_steps="):
            next(run())


class SlowSends(Torchft):
    """A quorum of an overlapped sync (the group's phase "send") that returns only once the
    group has computed the gradient of its next step (at most 10 s), as a quorum that waits
    for a slower group would; meanwhile a peer heals from the group (`_state_dict`)."""

    def __init__(self, seen):
        super().__init__()
        self.seen, self.replicas, self.behind, self.served = seen, None, [], []

    def start_quorum(self):
        super().start_quorum()
        phase = self.replicas._phase
        if phase is None or phase[0] != "send":
            return
        asked, deadline = len(self.seen), time.monotonic() + 10
        while len(self.seen) == asked and time.monotonic() < deadline:
            time.sleep(0.01)
        self.behind.append(len(self.seen) > asked)
        self.served.append((phase, self.replicas._state_dict()))


@pytest.mark.parametrize("form", ["batches", "train"])
def test_an_overlapped_sync_takes_its_quorum_behind_the_steps_and_serves_a_whole_step(
        group, form, monkeypatch):
    """Streaming LocalSGD of one group is plain SGD, whenever its quorums end: each quorum of
    an overlapped sync returns only after the group's next gradient (it would never return
    if the steps waited for it), the group still ends as single-device optax on its batches
    (1e-6), and what a peer healing meanwhile receives is a whole step's: the state after
    the steps it names, the loader's position after them, the fragment as it was sent. The
    sync's buffers are filled by the step loop before its next step (so that their copy to
    the host waits for no step taken meanwhile), not by the quorum's thread."""
    torchft = SlowSends([])
    replicas, seen = group(torchft, sync_every=4, fragments=2, overlap=1)
    torchft.seen, torchft.replicas = seen, replicas
    filled, flatten = [], _buffers.Buffers.flatten

    def recording(plan, tree):
        filled.append((len(seen), threading.current_thread().name))
        return flatten(plan, tree)
    monkeypatch.setattr(_buffers.Buffers, "flatten", recording)
    _, state = _run(replicas, form, 8)
    assert torchft.behind == [True, True]
    # seen[0] is the warm-up's gradient: a send after step k fills before gradient k + 2
    sends = [(sent_at + 1, threading.main_thread().name)
             for (_, _, _, sent_at), _ in torchft.served]
    assert [f for f in filled if f in sends] == sends
    assert not [f for f in filled if f[1] != threading.main_thread().name]
    for got, want in zip(_leaves(state), _optax(seen[1:]), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    for (_, fragment, merge_at, sent_at), served in torchft.served:
        inner = served["inner"]
        assert served["phase"] == ("send", fragment, merge_at, sent_at)
        assert sent_at < inner <= merge_at and served["loader"]["step"] == inner
        held = _exchange.from_host(replicas._healable(), _exchange.from_wire(served["state"]))
        params = [np.asarray(x) for x in jax.tree.leaves(held[0].params)]
        for got, want in zip(params, _optax(seen[1:inner + 1]), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
        part = replicas._outer.parts(held[0].params)[fragment]
        sent = [x[0] for x in _exchange.from_wire(served["sent"])]
        at_send = _optax(seen[1:sent_at + 1])
        for got, i in zip(sent, part, strict=True):
            np.testing.assert_allclose(got, at_send[i], atol=1e-6, rtol=0)
