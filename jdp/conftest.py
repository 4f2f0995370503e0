"""pytest set-up for the docstring examples (`pytest --doctest-modules jdp`, part of `make test`):
8 simulated CPU devices, fixed before any device is used, and the names the examples use.

It lives in the package, not at the repository root, so that it is imported as
`jdp.conftest` and never shadows `tests/conftest.py` as the module `conftest` (worker
processes unpickling test classes import that one by name).
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import pytest  # noqa: E402



@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    """`jdp`, `jax`, `jnp`, `np` and `optax` in every docstring example, as a user imports them."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jdp

    doctest_namespace.update(jdp=jdp, jax=jax, jnp=jnp, np=np, optax=optax)
