"""Every public function's and launcher option's numbers, flags and choices are checked one way
(`jdp.job.values`): a value of the wrong type is a TypeError and one of the right type that
cannot work a ValueError, each one line naming the argument, the value given and what it takes
(the launcher: exit 2, the option as typed). NumPy's integers and bools are taken as Python's,
with the same numbers as a run given plain ints.

Nothing here starts a process: `jdp.spawn` is only given values refused before any starts.
"""
import functools
import json
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_one_line, launch_fails
from test_step import N, data, mlp_params, mse

import jdp
import jdp.ft.lighthouse
import jdp.launch
import jdp.metrics

# private: the checked spawn arguments have no public name
from jdp.launch._spawn import _check as spawn_check
from jdp.spmd.layers import policy_of

INF, NAN = math.inf, math.nan


def _metric(state, batch):
    return {"x": batch["x"][:, 0]}


def _sampler(**kw):
    return jdp.data.DistributedSampler(**{"num_examples": 10, "num_replicas": 2, "rank": 0, **kw})


def _source():
    return {"x": np.arange(32, dtype=np.float32).reshape(16, 2)}


def _writer(tmp, **kw):
    return jdp.metrics.Writer(tmp / "metrics", **{"tensorboard": False, "mlflow": False, **kw})


class Case(NamedTuple):
    """`call(tmp_path, **{name: value})` refuses the value with `error`."""
    call: Any
    name: str
    value: Any
    error: type


def case(call, name, value, error, **marks):
    return pytest.param(Case(call, name, value, error), id=f"{_id(call)}-{name}={value!r}",
                        **marks)


def _id(call) -> str:
    return getattr(call, "who", getattr(call, "__name__", "call"))


def named(who):
    """Give a call the public name the test ids show."""
    def mark(fn):
        fn.who = who
        return fn
    return mark


train = named("train_step")(lambda tmp, **kw: jdp.train_step(mse, **kw))
pmap_train = named("pmap.train_step")(lambda tmp, **kw: jdp.pmap.train_step(mse, **kw))
evaluation = named("eval_step")(lambda tmp, **kw: jdp.eval_step(_metric, **kw))
pmap_evaluation = named("pmap.eval_step")(lambda tmp, **kw: jdp.pmap.eval_step(_metric, **kw))
policy = named("layer_policy")(lambda tmp, **kw: jdp.layer_policy(mse, **kw))
sampler = named("DistributedSampler")(lambda tmp, **kw: _sampler(**kw))
set_epoch = named("DistributedSampler.set_epoch")(
    lambda tmp, epoch: _sampler().set_epoch(epoch))
loader = named("Loader")(
    lambda tmp, **kw: jdp.data.Loader(_source(), **{"batch_size": 8, **kw}))
loader_epoch = named("Loader.set_epoch")(
    lambda tmp, epoch: jdp.data.Loader(_source(), 8).set_epoch(epoch))
evaluate = named("evaluate")(
    lambda tmp, **kw: jdp.evaluate(_metric, jdp.broadcast({"w": np.zeros(2)}), _source(), **kw))
ft_sampler = named("ft.sampler")(
    lambda tmp, **kw: jdp.ft.sampler(**{"num_examples": 30, "group": 0, "groups": 3, **kw}))
replicas = named("ft.Replicas")(lambda tmp, **kw: jdp.ft.Replicas(None, **kw))
batches = named("ft.Replicas.batches")(
    lambda tmp, num_steps: next(jdp.ft.Replicas.batches(None, num_steps)))
lighthouse = named("ft.lighthouse.start")(lambda tmp, **kw: jdp.ft.lighthouse.start(**kw))
barrier = named("barrier")(lambda tmp, **kw: jdp.barrier(**kw))
spawn = named("spawn")(lambda tmp, **kw: functools.partial(jdp.launch.spawn, print)(**kw))
initialize = named("initialize")(lambda tmp, **kw: jdp.initialize(**kw))
logger = named("get_logger")(lambda tmp, **kw: jdp.get_logger("jdp.test_values", **kw))
writer = named("metrics.Writer")(_writer)
scalars = named("metrics.Writer.scalars")(
    lambda tmp, step: _writer(tmp, primary=False).scalars(step, {"loss": 1.0}))
