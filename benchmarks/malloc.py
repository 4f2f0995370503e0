"""jdp's allocator settings (jdp/_malloc.py), for the benchmark jobs that compare them.

Loaded from the file itself rather than through `import jdp`, so the PyTorch worker stays free
of JAX. `tune()` applies them unless `JDP_MALLOC_TUNING=0` (what the "default" jobs set).
"""
import importlib.util
import os

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "jdp", "_malloc.py")
_spec = importlib.util.spec_from_file_location("_jdp_malloc", _PATH)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

tune = _module.tune
ENV = _module.ENV
