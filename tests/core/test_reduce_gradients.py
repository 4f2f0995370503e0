"""`jdp.reduce_gradients` in a step written by hand gives the mean gradient of the global
batch (checked against `jax.grad` on the whole batch on one device), or refuses gradients
that JAX's autodiff has already summed over the devices (`shard_map`'s default
`check_vma=True` with replicated parameters), which used to come back N times too large."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jdp

X = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
Y = X @ np.array([[1.0], [-2.0], [0.5]], np.float32)
W = {"w": np.full((3, 1), 0.3, np.float32), "b": np.float32(0.1)}


def loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def expected():
    """The gradient of the global batch's mean loss, on one device."""
    return jax.grad(loss)(jax.device_get(W), X, Y)


def own_step(check_vma, mark_varying, comm_dtype=None):
    mesh = jdp.mesh()

    def per_device(params, x, y):
        if mark_varying:
            params = lax.pcast(params, jdp.AXIS, to="varying")
        grads = jax.grad(loss)(params, x, y)
        return jdp.reduce_gradients(grads, axis_name=jdp.AXIS, comm_dtype=comm_dtype)

    place = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    params = jax.tree.map(lambda a: place(a, P()), W)
    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(jdp.AXIS), P(jdp.AXIS)),
                                 out_specs=P(), check_vma=check_vma))
    return step(params, place(X, P(jdp.AXIS)), place(Y, P(jdp.AXIS)))


@pytest.mark.parametrize("check_vma, mark_varying, comm_dtype", [
    (False, False, None), (True, True, None), (True, True, jnp.bfloat16)])
def test_the_mean_gradient_of_the_global_batch(check_vma, mark_varying, comm_dtype):
    got, want = own_step(check_vma, mark_varying, comm_dtype), expected()
    tol = 1e-2 if comm_dtype is not None else 1e-6
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), want[key], rtol=tol, atol=tol)


def test_gradients_already_summed_by_autodiff_are_refused():
    with pytest.raises(ValueError) as error:
        own_step(check_vma=True, mark_varying=False)
    text = str(error.value)
    assert "\n" not in text and "already summed" in text and "['b']" in text, text
    assert "lax.pcast(params" in text and "check_vma=False" in text, text


def test_under_jax_pmap_the_mean_of_the_devices():
    n = jax.local_device_count()
    x, y = X.reshape(n, -1, 3), Y.reshape(n, -1, 1)
    params = jax.tree.map(lambda a: np.stack([a] * n), W)
    got = jax.pmap(lambda p, x, y: jdp.reduce_gradients(jax.grad(loss)(p, x, y), "i"),
                   axis_name="i")(params, x, y)
    for key, want in expected().items():
        np.testing.assert_allclose(np.asarray(got[key][0]), want, rtol=1e-6, atol=1e-6)