checkpointer = named("Checkpointer")(
    lambda tmp, **kw: jdp.checkpoint.Checkpointer(tmp / "ckpt", **kw))


REFUSED = [
    # the train step (and jdp.ft.Replicas.train_step, the same options)
    case(train, "accum_steps", 2.0, TypeError),
    case(train, "accum_steps", np.float64(2), TypeError),
    case(train, "accum_steps", True, TypeError), case(train, "accum_steps", 0, ValueError),
    case(train, "max_in_flight", "2", TypeError), case(train, "max_in_flight", 17, ValueError),
    case(train, "grad_reduce", "avg", ValueError), case(train, "grad_reduce", None, ValueError),
    case(train, "model_state_sync", "None", ValueError),
    case(train, "has_aux", "False", TypeError), case(train, "donate", 0, TypeError),
    case(train, "shard_optimizer", "yes", TypeError), case(train, "cast_batch", None, TypeError),
    case(train, "shard_params", 4.0, TypeError), case(train, "shard_params", 1, ValueError),
    case(train, "shard_params", "rack", ValueError),
    case(pmap_train, "accum_steps", 2.5, TypeError),
    case(pmap_train, "accum_steps", -1, ValueError),
    case(pmap_train, "max_in_flight", 0, ValueError),
    case(pmap_train, "grad_reduce", "max", ValueError),
    case(pmap_train, "model_state_sync", "sum", ValueError),
    case(pmap_train, "has_aux", 1, TypeError), case(pmap_train, "donate", "no", TypeError),
    case(evaluation, "max_in_flight", 2.5, TypeError),
    case(evaluation, "max_in_flight", 0, ValueError),
    case(pmap_evaluation, "max_in_flight", True, TypeError),
    case(pmap_evaluation, "max_in_flight", 99, ValueError),
    case(policy, "min_params", 1.5, TypeError), case(policy, "min_params", 0, ValueError),
    case(policy, "enabled", "False", TypeError), case(policy, "enabled", None, TypeError),
    # data
    case(sampler, "num_examples", 10.0, TypeError), case(sampler, "num_examples", 0, ValueError),
    case(sampler, "num_replicas", "2", TypeError), case(sampler, "num_replicas", 0, ValueError),
    case(sampler, "rank", 1.0, TypeError), case(sampler, "rank", -1, ValueError),
    case(sampler, "rank", 2, ValueError), case(sampler, "seed", 0.5, TypeError),
    case(sampler, "seed", -1, ValueError), case(sampler, "shuffle", "no", TypeError),
    case(sampler, "drop_last", 1, TypeError),
    case(set_epoch, "epoch", 1.0, TypeError), case(set_epoch, "epoch", -1, ValueError),
    case(loader, "batch_size", 8.0, TypeError), case(loader, "batch_size", 0, ValueError),
    case(loader, "prefetch", 1.5, TypeError), case(loader, "prefetch", -1, ValueError),
    case(loader, "num_workers", True, TypeError), case(loader, "num_workers", -1, ValueError),
    case(loader_epoch, "epoch", "1", TypeError), case(loader_epoch, "epoch", -1, ValueError),
    case(evaluate, "batch_size", 16.0, TypeError), case(evaluate, "batch_size", 0, ValueError),
    case(loader, "shuffle", "no", TypeError),
    case(loader, "drop_last", "False", TypeError),
    case(loader, "timeout", INF, ValueError),
    case(checkpointer, "timeout_s", INF, ValueError),
    # replica groups
    case(ft_sampler, "shuffle", "no", TypeError), case(ft_sampler, "drop_last", 0, TypeError),
    case(ft_sampler, "group", 1.0, TypeError), case(ft_sampler, "group", -1, ValueError),
    case(ft_sampler, "groups", "3", TypeError), case(ft_sampler, "groups", 0, ValueError),
    case(replicas, "start_timeout", INF, ValueError),
    case(replicas, "start_timeout", "60", TypeError),
    case(replicas, "quorum_timeout", NAN, ValueError),
    case(replicas, "quorum_timeout", True, TypeError),
    case(replicas, "timeout", 0, ValueError), case(replicas, "timeout", -1.5, ValueError),
    case(replicas, "group", 0.0, TypeError),
    case(batches, "num_steps", 1.5, TypeError), case(batches, "num_steps", 0, ValueError),
    case(lighthouse, "port", "29510", TypeError), case(lighthouse, "port", 70000, ValueError),
    case(lighthouse, "min_replicas", 1.0, TypeError),
    case(lighthouse, "min_replicas", 0, ValueError),
    # processes, on one process as on many
    case(barrier, "name", 3, TypeError), case(barrier, "timeout_s", INF, ValueError),
    case(barrier, "timeout_s", NAN, ValueError), case(barrier, "timeout_s", -1, ValueError),
    case(barrier, "timeout_s", 1e300, ValueError), case(barrier, "timeout_s", "60", TypeError),
    case(barrier, "timeout_s", True, TypeError),
    case(spawn, "nprocs", 2.0, TypeError), case(spawn, "nprocs", 0, ValueError),
    case(spawn, "devices_per_process", 1.5, TypeError),
    case(spawn, "devices_per_process", 0, ValueError), case(spawn, "timeout", INF, ValueError),
    case(spawn, "progress_timeout", NAN, ValueError), case(spawn, "stop_grace", 0, ValueError),
    case(spawn, "stop_grace", "30", TypeError),
    case(initialize, "num_processes", 2.0, TypeError),
    case(initialize, "num_processes", 0, ValueError),
    case(initialize, "process_id", 0.5, TypeError), case(initialize, "process_id", -1, ValueError),
    case(initialize, "initialization_timeout", 60.0, TypeError),
    case(initialize, "heartbeat_timeout", True, TypeError),
    case(initialize, "shutdown_timeout", 0, ValueError),
    case(logger, "all_ranks", "yes", TypeError),
    case(writer, "primary", "no", TypeError), case(writer, "tensorboard", 1, TypeError),
    case(writer, "mlflow", "False", TypeError),
    case(scalars, "step", 1.5, TypeError), case(scalars, "step", -1, ValueError),
]


