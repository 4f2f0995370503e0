"""FSDP on models whose layers are unrolled (a Python loop): each layer's parameters gathered on
their own, with no change to the model (flax linen, NNX, and lm1b's Transformer) or with one
`layer` marker (plain functions of a params dict).

Each model is built twice in its test, unrolled and scanned (`lax.scan` / `nn.scan` /
`nnx.scan`, each layer under remat): the unrolled form's compiled step peaks (per device,
`memory_analysis()`: arguments + outputs - aliases + temporaries) within 1.25x of the scanned
form's under jdp's FSDP, every all-gather in its compiled step holds at most one layer, and 3
steps equal single-device optax on the global batch."""
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jdp
from benchmarks import fsdp_unrolled
from jdp.spmd.layers import choose, layer, layer_policy, policy_of

N, L, D, PER = 8, 16, 256, 8   # devices, layers, width, examples per device
TX = optax.sgd(0.05, momentum=0.9)
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4}


def peak_mib(compiled) -> float:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes) / 2**20


def all_gather_bytes(compiled) -> list:
    """The result bytes of each all-gather in the compiled step's HLO."""
    found = re.findall(r"= (\w+)\[([\d,]*)\]\S* all-gather(?:-start)?\(", compiled.as_text())
    return [_BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
            for t, dims in found]


def batches(rows, width, steps=3):
    rng = np.random.default_rng(7)
    return [{k: rng.standard_normal((rows, width)).astype(np.float32) for k in "xy"}
            for _ in range(steps)]


def mse(model):
    return lambda params, batch: jnp.mean((model(params, batch["x"]) - batch["y"]) ** 2)


def single_device(loss, params, data):
    opt_state = TX.init(params)
    for b in data:
        updates, opt_state = TX.update(jax.grad(loss)(params, b), opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def fsdp(loss, params, data, shard_params=True):
    """jdp's FSDP step on `params`: (its compiled step, the parameters after the steps)."""
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=TX),
                          shard_params=shard_params)
    step = jdp.train_step(loss, shard_params=shard_params)
    compiled = step.lower(state, jdp.shard(data[0])).compile()
    for b in data:
        state, _ = step(state, jdp.shard(b))
    return compiled, jdp.unshard(state).params


def assert_tree_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def check_unrolled_against_scanned(unrolled, scanned, layer_bytes, data):
    """(loss, params) pairs of the two forms: peaks, gathers and numbers as the module says."""
    (loss, params), (scan_loss, scan_params) = unrolled, scanned
    compiled, trained = fsdp(loss, params, data)
    scan_compiled, _ = fsdp(scan_loss, scan_params, data)
    peak, scan_peak = peak_mib(compiled), peak_mib(scan_compiled)
    assert peak <= 1.25 * scan_peak, (peak, scan_peak)
    gathers = all_gather_bytes(compiled)
    assert gathers and max(gathers) <= layer_bytes, (max(gathers), layer_bytes)
    assert_tree_close(trained, single_device(loss, params, data))
    return peak, scan_peak


def mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    return [{"w": (rng.standard_normal((D, D)) / D ** 0.5).astype(np.float32),
             "b": (0.1 * rng.standard_normal(D)).astype(np.float32)} for _ in range(L)]


def dense(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])


def stacked(params):
    return jax.tree.map(lambda *xs: np.stack(xs), *params)


def scanned_mlp(params, x):
    return lax.scan(jax.checkpoint(lambda h, p: (dense(p, h), None)), x, params)[0]


LAYER_BYTES = 4 * (D * D + D)


def test_a_plain_function_model_with_marked_layers_gathers_one_layer_at_a_time():
    marked = layer(dense)

    def unrolled(params, x):
        for p in params:
            x = marked(p, x)
        return x

    params = mlp_params()
    check_unrolled_against_scanned((mse(unrolled), params), (mse(scanned_mlp), stacked(params)),
                                   LAYER_BYTES, batches(N * PER, D))


