"""Input: `DistributedSampler` (which examples each process reads) and `Loader` (global batches).

The sampler splits a dataset's indices over the processes; the Loader reads them from any
random-access source (numpy arrays, TFDS, Grain, anything with `__len__` and `__getitem__`), in
worker processes if asked, and hands over global batches on `jdp.mesh()` with a padding mask,
prefetched, resumable at any step and on any process count.
"""
from jdp.data._evaluate import evaluate
from jdp.data._loader import Loader
from jdp.data._sampler import DistributedSampler
from jdp.data._sources import ArraySource

__all__ = ["ArraySource", "DistributedSampler", "Loader", "evaluate"]
