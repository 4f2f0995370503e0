"""Makes `import jdp.train_step` work while `jdp.train_step` stays the function.

jdp is described by the line `import jdp.train_step`; without this file it would fail with
ModuleNotFoundError. Importing it puts the function itself in `sys.modules` under this name,
and Python binds the package attribute from `sys.modules` once the import finishes, so
`jdp.train_step(loss_fn)` keeps working after `import jdp.train_step`.
"""
import sys

from jdp.step import train_step

sys.modules[__name__] = train_step  # type: ignore[assignment]