def test_a_marked_layer_outside_a_sharded_step_is_the_function_itself():
    p, x = mlp_params()[0], np.ones((2, D), np.float32)
    np.testing.assert_array_equal(np.asarray(layer(dense)(p, x)), np.asarray(dense(p, x)))


def entry_ancestors(compiled) -> tuple[dict, dict]:
    """The compiled step's entry computation as a graph: ({instruction: the instructions it
    waits for, transitively}, {instruction: (its text, its op_name)}). The text lists each
    instruction after its operands, in the order the compiler scheduled them."""
    text = compiled.as_text()
    entry = text[text.index("\nENTRY "):]
    ancestors, info = {}, {}
    for line in entry[:entry.index("\n}")].splitlines()[1:]:
        instruction = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)", line)
        if instruction is None:   # a line of the computation's header
            continue
        name, rest = instruction.groups()
        found: set = set()
        for operand in re.findall(r"%([\w.\-]+)", rest):
            if operand in ancestors:
                found |= ancestors[operand] | {operand}
        ancestors[name] = found
        op_name = re.search(r'op_name="([^"]*)"', rest)
        info[name] = (rest, op_name.group(1) if op_name else "")
    return ancestors, info


def test_each_layers_gather_waits_for_the_input_of_the_layer_before_not_its_output():
    """One layer ahead: in the compiled step, the forward all-gather of layer k waits for the
    matmuls of layers 1 .. k-2 only, so it may run while layer k-1 computes (0, 0, 1, 2, ...
    forward matmuls before the gathers of layers 1, 2, 3, 4, ...; gathering after the layer
    before would give 0, 1, 2, 3, ...); backward, layer k's gather waits for the output
    cotangent of layer k+1, not its own, so it may run while layer k+1's backward pass
    computes (0, 0, 2, 4, ... backward matmuls, two a layer; after its own cotangent: 0, 2,
    4, ...); and the step trains as single-device optax."""
    marked, layers = layer(dense), 6

    def unrolled(params, x):
        for p in params:
            x = marked(p, x)
        return x

    params, data = mlp_params()[:layers], batches(N * PER, D, steps=2)
    compiled, trained = fsdp(mse(unrolled), params, data)
    ancestors, info = entry_ancestors(compiled)
    forward = [n for n, (_, op) in info.items() if "transpose" not in op and "jvp(" in op]
    matmuls = {n for n in forward if info[n][1].endswith("/dot_general")
               and " bitcast(" not in info[n][0]}
    gathers = [n for n in forward if re.match(rf"f32\[{D},{D}\]\S* all-gather", info[n][0])]
    assert len(matmuls) == len(gathers) == layers, (len(matmuls), len(gathers))
    waits = sorted(len(ancestors[g] & matmuls) for g in gathers)
    assert waits == [0, *range(layers - 1)], waits
    backward = {n for n, (text, op) in info.items() if "transpose" in op
                and op.endswith("/dot_general") and " bitcast(" not in text}
    regathers = [n for n, (text, _) in info.items() if n not in gathers
                 and re.match(rf"f32\[{D},{D}\]\S* all-gather", text)]
    waits = sorted(len(ancestors[g] & backward) for g in regathers)
    assert waits == [0, 0, *range(2, 2 * layers - 3, 2)], waits
    assert_tree_close(trained, single_device(mse(unrolled), params, data))


def lowered_ancestors(text: str) -> tuple[dict, dict]:
    """The lowered step's main function as a graph: ({value: the values it waits for,
    transitively}, {value: its line}); values named as in the text (`%6`, `%arg1`)."""
    ancestors, line_of = {}, {}
    for line in text.splitlines():
        defined = re.match(r"\s*(%[\w]+)(?::\d+)? = (.*)", line)
        if defined is None:
            continue
        name, rest = defined.groups()
        found: set = set()
        for operand in re.findall(r"(%[\w]+)", rest):
            found |= ancestors.get(operand, set()) | {operand}
        ancestors[name], line_of[name] = found, rest
    return ancestors, line_of


