"""Root pytest set-up shared by the tests and the docstring examples (`--doctest-modules jdp`):
8 simulated CPU devices, fixed before jax is imported, and the names the examples use."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import pytest  # noqa: E402

# Importing it replaces the module by the function `jdp.train_step` (see the file), which has
# no examples of its own to collect.
collect_ignore = ["jdp/train_step.py"]


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    """`jdp`, `jax`, `jnp`, `np` and `optax` in every docstring example, as a user imports them."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jdp

    doctest_namespace.update(jdp=jdp, jax=jax, jnp=jnp, np=np, optax=optax)
