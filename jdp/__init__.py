"""jdp: data-parallel training for JAX on global arrays, with its launcher.

A pure single-device train step becomes one that runs on every device of every process, with
gradients averaged by `lax.pmean`::

    import jdp
    jdp.initialize()
    state = jdp.broadcast(state)                  # global arrays on jdp.mesh()
    step = jdp.train_step(loss_fn)
    for batch in jdp.data.Loader(source, batch_size=256):
        state, metrics = step(state, batch)

The classic pmap form (stacked state, a real `jax.pmap`) is `jdp.pmap`.

The public names resolve on first use (PEP 562's module `__getattr__`), so `import jdp` costs
nothing and `python -m jdp.launch`, whose supervisor only starts processes, imports no JAX; the
first numeric name read imports JAX, the core and the classic form's layout. `jdp.train_step`
is a callable module (jdp/train_step.py): the function under both spellings.
"""
import importlib

__version__ = "0.9.1"   # the one place: pyproject.toml reads it (CHANGELOG.md)

# public name -> the module that defines it; a name that is its module's own last part is
# the subpackage itself (`jdp.data`, `jdp.pmap`, the callable module `jdp.train_step`)
_SOURCES = {
    "AXIS": "jdp.core",
    "Checkpointer": "jdp.checkpoint",
    "DistributedSampler": "jdp.data",
    "Loader": "jdp.data",
    "ProcessExitedException": "jdp.launch",
    "ProcessRaisedException": "jdp.launch",
    "TrainState": "jdp.core",
    "barrier": "jdp.distributed",
    "broadcast": "jdp.core",
    "broadcast_from_primary": "jdp.distributed",
    "checkpoint": "jdp.checkpoint",
    "data": "jdp.data",
    "eval_step": "jdp.core",
    "evaluate": "jdp.data",
    "ft": "jdp.ft",
    "get_logger": "jdp.distributed",
    "initialize": "jdp.distributed",
    "launch": "jdp.launch",
    "is_primary": "jdp.distributed",
    "layer": "jdp.core",
    "layer_policy": "jdp.core",
    "mesh": "jdp.core",
    "metrics": "jdp.metrics",
    "pmap": "jdp.pmap",
    "preempted": "jdp.job",
    "print0": "jdp.distributed",
    "process_count": "jdp.distributed",
    "process_index": "jdp.distributed",
    "reduce_gradients": "jdp.core",
    "replicate": "jdp.pmap",        # the classic form's top-level names
    "shard": "jdp.core",
    "shutdown": "jdp.distributed",
    "spawn": "jdp.launch",
    "train_step": "jdp.train_step",
    "unreplicate": "jdp.pmap",
    "unshard": "jdp.core",
}
# not re-exported, but `import jdp; jdp.core....` has always reached them
_SOURCES.update({name: f"jdp.{name}" for name in ("core", "distributed", "job")})

__all__ = [name for name in _SOURCES if name not in ("core", "distributed", "job")]
# the standard-library floors: reading their names must not import JAX
_NO_JAX = ("jdp.job", "jdp.launch")


def __getattr__(name: str):
    """Import the module behind a public name the first time it is read, and keep it."""
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'jdp' has no attribute {name!r}")
    if source not in _NO_JAX:
        # the classic form plugs its layout into the core when imported (jdp.core.layouts), so
        # `jdp.shard(rows, layout="pmap")` and the core's form checks know it from the first use
        importlib.import_module("jdp.pmap")
    module = importlib.import_module(source)
    value = module if source == f"jdp.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list:
    """The public names with the module's own, for completion before any is imported."""
    return sorted({*globals(), *__all__})