def test_where_the_compiler_keeps_barriers_the_order_is_a_barrier_with_no_all_reduce(
        monkeypatch):
    """On a backend whose compiler keeps `lax.optimization_barrier` while it schedules (GPU,
    TPU; here CPU told it does), the order is stated by barriers: layer k's parameters wait
    for the input of layer k-1 (0, 0, 1, 2, ... forward matmuls before them, as in the data
    form), the compiled step has no all-reduce of a scalar (the data form: one per layer and
    direction, but for the first layer's backward pass), and it trains as single-device
    optax."""
    from jdp.core import _placement
    from jdp.spmd import layers as _layers
    marked, layers = layer(dense), 5

    def unrolled(params, x):
        for p in params:
            x = marked(p, x)
        return x

    def compiled_step():
        state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=TX),
                              shard_params=True)
        lowered = jdp.train_step(mse(unrolled), shard_params=True).lower(
            state, jdp.shard(data[0]))
        return lowered.as_text(), lowered.compile().as_text()

    def scalar_all_reduces(compiled_text):
        return len(re.findall(r"= \w+\[\]\S* all-reduce(?:-start)?\(", compiled_text))

    params, data = mlp_params()[:layers], batches(N * PER, D, steps=2)
    monkeypatch.setattr(_placement, "MARGIN", 0.0)   # by layer, whatever CPU makes of it
    # the data form: a zero for each gather, and none handed back by layer 1 (none before it)
    assert scalar_all_reduces(compiled_step()[1]) == 2 * layers - 1
    monkeypatch.setattr(_layers, "DROPS_BARRIERS", frozenset())
    text, compiled = compiled_step()
    assert scalar_all_reduces(compiled) == 0
    ancestors, line_of = lowered_ancestors(text[text.index("func.func public @main"):])
    matmuls = {v for v, line in line_of.items() if line.startswith("stablehlo.dot_general")}
    kernels = [v for v, line in line_of.items() if line.startswith("stablehlo.optimization_"
               "barrier") and re.search(rf"%arg\d+\b.*: .*tensor<{D}x{D}xf32>", line)]
    waits = sorted(len(ancestors[v] & matmuls) for v in kernels)
    assert waits[:layers] == [0, *range(layers - 1)], waits
    assert min(waits[layers:]) >= layers, waits   # the backward pass's gathers: after forward
    _, trained = fsdp(mse(unrolled), params, data)
    assert_tree_close(trained, single_device(mse(unrolled), params, data))


def test_marked_layers_each_under_its_own_checkpoint_train_as_single_device_optax():
    """A layer whose predecessor ran in another trace (each under its own `jax.checkpoint`,
    traced and closed before the next) waits for its own input, as the first layer does."""
    marked = layer(dense)

    def unrolled(params, x):
        for p in params:
            x = jax.checkpoint(lambda p, x: marked(p, x))(p, x)
        return x

    params, data = mlp_params()[:4], batches(N * PER, D, steps=2)
    _, trained = fsdp(mse(unrolled), params, data)
    assert_tree_close(trained, single_device(mse(unrolled), params, data))


