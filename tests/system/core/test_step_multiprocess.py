"""train_step across 2 real processes x 2 devices equals single-device optax: the pmap form,
the global form, and the global form with the optimizer state sharded (whose jdp.unshard gives
the optimizer state of unsharded training)."""
import os

import jax
import numpy as np
import optax
from conftest import job_env, start_launcher, write_script

SCRIPT = """
    import sys
    import jax, jax.numpy as jnp, numpy as np, optax
    import jdp

    jdp.initialize()
    out = sys.argv[1]
    x, y = np.load(out + "/x.npy"), np.load(out + "/y.npy")  # [steps, global_batch, ...]
    per_process = x.shape[1] // jax.process_count()
    mine = slice(jax.process_index() * per_process, (jax.process_index() + 1) * per_process)
    rank = jax.process_index()

    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    def new_state():
        return jdp.TrainState.create(apply_fn=None, params={"w": jnp.zeros((3, 1))},
                                     tx=optax.adam(0.1))

    state, step = jdp.pmap.replicate(new_state()), jdp.pmap.train_step(loss_fn)
    for s in range(x.shape[0]):
        state, metrics = step(state, jdp.pmap.shard({"x": x[s, mine], "y": y[s, mine]}))
    np.save(f"{out}/pmap_{rank}.npy", np.asarray(jdp.pmap.unreplicate(state).params["w"]))

    for name, zero in (("global", False), ("zero", True)):
        state = jdp.broadcast(new_state(), shard_optimizer=zero)
        step = jdp.train_step(loss_fn, shard_optimizer=zero)
        for s in range(x.shape[0]):
            state, metrics = step(state, jdp.shard({"x": x[s, mine], "y": y[s, mine]}))
        assert metrics["loss"].shape == () and np.isfinite(float(metrics["loss"]))
        np.save(f"{out}/{name}_{rank}.npy", np.asarray(state.params["w"]))
        mu = jdp.unshard(state).opt_state[0].mu["w"]
        assert mu.shape == (3, 1) and mu.sharding.is_fully_replicated, mu
        np.save(f"{out}/{name}_mu_{rank}.npy", np.asarray(mu))
"""


def test_two_processes_of_two_devices_train_as_one_device_on_the_global_batch(tmp_path, tag):
    """All forms run in the same job; every rank's result is checked."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 16, 3)).astype(np.float32)
    y = x @ np.array([[1.0], [2.0], [3.0]], np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    script = write_script(tmp_path, "train.py", SCRIPT)
    launcher = start_launcher(["--nproc_per_node", "2", "--devices_per_process", "2", script,
                               tmp_path], env=job_env(tag))
    _, err = launcher.communicate(timeout=180)
    assert launcher.returncode == 0, err

    tx, params = optax.adam(0.1), {"w": np.zeros((3, 1), np.float32)}
    opt_state = tx.init(params)
    for s in range(3):  # reference: one device, the whole global batch of 16
        grads = jax.grad(lambda p, s=s: ((x[s] @ p["w"] - y[s]) ** 2).mean())(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    for name in [f"{n}_{r}" for n in ("pmap", "global", "zero") for r in (0, 1)]:
        got = np.load(os.path.join(tmp_path, f"{name}.npy"))
        np.testing.assert_allclose(got, params["w"], rtol=1e-5, atol=1e-6, err_msg=name)
    for name in [f"{n}_mu_{r}" for n in ("global", "zero") for r in (0, 1)]:
        got = np.load(os.path.join(tmp_path, f"{name}.npy"))
        np.testing.assert_allclose(got, opt_state[0].mu["w"], rtol=1e-5, atol=1e-7,
                                   err_msg=name)
