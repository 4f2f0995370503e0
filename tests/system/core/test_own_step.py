"""Keep your own step: a user's `jax.jit` / `nnx.jit` step on a `jdp.broadcast` state and
`jdp.shard` / Loader batches trains as one device on the global batch, in one process and in
two; with the loss read only every 100 steps it runs 1,000 steps to the end on 2 processes x 4
devices (the steps in flight are bounded through its batches), and a stalled rank is named by
the watchdog (its steps are seen through its batches)."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import job_env, start_launcher, write_script

import jdp

W_TRUE = np.array([[1.0], [2.0], [3.0]], np.float32)


def regression(n, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, 3)).astype(np.float32)
    return {"x": x, "y": x @ W_TRUE}


@jax.jit
def own_step(state, batch):
    """What a user writes for one device: nothing of jdp in it."""
    def loss_fn(params):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def reference(batches, tx, params):
    """Single-device optax on each whole global batch."""
    opt_state = tx.init(params)
    for b in batches:
        grads = jax.grad(lambda p, b=b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_own_jit_step_on_loader_batches_equals_one_device_on_the_global_batch():
    data, tx = regression(64), optax.adam(0.05)
    params = {"w": np.zeros((3, 1), np.float32)}
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=tx))
    loader = jdp.data.Loader(data, batch_size=16)
    for _ in range(2):
        for batch in loader:
            state, loss = own_step(state, batch)
    assert state.params["w"].sharding.is_fully_replicated
    expected = reference([{k: v[i:i + 16] for k, v in data.items()}
                          for i in list(range(0, 64, 16)) * 2], tx, params)
    np.testing.assert_allclose(np.asarray(state.params["w"]), expected["w"], rtol=1e-5,
                               atol=1e-6)


def test_handing_out_a_batch_waits_for_the_step_two_batches_back():
    """The bound in flight: handing out batch k waits for what step k-2 computes; the batches
    are never touched, so an array the program still holds keeps its values."""
    data = regression(64)
    state = jdp.broadcast(jdp.TrainState.create(
        apply_fn=None, params={"w": np.zeros((3, 1), np.float32)}, tx=optax.sgd(0.1)))
    batches, losses = iter(jdp.data.Loader(data, batch_size=8)), []
    for k in range(5):
        batch = next(batches)
        if k >= 2:
            assert losses[k - 2].is_ready(), k
        state, loss = own_step(state, batch)
        losses.append(loss)
        if k == 0:
            kept = batch["x"]                    # the program keeps this one array
        del batch
    batches.close()
    assert not kept.is_deleted()
    np.testing.assert_array_equal(np.asarray(kept), data["x"][:8])


SCRIPT = """
    import sys, time
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    import jdp

    jdp.initialize()
    out, stall = sys.argv[1], len(sys.argv) > 2
    rank, x, y = jax.process_index(), np.load(out + "/x.npy"), np.load(out + "/y.npy")

    @jax.jit
    def train_step(state, x, y):
        loss_fn = lambda p: jnp.mean((x @ p["w"] - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    if not stall:   # 3 steps of jax.jit on jdp.shard rows: this process's half of each batch
        state = jdp.broadcast(jdp.TrainState.create(
            apply_fn=None, params={"w": jnp.zeros((3, 1))}, tx=optax.adam(0.05)))
        half = x.shape[1] // 2
        for s in range(x.shape[0]):
            rows = slice(rank * half, (rank + 1) * half)
            state, loss = train_step(state, jdp.shard(x[s, rows]), jdp.shard(y[s, rows]))
        np.save(f"{out}/jit_{rank}.npy", np.asarray(state.params["w"]))

    model = nnx.Linear(3, 1, kernel_init=nnx.initializers.zeros, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
    nnx.update((model, optimizer), jdp.broadcast(nnx.state((model, optimizer))))

    @nnx.jit
    def nnx_step(model, optimizer, batch):
        loss_fn = lambda model: jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    data = {"x": x.reshape(-1, 3), "y": y.reshape(-1, 1)}
    loader = jdp.data.Loader(data, batch_size=8)   # 3 global batches of 16 per epoch
    steps = 0
    while steps < 1000:
        for batch in loader:
            if stall and rank == 1 and steps == 5:
                print(f"STALL {time.time()!r}", file=sys.stderr, flush=True)
                time.sleep(10**6)
            loss = nnx_step(model, optimizer, batch)
            steps += 1
            if steps % 100 == 0:   # the only syncs: the loss read every 100 steps
                print(f"step {steps} loss {float(loss):.6f}", flush=True)
            if steps == 1000:
                break
    np.save(f"{out}/nnx_{rank}.npy", np.asarray(model.kernel.value))
    test = {"x": x.reshape(-1, 3)[:37], "y": y.reshape(-1, 1)[:37]}   # 37: uneven
    metric_fn = lambda state, b: {"sq": jnp.sum((b["x"] @ state["w"] - b["y"]) ** 2, -1),
                                  "hit": jnp.abs(b["x"] @ state["w"] - b["y"])[:, 0] < 1.0}
    got = jdp.evaluate(metric_fn, jdp.broadcast({"w": np.ones((3, 1), np.float32)}), test,
                       batch_size=8)
    np.save(f"{out}/eval_{rank}.npy", np.array([got["sq"], got["hit"], got["count"]]))
"""


@pytest.mark.long
def test_two_processes_own_steps_train_as_one_device_and_run_1000_steps(tmp_path, tag):
    data = regression(3 * 16, seed=1)
    x, y = data["x"].reshape(3, 16, 3), data["y"].reshape(3, 16, 1)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    script = write_script(tmp_path, "own.py", SCRIPT)
    launcher = start_launcher(["--nproc_per_node", "2", "--devices_per_process", "4", script,
                               tmp_path], env=job_env(tag))
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err
    assert "step 1000 loss" in out, out

    zeros = {"w": np.zeros((3, 1), np.float32)}
    jit_ref = reference([{"x": x[s], "y": y[s]} for s in range(3)], optax.adam(0.05), zeros)
    flat = {"x": x.reshape(-1, 3), "y": y.reshape(-1, 1)}
    ranks = [list(jdp.data.DistributedSampler(48, num_replicas=2, rank=r)) for r in (0, 1)]
    # the Loader's global batch s: 8 rows of each process's share, 3 batches per epoch (48)
    order = [ranks[0][i:i + 8] + ranks[1][i:i + 8] for i in range(0, 24, 8)]
    batches = [{k: v[order[s % 3]] for k, v in flat.items()} for s in range(1000)]
    nnx_ref = reference(batches, optax.sgd(0.05), zeros)
    test = {"x": flat["x"][:37], "y": flat["y"][:37]}
    err_ = test["x"] @ np.ones((3, 1), np.float32) - test["y"]
    for r in (0, 1):
        np.testing.assert_allclose(np.load(tmp_path / f"jit_{r}.npy"), jit_ref["w"], rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(np.load(tmp_path / f"nnx_{r}.npy"), nnx_ref["w"], rtol=1e-4,
                                   atol=1e-5)
        sq, hit, count = np.load(tmp_path / f"eval_{r}.npy")
        assert count == 37 and hit == np.mean(np.abs(err_[:, 0]) < 1.0)
        np.testing.assert_allclose(sq, np.mean(err_[:, 0] ** 2), rtol=1e-5)


@pytest.mark.long
def test_a_stalled_own_step_job_is_named_by_the_watchdog(tmp_path, tag):
    data = regression(3 * 16, seed=1)
    np.save(tmp_path / "x.npy", data["x"].reshape(3, 16, 3))
    np.save(tmp_path / "y.npy", data["y"].reshape(3, 16, 1))
    script = write_script(tmp_path, "own.py", SCRIPT)
    launcher = start_launcher(["--nproc_per_node", "2", "--devices_per_process", "4",
                               "--progress_timeout", "10", script, tmp_path, "stall"],
                              env=job_env(tag))
    _, err = launcher.communicate(timeout=180)
    assert launcher.returncode == 124, err
    report = err[err.index("jdp.launch: no rank made progress"):]
    assert "rank 1 stuck at step 6" in report, report
    assert "time.sleep(10**6)" in report, report
    assert os.path.exists(tmp_path) and "STALL" in err


KEEPING = """
    import sys
    import jax, jax.numpy as jnp, numpy as np, optax
    import jdp

    jdp.initialize()
    out, keep = sys.argv[1], sys.argv[2]
    data = {"x": np.load(out + "/x.npy"), "y": np.load(out + "/y.npy")}

    @jax.jit
    def step(state, batch):
        loss_fn = lambda p: jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    state = jdp.broadcast(jdp.TrainState.create(
        apply_fn=None, params={"w": jnp.zeros((3, 1))}, tx=optax.sgd(0.05)))
    loader, kept, steps = jdp.data.Loader(data, batch_size=8), [], 0
    while steps < 400:
        for batch in loader:
            state, loss = step(state, batch)
            kept = {"every": kept + [batch], "last2": (kept + [batch])[-2:], "none": []}[keep]
            steps += 1
            if steps == 400:
                break
    assert all(not b["x"].is_deleted() for b in kept)   # kept batches keep their values
    np.save(f"{out}/w_{jax.process_index()}.npy", np.asarray(state.params["w"]))
"""


@pytest.mark.parametrize("keep", ["every", pytest.param("last2", marks=pytest.mark.long),
                                  pytest.param("none", marks=pytest.mark.long)])
def test_own_step_on_two_processes_finishes_400_steps_whatever_batches_it_keeps(
        tmp_path, tag, keep):
    """The bound in flight never depends on the batches the program holds (2 x 2 devices)."""
    data = regression(48, seed=2)
    np.save(tmp_path / "x.npy", data["x"])
    np.save(tmp_path / "y.npy", data["y"])
    script = write_script(tmp_path, "keep.py", KEEPING)
    launcher = start_launcher(["--nproc_per_node", "2", "--devices_per_process", "2",
                               "--progress_timeout", "60", script, tmp_path, keep],
                              env=job_env(tag))
    out, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, err
    ranks = [list(jdp.data.DistributedSampler(48, num_replicas=2, rank=r)) for r in (0, 1)]
    order = [ranks[0][i:i + 8] + ranks[1][i:i + 8] for i in range(0, 24, 8)]
    batches = [{k: v[order[s % 3]] for k, v in data.items()} for s in range(400)]
    expected = reference(batches, optax.sgd(0.05), {"w": np.zeros((3, 1), np.float32)})
    for r in (0, 1):
        np.testing.assert_allclose(np.load(tmp_path / f"w_{r}.npy"), expected["w"], rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.parametrize("placement", ["shard_optimizer", "shard_params"])
def test_own_step_on_a_sharded_state_trains_as_one_device(placement):
    """ZeRO's and FSDP's stored leaves are arrays of their own shapes, split: the user's own
    jitted step (optax inside) takes them as they are and trains as one device would."""
    params = {"w": np.zeros((3, 8), np.float32)}   # split on its 8 columns
    tx = optax.adam(0.05)
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=tx),
                          **{placement: True})
    assert not state.opt_state[0].mu["w"].sharding.is_fully_replicated
    batches = [regression(16, seed) for seed in range(3)]
    for b in batches:
        state, _ = own_step(state, jdp.shard(b))
    want = reference(batches, tx, params)
    np.testing.assert_allclose(np.asarray(state.params["w"]), want["w"], rtol=1e-5, atol=1e-6)