def linen_unrolled(layers, wrap=lambda block: block):
    """A linen MLP of `layers` dense tanh blocks of width D called in a Python loop, the
    block's class passed through `wrap` (e.g. `nn.remat`): (the model, the block's class)."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h):
            return jnp.tanh(nn.Dense(D)(h))

    class Unrolled(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(layers):
                x = wrap(Block)()(x)
            return x
    return Unrolled(), Block


def test_an_unrolled_flax_linen_mlp_gathers_one_layer_at_a_time_with_no_change():
    import flax.linen as nn

    unrolled, Block = linen_unrolled(L)

    class ScanBlock(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return Block()(h), None

    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.scan(nn.remat(ScanBlock), variable_axes={"params": 0},
                           split_rngs={"params": True}, length=L)()(x, None)[0]

    forms = []
    for net in (unrolled, Scanned()):
        params = net.init(jax.random.key(0), jnp.zeros((1, D)))["params"]
        forms.append((mse(lambda p, x, net=net: net.apply({"params": p}, x)), params))
    check_unrolled_against_scanned(*forms, LAYER_BYTES, batches(N * PER, D))
    scan_loss, scan_params = forms[1]     # a scanned model's step: as without any layer
    as_is, _ = fsdp(scan_loss, scan_params, batches(N * PER, D, steps=1))
    off, _ = fsdp(layer_policy(scan_loss, enabled=False), scan_params,
                  batches(N * PER, D, steps=1))
    assert (all_gather_bytes(as_is), peak_mib(as_is)) == (all_gather_bytes(off), peak_mib(off))



def nnx_unrolled(layers, call=lambda block, h: block(h)):
    """An NNX MLP of `layers` dense tanh blocks of width D, each applied in a Python loop as
    `call(block, h)` (e.g. under `nnx.remat`): (the model, the block's class)."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, h):
            return jnp.tanh(self.dense(h))

    class Unrolled(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(layers)])

        def __call__(self, x):
            for block in self.blocks:
                x = call(block, x)
            return x
    return Unrolled(nnx.Rngs(0)), Block


def remat_in_a_loop(flavour):
    """(loss, params) of 6 blocks each called under remat in a Python loop: linen's
    `nn.remat(Block)()(x)` or NNX's `nnx.remat(lambda b, x: b(x))(block, x)`."""
    if flavour == "linen":
        import flax.linen as nn
        net, _ = linen_unrolled(6, nn.remat)
        params = net.init(jax.random.key(0), jnp.zeros((1, D)))["params"]
        return mse(lambda p, x: net.apply({"params": p}, x)), params
    from flax import nnx
    unrolled, _ = nnx_unrolled(6, lambda block, h: nnx.remat(lambda b, x: b(x))(block, h))
    graphdef, params = nnx.split(unrolled, nnx.Param)
    return mse(lambda p, x: nnx.merge(graphdef, p)(x)), params


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
def test_blocks_under_remat_called_in_a_loop_are_layers_too(flavour):
    """A block under remat called in a Python loop: flax hands each block its parameters
    through the checkpoint's trace (not the values the loss was given, but a given subtree's
    keys, shapes and dtypes; in NNX with no path back to it), and each block still gathers on
    its own: the step peaks at under half of the compiler's placement of the gathers, and 3
    steps equal single-device optax."""
    loss, params = remat_in_a_loop(flavour)
    data = batches(N * PER, D)
    by_layer, trained = fsdp(loss, params, data)
    by_compiler, _ = fsdp(layer_policy(loss, enabled=False), params, data[:1])
    assert peak_mib(by_layer) < 0.5 * peak_mib(by_compiler), (
        peak_mib(by_layer), peak_mib(by_compiler))
    assert max(all_gather_bytes(by_layer)) <= LAYER_BYTES
    assert_tree_close(trained, single_device(loss, params, data))