@pytest.mark.parametrize("c", REFUSED)
def test_a_wrong_type_or_value_is_refused_naming_the_argument(c, tmp_path):
    with pytest.raises(c.error) as info:
        c.call(tmp_path, **{c.name: c.value})
    assert type(info.value) is c.error
    assert_one_line(info.value, [f"{c.name}={c.value!r} must be "])


@pytest.mark.parametrize("argv, option, value", [
    ([], "--nproc_per_node", "0"), ([], "--nproc_per_node", "2.5"),
    ([], "--nproc_per_node", "-1"), ([], "--node_rank", "x"), ([], "--node_rank", "1.0"),
    ([], "--master_port", "0"), ([], "--master_port", "70000"), ([], "--master_port", "p"),
    (["--nnodes", "2", "--master_port", "29500"], "--rdzv_port", "-5"),
    (["--nnodes", "1:2"], "--rdzv_timeout", "-1"), (["--nnodes", "1:2"], "--rdzv_timeout", "inf"),
    ([], "--max_restarts", "-1"), ([], "--max_restarts", "1.5"),
    ([], "--progress_timeout", "0"), ([], "--progress_timeout", "-inf"),
    ([], "--stop_grace", "nan"), ([], "--stop_grace", "1e300"), ([], "--stop_grace", "soon"),
    ([], "--devices_per_process", "0"), ([], "--devices_per_process", "two"),
    (["--logdir", "LOGS"], "--profile_steps", "-1:3"), ([], "--profile_steps", "5:3"),
    (["--replica_group", "0"], "--replica_groups", "0"),
    (["--replica_group", "0"], "--replica_groups", "1.5"),
    (["--replica_groups", "2"], "--replica_group", "x"),
])
def test_a_wrong_launcher_option_exits_2_naming_the_option(tmp_path, capsys, argv, option, value):
    argv = [str(tmp_path / "logs") if a == "LOGS" else a for a in argv]
    line = launch_fails(tmp_path, capsys, [*argv, option, value])
    assert f"error: {option} {value}: must be " in line, line


# --- NumPy's integers and bools are taken as Python's, with the same numbers -------------

def _steps(step, place, shard, n=2):
    state = place(jdp.TrainState.create(apply_fn=None, params=mlp_params(),
                                        tx=optax.sgd(0.1)))
    for i in range(n):
        state, metrics = step(state, shard(data(N * 4, seed=i)))
    return jax.device_get(jdp.unshard(state).params if place is jdp.broadcast
                          else jdp.pmap.unreplicate(state).params)


