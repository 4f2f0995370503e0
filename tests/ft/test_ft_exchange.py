"""jdp.ft's host side: a state's pieces to host buffers and back for every layout, the
all-reduce's buffers made on the devices, the heal's wire form, and the replica coordinates from the
environment. The expected values are numpy's own arrays of the same state."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from jdp.ft import _buffers, _coords, _exchange
from jdp.job.run import FINAL_EXIT, failure_code

torch = pytest.importorskip("torch")


def _state(**layout):
    params = {"w": np.arange(24 * 6, dtype=np.float32).reshape(24, 6) / 7,
              "b": np.arange(6, dtype=np.float32), "n": np.arange(3, dtype=np.int32)}
    tx = optax.masked(optax.adam(0.1), {"w": True, "b": True, "n": False})
    return jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=tx), **layout)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jdp.unshard(tree))]


@pytest.mark.parametrize("layout", [{}, {"shard_optimizer": True}, {"shard_params": True},
                                    {"shard_params": 4}], ids=["replicated", "zero", "fsdp",
                                                               "hsdp"])
def test_host_pieces_rebuild_the_same_global_arrays(layout):
    state = _state(**layout)
    host = _exchange.to_host(state)
    # one piece per distinct position: a replicated leaf once, a split leaf once per shard
    sizes = [sum(v.size for v in values) for values in host]
    assert sizes == [x.size for x in jax.tree.leaves(state)]
    # refill with doubled floats: each device gets its own piece back, in place
    doubled = [[v * 2 if np.issubdtype(v.dtype, np.floating) else v for v in values]
               for values in host]
    back = _exchange.from_host(state, doubled)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        assert got.sharding == want.sharding
        factor = 2 if jnp.issubdtype(want.dtype, jnp.floating) else 1
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want) * factor)


def _mixed(seed, **layout):
    """A state with float32, bfloat16 and int32 leaves, its values drawn from `seed`."""
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(size=(24, 6)).astype(np.float32),
              "b": rng.normal(size=(6,)).astype(np.float32),
              "h": rng.normal(size=(5,)).astype(jnp.bfloat16),
              "n": rng.integers(0, 9, size=(3,)).astype(np.int32)}
    tx = optax.masked(optax.adam(0.1), {"w": True, "b": True, "h": True, "n": False})
    return jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=tx), **layout)


@pytest.mark.parametrize("layout", [{}, {"shard_optimizer": True}, {"shard_params": True},
                                    {"shard_params": 4}], ids=["replicated", "zero", "fsdp",
                                                               "hsdp"])
def test_buffers_made_on_the_devices_reduce_two_groups_leaf_by_leaf(layout):
    mine, theirs = _mixed(0, **layout), _mixed(1, **layout)
    tree = (mine.params, mine.opt_state)
    divide = tuple(i % 2 == 0 for i in range(len(jax.tree.leaves(tree))))
    plan = _buffers.Buffers.of(tree, divide)
    buffers = plan.flatten(tree)
    host = _buffers.to_host(buffers)
    # on CPU the host tensors are the devices' own memory: nothing copied to get there
    shards = [s for b in buffers for s in sorted(b.addressable_shards, key=lambda s: s.index)]
    assert [t.data_ptr() for t in host] == [s.data.unsafe_buffer_pointer() for s in shards]
    # every floating value once in all: a replicated leaf sliced over its copies
    floats = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert sum(x.size for x in floats) <= sum(t.numel() for t in host) < sum(
        x.size + jax.device_count() for x in floats)
    other = (theirs.params, theirs.opt_state)
    for t, u in zip(host, _buffers.to_host(plan.flatten(other)), strict=True):
        t += u   # the all-reduce over two groups, in place
    out = plan.unflatten(_buffers.back(buffers, host), tree, 2)
    rows = zip(jax.tree.leaves(out), jax.tree.leaves(tree), jax.tree.leaves(other), divide,
               strict=True)
    for got, a, b, div in rows:
        assert got.sharding == a.sharding and got.dtype == a.dtype
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if not jnp.issubdtype(a.dtype, jnp.floating):
            want = a64   # integers stay each group's own
        else:
            want = (a64 + b64) / (2 if div else 1)
        tol = 1e-2 if a.dtype == jnp.bfloat16 else 1e-6
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


def test_wire_form_is_bitwise_for_every_dtype_and_digests_tell_states_apart():
    values = [[np.array([1.5, -0.0, np.nan], jnp.bfloat16)],
              [np.array([2 ** 31 + 5], np.uint32), np.arange(6, dtype=np.float64).reshape(2, 3)]]
    wire = _exchange.to_wire(values)
    back = _exchange.from_wire(wire)
    for got, want in zip(sum(back, []), sum(values, []), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    assert _exchange.digest(wire) == _exchange.digest(_exchange.to_wire(back))
    values[1][1][0, 0] = 1e-300
    assert _exchange.digest(wire) != _exchange.digest(_exchange.to_wire(values))


def test_coordinates_come_from_the_environment_and_bad_ones_are_named(monkeypatch):
    monkeypatch.setenv("JDP_REPLICA_GROUP", "2")
    monkeypatch.setenv("JDP_REPLICA_GROUPS", "3")
    monkeypatch.setenv("JDP_FT_LIGHTHOUSE", "10.0.0.1:29510")
    assert _coords.coordinates() == (2, 3, "http://10.0.0.1:29510", None)
    monkeypatch.setenv("JDP_REPLICA_GROUP", "3")
    with pytest.raises(ValueError, match="replica group 3 of 3 is out of range"):
        _coords.coordinates()
    monkeypatch.setenv("JDP_REPLICA_GROUP", "one")
    with pytest.raises(ValueError, match="JDP_REPLICA_GROUP='one' is not an integer"):
        _coords.coordinates()
    monkeypatch.delenv("JDP_FT_LIGHTHOUSE")
    with pytest.raises(ValueError, match="--ft_lighthouse"):
        _coords.coordinates(group=0)
    monkeypatch.delenv("JDP_REPLICA_GROUPS")
    with pytest.raises(ValueError, match="JDP_REPLICA_GROUPS is not set"):
        _coords.coordinates(group=0)


def test_the_sampler_gives_each_group_its_own_share(monkeypatch):
    monkeypatch.setenv("JDP_REPLICA_GROUPS", "3")
    shares = []
    for group in range(3):
        monkeypatch.setenv("JDP_REPLICA_GROUP", str(group))
        shares.append(list(jdp.ft.sampler(30, shuffle=False)))
    assert shares == [list(range(g, 30, 3)) for g in range(3)]


def test_bad_replica_arguments_are_one_line_errors(monkeypatch):
    from conftest import assert_one_line
    monkeypatch.setenv("JDP_REPLICA_GROUP", "0")
    monkeypatch.setenv("JDP_REPLICA_GROUPS", "2")
    monkeypatch.setenv("JDP_FT_LIGHTHOUSE", "127.0.0.1:1")
    state = _state()
    with pytest.raises(ValueError) as e:
        jdp.ft.Replicas(state, start_timeout=0)
    assert_one_line(e.value, ["start_timeout=0", "finite number of seconds > 0"])
    with pytest.raises(TypeError) as e:
        jdp.ft.Replicas(state, group="1", groups=2)
    assert_one_line(e.value, ["group='1'", "int"])
    with pytest.raises(ValueError) as e:
        jdp.ft.Replicas(state, min_groups=3)   # of 2 groups
    assert_one_line(e.value, ["min_groups=3", "in 1..2", "fewest replica groups"])
    with pytest.raises(TypeError) as e:
        jdp.ft.Replicas(state, min_groups=1.0)
    assert_one_line(e.value, ["min_groups=1.0", "int"])


def test_a_group_that_stopped_for_good_stops_again_before_it_reaches_the_lighthouse(
        tmp_path, monkeypatch):
    events = tmp_path / "ft_events.jsonl"
    events.write_text('{"event": "join", "restart": 0, "time": 1}\n'
                      '{"event": "stop", "reason": "jdp.ft: groups 0 and 1 differ", "time": 2}\n')
    for name, value in (("JDP_REPLICA_GROUP", "0"), ("JDP_REPLICA_GROUPS", "2"),
                        ("JDP_FT_LIGHTHOUSE", "127.0.0.1:1"), ("JDP_FT_EVENTS", str(events)),
                        ("JDP_RESTART_COUNT", "1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError) as e:   # the Lighthouse's address is never tried
        jdp.ft.Replicas(_state())
    assert str(e.value).startswith("jdp.ft: groups 0 and 1 differ (this group stopped for it "
                                   "before its restart")
    assert failure_code(e.value) == FINAL_EXIT == 78   # the launcher does not restart it