@pytest.mark.long
def test_an_unrolled_flax_nnx_mlp_gathers_one_layer_at_a_time_with_no_change():
    from flax import nnx

    unrolled, Block = nnx_unrolled(L)

    class Scanned(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=L)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(rngs)
            self.blocks = make(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            @nnx.remat
            def run(h, block):
                return block(h)
            return run(x, self.blocks)

    forms = []
    for model in (unrolled, Scanned(nnx.Rngs(0))):
        graphdef, params = nnx.split(model, nnx.Param)
        forms.append((mse(lambda p, x, g=graphdef: nnx.merge(g, p)(x)), params))
    check_unrolled_against_scanned(*forms, LAYER_BYTES, batches(N * PER, D))


def test_nnx_layer_discovery_sees_only_its_own_trace_and_restores_the_classes():
    """Finding NNX layers wraps the module classes' `__call__` while it runs: a call from
    another thread meanwhile runs unreported, and the classes get their own calls back."""
    import threading

    from flax import nnx

    from jdp.spmd import layers_flax as _layers_flax

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    own_call = nnx.Linear.__dict__["__call__"]
    seen: list = []

    def report(module, path, call, args, kwargs):
        seen.append((type(module), path))
        return call(module, *args, **kwargs)

    other: list = []
    with _layers_flax._wrapped(_layers_flax._Calls(report)):
        assert nnx.Linear.__dict__["__call__"] is not own_call   # wrapped for the trace
        thread = threading.Thread(target=lambda: other.append(model(jnp.ones((1, 2)))))
        thread.start()
        thread.join()
        assert other[0].shape == (1, 3) and seen == []   # the other thread's call: unreported
        model(jnp.ones((1, 2)))
    assert seen == [(nnx.Linear, ())]
    assert nnx.Linear.__dict__["__call__"] is own_call


@pytest.mark.long
def test_flax_lm1b_transformer_gathers_one_block_at_a_time_with_no_change():
    models = fsdp_unrolled.lm1b_models()
    config = models.TransformerConfig(vocab_size=256, output_vocab_size=256, emb_dim=128,
                                      qkv_dim=128, mlp_dim=512, num_heads=4, num_layers=4,
                                      max_len=32, deterministic=True)
    rng = np.random.default_rng(3)
    data = [{"tokens": rng.integers(1, 256, (N * 2, 32)).astype(np.int32)} for _ in range(3)]
    forms = []
    for net in (models.TransformerLM(config), fsdp_unrolled.scanned(models)(config)):
        params = net.init(jax.random.key(0), jnp.ones((1, 32), jnp.int32))["params"]

        def loss(p, b, net=net):
            logits = net.apply({"params": p}, b["tokens"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["tokens"]).mean()
        forms.append((loss, params))
    block = forms[0][1]["decoder"]["encoderdecoderblock_0"]
    block_bytes = sum(4 * np.size(x) for x in jax.tree.leaves(block))
    check_unrolled_against_scanned(*forms, block_bytes, data)


def test_hsdp_groups_gather_marked_layers_within_the_group_and_train_exactly():
    marked = layer(dense)

    def unrolled(params, x):
        for p in params:
            x = marked(p, x)
        return x

    params, data = mlp_params(), batches(N * PER, D)
    compiled, trained = fsdp(mse(unrolled), params, data, shard_params=4)
    assert max(all_gather_bytes(compiled)) <= LAYER_BYTES
    assert_tree_close(trained, single_device(mse(unrolled), params, data))


def test_policies_pick_the_repeated_blocks_a_class_or_a_size():
    class Block:
        pass

    class Dense:
        pass

    found = {("blocks_0",): (Block, 300), ("blocks_1",): (Block, 300),
             ("blocks_0", "Dense_0"): (Dense, 200), ("blocks_1", "Dense_0"): (Dense, 200),
             ("embed",): (Dense, 1000)}
    def picked(**policy):
        return choose(found, policy_of(layer_policy(lambda p, b: 0.0, **policy)))

    assert picked() == {("blocks_0",), ("blocks_1",)}         # repeated, nearest the top
    assert picked(modules=Dense) == {("blocks_0", "Dense_0"), ("blocks_1", "Dense_0"),
                                     ("embed",)}
    assert picked(min_params=400) == {("embed",)}
    assert picked(min_params=250) == {("blocks_0",), ("blocks_1",), ("embed",)}
    assert picked(min_params=150) == {("blocks_0", "Dense_0"), ("blocks_1", "Dense_0"),
                                      ("embed",)}             # a block's 100 others: too few
    assert picked(enabled=False) == frozenset()


def test_an_unrolled_model_without_layers_is_gathered_as_before():
    params = mlp_params()

    def unrolled(params, x):
        for p in params:
            x = dense(p, x)
        return x

    compiled, trained = fsdp(mse(unrolled), params, batches(N * PER, D))
    assert_tree_close(trained, single_device(mse(unrolled), params, batches(N * PER, D)))


@pytest.mark.parametrize("kwargs, message", [
    ({"modules": "Dense"}, "modules='Dense'"),
    ({"min_params": 0}, "min_params=0"),
    ({"min_params": 10, "modules": int}, "not both"),
])
def test_a_bad_layer_policy_is_refused_naming_the_value(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        layer_policy(lambda p, b: 0.0, **kwargs)


@pytest.mark.long
def test_a_linen_layer_draws_the_dropout_it_draws_in_place():
    """Per device and step, the same keys as the model run without per-layer gathering."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h):
            return nn.Dropout(0.5, deterministic=False)(jnp.tanh(nn.Dense(64)(h)))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(4):
                x = Block()(x)
            return x

    net = Net()
    params = net.init(jax.random.key(0), jnp.zeros((1, 64)))["params"]

    def loss(p, b, rng):
        return jnp.mean((net.apply({"params": p}, b["x"], rngs={"dropout": rng}) - b["y"]) ** 2)

    trained = []
    for each in (loss, layer_policy(loss, enabled=False)):
        state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=TX,
                                                    rng=jax.random.key(3)), shard_params=True)
        step = jdp.train_step(each, shard_params=True)
        for b in batches(N * 4, 64):
            state, _ = step(state, jdp.shard(b))
        trained.append(jdp.unshard(state).params)
    assert_tree_close(*trained)


@pytest.mark.parametrize("remat", [False, pytest.param(True, marks=pytest.mark.long)],
                         ids=["called", "under-nnx-remat"])
def test_an_nnx_layer_with_batchnorm_and_dropout_threads_its_state_as_in_place(remat,
                                                                               monkeypatch):
    """Statistics and random counters go into each gathered layer and come back out, called
    as it is or under `nnx.remat` in the loop: the same numbers as the model run without
    per-layer gathering."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(32, 32, rngs=rngs)
            self.norm = nnx.BatchNorm(32, rngs=rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs)

        def __call__(self, h):
            return self.drop(jnp.tanh(self.norm(self.dense(h))))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(3)])

        def __call__(self, x):
            for block in self.blocks:
                x = nnx.remat(lambda b, h: b(h))(block, x) if remat else block(x)
            return x

    graphdef, params, rest = nnx.split(Net(nnx.Rngs(0, dropout=1)), nnx.Param, ...)

    def loss(p, b, model_state):
        model = nnx.merge(graphdef, p, model_state)
        out = model(b["x"])
        return jnp.mean((out - b["y"]) ** 2), nnx.state(model, nnx.Not(nnx.Param))

    gathered = []
    own = jdp.spmd.layers.gathered_call
    monkeypatch.setattr(jdp.spmd.layers, "gathered_call",
                        lambda *a: gathered.append(1) or own(*a))
    trained = []
    for each in (loss, layer_policy(loss, enabled=False)):
        state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=TX,
                                                    model_state=rest), shard_params=True)
        step = jdp.train_step(each, shard_params=True, model_state_sync="mean")
        for b in batches(N * 4, 32):
            state, _ = step(state, jdp.shard(b))
        stats = [x for x in jax.tree.leaves(state.model_state)
                 if jnp.issubdtype(x.dtype, jnp.floating)]
        trained.append((jdp.unshard(state).params, stats))
    assert len(gathered) == 3   # each block gathered on its own, once, in the first run only
    assert_tree_close(*trained)


