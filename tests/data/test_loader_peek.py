"""A peek at a Loader loses nothing, as with torch: `next(iter(loader))`, and the tutorial's
`dataiter = iter(loader); next(dataiter)` superseded by the training loop, give their batch
back; a loop of jdp steps left before stepping on its last batch gives that one back; a loop
of the user's own jitted steps keeps every batch it was handed (the Loader cannot see it).

Checked against independent computations: a counter model whose step adds 1 to w[i] for each
real example i it trains on (every example exactly once per epoch: w == 1), and SGD in float64
numpy over the batches of the sampler's documented order.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import one_line_error

import jdp

N, BATCH, SEED = 100, 16, 1   # 7 batches a process, the last one padded


def ids_of(batch):
    return np.asarray(batch["id"])[np.asarray(batch["mask"])].tolist()


def order(epoch):
    """The sampler's documented order: a permutation seeded by seed + epoch."""
    return np.random.default_rng(SEED + epoch).permutation(N).tolist()


def make_loader():
    return jdp.data.Loader({"id": np.arange(N)}, BATCH, shuffle=True, seed=SEED)


def negative_count(params, batch):
    """-sum of w[i] over the real rows: SGD with lr = devices adds 1 to w[i] per row."""
    return -jnp.sum(jnp.where(batch["mask"], params["w"][batch["id"]], 0.0))


def counter():
    """(train step, state): after training, w[i] counts the steps that saw example i."""
    state = jdp.TrainState.create(apply_fn=None, params={"w": np.zeros(N, np.float32)},
                                  tx=optax.sgd(float(jax.device_count())))
    return jdp.train_step(negative_count), jdp.broadcast(state)


def counts(state):
    return np.asarray(state.params["w"]).tolist()


def test_a_peek_then_an_epoch_of_train_steps_trains_every_example_once():
    loader = make_loader()
    step, state = counter()
    peeked = ids_of(next(iter(loader)))
    assert peeked == order(0)[:BATCH]
    assert (loader.epoch, loader.step, loader.state_dict()["offset"]) == (0, 0, 0)
    for batch in loader:
        state, _ = step(state, batch)
        if loader.step == 1:   # the first step trained the peeked batch
            assert np.flatnonzero(counts(state)).tolist() == sorted(peeked)
    assert counts(state) == [1.0] * N and (loader.epoch, loader.step) == (1, 0)


def test_torchs_kept_iterator_is_superseded_by_the_loop_and_gives_its_batch_back():
    loader = make_loader()
    step, state = counter()
    dataiter = iter(loader)            # the PyTorch tutorial's peek, kept in a variable
    assert ids_of(next(dataiter)) == order(0)[:BATCH]
    for batch in loader:
        state, _ = step(state, batch)
    assert counts(state) == [1.0] * N
    one_line_error(RuntimeError, ["superseded by a later iter(loader)", "newest iterator"],
                   next, dataiter)


@pytest.mark.parametrize("before_step, position", [(True, 2), (False, 3)])
def test_a_loop_of_train_steps_left_early_keeps_exactly_the_batches_it_stepped_on(
        before_step, position):
    loader = make_loader()
    step, state = counter()
    for batch in loader:
        if before_step and loader.step == 3:
            break                      # batch 2 was handed out, never stepped on: it goes back
        state, _ = step(state, batch)
        if loader.step == 3:
            break
    assert loader.step == position and loader.state_dict()["offset"] == position * BATCH
    assert np.flatnonzero(counts(state)).tolist() == sorted(order(0)[:position * BATCH])
    for batch in loader:
        state, _ = step(state, batch)
    assert counts(state) == [1.0] * N


@pytest.mark.parametrize("leave_at", [1, 3])
def test_a_loop_of_own_jitted_steps_keeps_every_batch_it_was_handed(leave_at):
    loader = make_loader()
    own = jax.jit(lambda w, b: w.at[b["id"]].add(b["mask"].astype(w.dtype)))
    w = jdp.broadcast({"w": np.zeros(N, np.float32)})["w"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in loader:
            w = own(w, batch)
            if loader.step == leave_at:
                break
        assert loader.step == leave_at and not caught
        for batch in loader:     # after one batch, the loop that goes on says it was used
            w = own(w, batch)
    said = [str(c.message) for c in caught]
    assert len(said) == (leave_at == 1)
    assert all("starts at batch 1 of epoch 0" in s and "counts as used" in s
               and "next(iter(loader))" in s for s in said)
    assert np.asarray(w).tolist() == [1.0] * N


def test_the_warning_after_a_loop_left_after_one_batch_comes_once_per_loader():
    loader = make_loader()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for _ in loader:
                break
    assert [c.category for c in caught] == [UserWarning] and loader.step == 3
    assert [c.filename for c in caught] == [__file__]


def test_peeks_in_any_form_give_back_and_the_position_saves_as_untouched():
    loader = make_loader()
    first = [ids_of(next(iter(loader))) for _ in range(3)]   # three peeks: the same batch
    assert first == [order(0)[:BATCH]] * 3

    def peek(loader):
        return next(iter(loader))

    assert ids_of(peek(loader)) == order(0)[:BATCH]
    assert loader.state_dict() == make_loader().state_dict()


def test_sgd_after_a_peek_matches_numpy_sgd_over_the_samplers_batches():
    n, lr = 96, 0.1                    # 6 full batches: the mean over a batch is the step's
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.1 * rng.normal(size=(n, 1))).astype(np.float32)
    loader = jdp.data.Loader({"x": x, "y": y}, BATCH, shuffle=True, seed=SEED)
    next(iter(loader))
    state = jdp.broadcast(jdp.TrainState.create(
        apply_fn=None, params={"w": np.zeros((3, 1), np.float32)}, tx=optax.sgd(lr)))
    step = jdp.train_step(lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2))
    for batch in loader:
        state, _ = step(state, batch)
    w = np.zeros((3, 1))
    perm = np.random.default_rng(SEED).permutation(n)   # epoch 0's order
    for i in range(0, n, BATCH):
        xb, yb = x[perm[i:i + BATCH]].astype(np.float64), y[perm[i:i + BATCH]].astype(np.float64)
        w = w - lr * 2.0 * xb.T @ (xb @ w - yb) / len(xb)
    np.testing.assert_allclose(np.asarray(state.params["w"]), w, rtol=1e-5, atol=1e-6)
