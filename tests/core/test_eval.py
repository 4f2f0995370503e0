"""jdp.eval_step and jdp.pmap.eval_step: exact sums over all devices, padding masked out."""
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_step import FORMS, N, data, mlp_params

import jdp


def sq_error(state, batch):
    h = jnp.tanh(batch["x"] @ state.params["w1"] + state.params["b1"])
    return {"sq_err": ((h @ state.params["w2"] - batch["y"]) ** 2)[:, 0]}


@pytest.mark.parametrize("form", FORMS)
def test_masked_padding_counts_for_nothing(form):
    real = data(N * 3 - 5)  # 19 real examples padded to 24 with garbage rows
    padded = {k: np.concatenate([v, np.full((5, *v.shape[1:]), 1e6, v.dtype)])
              for k, v in real.items()}
    padded["mask"] = np.arange(N * 3) < N * 3 - 5
    f = FORMS[form]
    state = f.place(jdp.TrainState.create(apply_fn=None, params=mlp_params(), tx=optax.sgd(0.1)))
    totals = f.one(f.eval_step(sq_error)(state, f.shard(padded)))
    p = mlp_params()
    expected = ((np.tanh(real["x"] @ p["w1"] + p["b1"]) @ p["w2"] - real["y"]) ** 2).sum()
    assert float(totals["count"]) == N * 3 - 5
    np.testing.assert_allclose(float(totals["sq_err"]), expected, rtol=1e-5)


@pytest.mark.parametrize("form", FORMS)
def test_without_mask_every_example_counts(form):
    f, batch = FORMS[form], data(N * 2)
    state = f.place(jdp.TrainState.create(apply_fn=None, params=mlp_params(), tx=optax.sgd(0.1)))
    totals = f.eval_step(sq_error)(state, f.shard(batch))
    if form == "global":  # replicated scalars
        assert totals["count"].shape == () and totals["count"].sharding.is_fully_replicated
    else:                 # one equal copy per device
        np.testing.assert_array_equal(np.asarray(totals["count"]), np.full(N, N * 2))
    assert float(f.one(totals)["count"]) == N * 2