def test_an_nnx_rngs_passed_at_the_call_draws_what_it_draws_replicated():
    """`block(x, rngs=rngs)`: each gathered layer advances the stream it was given, so the
    next layer draws the next mask (it used to draw the first layer's again), forward and
    backward alike: the same losses and parameters as the replicated step, and as the same
    model without per-layer gathering."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(32, 32, rngs=rngs)
            self.drop = nnx.Dropout(0.5)

        def __call__(self, h, rngs):
            return self.drop(jnp.tanh(self.dense(h)), rngs=rngs)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(4)])

        def __call__(self, x, rngs):
            for block in self.blocks:
                x = block(x, rngs=rngs)
            return x

    graphdef, params, rest = nnx.split(Net(nnx.Rngs(0)), nnx.Param, ...)

    def loss(p, b, model_state, rng):
        model = nnx.merge(graphdef, p, model_state)
        out = model(b["x"], rngs=nnx.Rngs(dropout=rng))
        return jnp.mean((out - b["y"]) ** 2), nnx.state(model, nnx.Not(nnx.Param))

    runs = []
    for each, shard in ((loss, False), (loss, True), (layer_policy(loss, enabled=False), True)):
        state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=TX,
                                                    model_state=rest, seed=3),
                              shard_params=shard)
        step = jdp.train_step(each, shard_params=shard)
        losses = []
        for b in batches(N * 4, 32):
            state, metrics = step(state, jdp.shard(b))
            losses.append(float(metrics["loss"]))
        runs.append((losses, jdp.unshard(state).params))
    replicated = runs[0]
    for run in runs[1:]:
        np.testing.assert_allclose(run[0], replicated[0], rtol=1e-6)
        assert_tree_close(run[1], replicated[1])


def test_a_module_shared_by_the_blocks_trains_as_replicated_and_is_said():
    """Blocks that call one Dense held by their parent (tied weights) cannot run on their own
    parameters: the rule leaves them to the compiler, says so once, and the model trains as
    the replicated step does (it used to fail with flax's ScopeParamNotFoundError)."""
    import flax.linen as nn

    class Block(nn.Module):
        shared: nn.Module

        @nn.compact
        def __call__(self, h):
            return jnp.tanh(self.shared(nn.Dense(32)(h)))

    class Net(nn.Module):
        def setup(self):
            self.shared = nn.Dense(32)
            self.blocks = [Block(self.shared) for _ in range(3)]

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    net = Net()
    params = net.init(jax.random.key(0), jnp.zeros((1, 32)))["params"]

    def loss(p, b):
        return jnp.mean((net.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    trained = []
    for shard in (False, True):
        state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=TX),
                              shard_params=shard)
        step = jdp.train_step(loss, shard_params=shard)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for b in batches(N * 4, 32):
                state, _ = step(state, jdp.shard(b))
        trained.append(jdp.unshard(state).params)
    assert any("call a module outside themselves" in str(w.message) for w in said), said
    assert_tree_close(trained[1], trained[0])


def test_a_policy_that_matches_nothing_says_so_once():
    import flax.linen as nn

    class Other(nn.Module):
        pass

    net = nn.Sequential([nn.Dense(16), nn.Dense(16)])
    params = net.init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
    loss = layer_policy(lambda p, b: jnp.mean((net.apply({"params": p}, b["x"]) - b["y"]) ** 2),
                        modules=Other)
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=TX),
                          shard_params=True)
    step = jdp.train_step(loss, shard_params=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for b in batches(N * 4, 16, steps=2):
            state, _ = step(state, jdp.shard(b))
    matched = [str(w.message) for w in said if "matched no submodule" in str(w.message)]
    assert len(matched) == 1 and "modules=Other" in matched[0] and "Dense" in matched[0], said


@pytest.mark.parametrize("synced", [False, True])
def test_a_linen_model_applied_with_batchnorm_statistics_gathers_per_layer(monkeypatch, synced):
    """Applied with `mutable=["batch_stats"]` (flax's ImageNet loss), each block runs on its
    own parameters and its statistics come back out into the model's scope: the same numbers
    as the replicated step, and the statistics come back replicated (evaluation takes the
    state). A block whose BatchNorm is synced over the devices (a collective inside) is left
    to the compiler and that is said once."""
    import flax.linen as nn

    from jdp.spmd import layers as _layers

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h):
            norm = nn.BatchNorm(use_running_average=False, axis_name=jdp.AXIS if synced else None)
            return jnp.tanh(norm(nn.Dense(32)(h)))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = Block()(x)
            return x

    net = Net()
    variables = net.init(jax.random.key(0), jnp.zeros((1, 32)))

    def loss(p, b, model_state):
        out, new = net.apply({"params": p, **model_state}, b["x"], mutable=["batch_stats"])
        return jnp.mean((out - b["y"]) ** 2), new

    gathered = []
    monkeypatch.setattr(_layers, "_SAID", set())   # said once per process: anew for this test
    monkeypatch.setattr(_layers, "_gather", lambda *a, f=_layers._gather: (
        gathered.append(1), f(*a))[1])
    results = []
    for shard in (False, True):
        state = jdp.broadcast(jdp.TrainState.create(
            apply_fn=None, params=variables["params"], tx=TX,
            model_state={"batch_stats": variables["batch_stats"]}), shard_params=shard)
        step = jdp.train_step(loss, shard_params=shard,
                              model_state_sync=None if synced else "mean")
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for b in batches(N * 4, 32):
                state, _ = step(state, jdp.shard(b))
        assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state.model_state))
        results.append((jdp.unshard(state).params, state.model_state))
    assert_tree_close(*results)
    assert bool(gathered) != synced, len(gathered)   # per layer, unless synced
    assert synced == any("collective inside" in str(w.message) for w in said), said


