"""`jdp.train_step`: the core's `train_step`, as a module you can call.

Both spellings work, with one object behind them::

    import jdp.train_step                 # imports this module
    step = jdp.train_step(loss_fn)        # calls it: `jdp.core.train_step(loss_fn)`
    from jdp import train_step            # the same object

Python binds `jdp.train_step` to this module once it is imported, where `jdp.train_step(loss_fn)`
expects the function. So the module is callable: its class is `CallableModule`, a
`types.ModuleType` subclass whose `__call__` is `jdp.core.train_step` (the language reference,
"Customizing module attribute access", allows setting a module's `__class__`; nothing is put in
`sys.modules`). Reading `jdp.train_step` imports it too (jdp's names load on first use), so
`jdp.train_step` is this module however it was reached; `__wrapped__` makes
`inspect.signature(jdp.train_step)` the function's. The function itself, with its
documentation, is `jdp.core.train_step`.

Example:
    >>> import jdp.train_step
    >>> import inspect
    >>> inspect.signature(jdp.train_step) == inspect.signature(jdp.core.train_step)
    True
"""
import sys
import types
from collections.abc import Callable

from jdp.core import train_step as __wrapped__


class CallableModule(types.ModuleType):
    """A module that, called, is `jdp.core.train_step`."""

    def __call__(self, loss_fn: Callable, **options) -> Callable:
        """`jdp.core.train_step(loss_fn, **options)`: see its documentation."""
        return __wrapped__(loss_fn, **options)


sys.modules[__name__].__class__ = CallableModule   # the reference's recipe: read, not assigned