def _global(**options):
    return _steps(jdp.train_step(mse, **options), jdp.broadcast, jdp.shard)


def _pmap(**options):
    return _steps(jdp.pmap.train_step(mse, **options), jdp.pmap.replicate, jdp.pmap.shard)


def _evaluated(**options):
    totals = jdp.eval_step(_metric, **options)(jdp.broadcast({"w": np.zeros(2)}),
                                               jdp.shard(data(N * 2)))
    return {k: float(v) for k, v in totals.items()}


def _loaded(**options):
    return [jax.device_get(b["x"]) for b in jdp.data.Loader(_source(), shuffle=False,
                                                             **options)]


def _scalars(tmp, step):
    with _writer(tmp / str(type(step).__name__), primary=True) as w:
        w.scalars(step, {"loss": 0.5})
    with open(tmp / str(type(step).__name__) / "metrics" / "metrics.jsonl") as f:
        return json.loads(f.readline())["step"]


TAKEN = {   # id: (the call with NumPy's values, the call with Python's)
    "train_step": (lambda t: _global(accum_steps=np.int64(2), max_in_flight=np.int32(3),
                                     donate=np.False_, shard_optimizer=np.False_),
                   lambda t: _global(accum_steps=2, max_in_flight=3, donate=False)),
    "pmap.train_step": (lambda t: _pmap(accum_steps=np.int64(2), has_aux=np.False_),
                        lambda t: _pmap(accum_steps=2)),
    "eval_step": (lambda t: _evaluated(max_in_flight=np.uint8(1)),
                  lambda t: _evaluated(max_in_flight=1)),
    "layer_policy": (lambda t: policy_of(jdp.layer_policy(mse, min_params=np.int64(10),
                                                          enabled=np.True_)),
                     lambda t: policy_of(jdp.layer_policy(mse, min_params=10))),
    "DistributedSampler": (
        lambda t: list(_sampler(num_examples=np.int64(11), num_replicas=np.int32(3),
                                rank=np.int64(2), seed=np.uint8(4), shuffle=np.True_,
                                drop_last=np.False_)),
        lambda t: list(_sampler(num_examples=11, num_replicas=3, rank=2, seed=4))),
    "Loader": (lambda t: _loaded(batch_size=np.int64(8), prefetch=np.int16(1)),
               lambda t: _loaded(batch_size=8, prefetch=1)),
    "ft.sampler": (lambda t: list(jdp.ft.sampler(np.int64(30), group=np.int64(1),
                                                 groups=np.int8(3), shuffle=np.False_)),
                   lambda t: list(jdp.ft.sampler(30, group=1, groups=3, shuffle=False))),
    "barrier": (lambda t: jdp.barrier("ready", timeout_s=np.float32(5)),
                lambda t: jdp.barrier("ready", timeout_s=5)),
    "spawn": (lambda t: spawn_check(print, np.int64(2), np.int32(1)),
              lambda t: spawn_check(print, 2, 1)),
    "initialize": (lambda t: jdp.initialize(initialization_timeout=np.int64(60)),
                   lambda t: jdp.initialize(initialization_timeout=60)),
    "metrics.Writer.scalars": (lambda t: _scalars(t, np.int64(3)), lambda t: _scalars(t, 3)),
}


@pytest.mark.parametrize("name", TAKEN)
def test_numpy_integers_and_bools_give_what_python_ones_give(name, tmp_path):
    with_numpy, plain = TAKEN[name]
    got, want = with_numpy(tmp_path), plain(tmp_path)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert jax.tree.map(type, got) == jax.tree.map(type, want)


def test_numpy_accumulation_equals_one_device_optax_on_the_whole_batch():
    """accum_steps=np.int64(2) on 8 devices is the single-device optax step on the N*b batch."""
    got = _global(accum_steps=np.int64(2))
    params, tx = mlp_params(), optax.sgd(0.1)
    opt = tx.init(params)
    for i in range(2):
        grads = jax.grad(mse)(params, jax.tree.map(jnp.asarray, data(N * 4, seed=i)))
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got,
                 jax.device_get(params))