@pytest.mark.long
def test_marked_layers_with_accumulation_and_clipping_train_exactly():
    marked = layer(dense)

    def unrolled(params, x):
        for p in params:
            x = marked(p, x)
        return x

    tx = optax.chain(optax.clip_by_global_norm(0.05), TX)
    params, data, loss = mlp_params(), batches(N * PER, D), mse(unrolled)
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=tx),
                          shard_params=True)
    step = jdp.train_step(loss, shard_params=True, accum_steps=2)
    for b in data:
        state, _ = step(state, jdp.shard(b))
    want, opt_state = params, tx.init(params)
    for b in data:
        updates, opt_state = tx.update(jax.grad(loss)(want, b), opt_state, want)
        want = optax.apply_updates(want, updates)
    assert_tree_close(jdp.unshard(state).params, want)


def test_a_marked_layers_contract_is_said_in_one_line():
    """Parameters first (arrays), then inputs and any keywords."""
    dense = layer(lambda p, x, scale=1.0: jnp.tanh(x @ p["w"]) * scale)
    params = {"w": jnp.eye(16) * 0.5}
    data = batches(N * 4, 16, steps=1)

    def run(model):
        loss = lambda p, b: jnp.mean((model(p, b["x"]) - b["y"]) ** 2)  # noqa: E731
        state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=TX),
                              shard_params=True)
        return jdp.train_step(loss, shard_params=True)(state, jdp.shard(data[0]))

    with pytest.raises(ValueError, match=r"^jdp.layer\(<lambda>\): a later argument holds the "
                                         r"parameters .* swapped"):
        run(lambda p, x: dense(x, p))
    with pytest.raises(TypeError, match=r"parameter \['s'\] is a float, not an array"):
        run(lambda p, x: dense({**p, "s": 2.0}, x))
    keyword = run(lambda p, x: dense(p, x, scale=0.5))[1]["loss"]
    expected = jnp.mean((jnp.tanh(data[0]["x"] @ params["w"]) * 0.5 - data[0]["y"]) ** 2)
    np.testing.assert_allclose(float(keyword), float(expected), rtol=1e-5)


@pytest.mark.long
def test_marked_layers_under_a_disabled_policy_compile_as_the_unmarked_model():
    """`layer_policy(enabled=False)` turns the `jdp.layer` marks off too: the step lowers to
    the same program as the model written without them, and trains as single-device optax."""
    marked = layer(dense)

    def model(mark):
        def run(params, x):
            for p in params:
                x = mark(p, x)
            return x
        return run

    params, data = mlp_params(), batches(N * PER, D)
    state = jdp.broadcast(jdp.TrainState.create(apply_fn=None, params=params, tx=TX),
                          shard_params=True)
    texts = []
    for loss in (layer_policy(mse(model(marked)), enabled=False), mse(model(dense))):
        step = jdp.train_step(loss, shard_params=True)
        texts.append(step.lower(state, jdp.shard(data[0])).as_text())
    assert texts[0] == texts[1]
    _, trained = fsdp(layer_policy(mse(model(marked)), enabled=False), params, data)
    assert_tree_close(trained, single_device(mse(model(dense)), params, data))
