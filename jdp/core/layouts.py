"""Other layouts plug in here, so that the core and the packages above it ask no adapter anything.

The core's own layout is the global one (global arrays on `jdp.mesh()`). An adapter module,
`jdp.pmap` (the classic stacked form), registers its layout once, when it is imported (the
first numeric name read from `jdp` imports it): its name, how to tell a tree in it, how to put
a process's rows in it, and how to turn one of its trees into one global copy and back.
`jdp.shard(rows, layout=...)`, `jdp.data.Loader(layout=...)`, `jdp.broadcast` and the
Checkpointer (any layout) find it here by name or by tree, so the core imports nothing from
the adapter and removing the adapter breaks only its own form. The table is written at import
only and read after.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

GLOBAL = "global"


class Layout(NamedTuple):
    """What an adapter tells the core about its layout."""
    name: str                              # the `layout=` value that selects it
    holds: Callable[[Any, str], bool]      # (tree, who): whether a tree is in this layout
    shard: Callable[[Any], Any]            # a process's rows into this layout, checked
    place_rows: Callable[..., Any]         # (rows, devices=None): the same, unchecked (Loader)
    to_global: Callable[[Any, str], Any]   # (tree, who): one copy, global, replicated
    like: Callable[[Any, Any, str], Any]   # (template, tree, who): `tree` in template's layout
    made_by: str                           # the calls that make and undo it, and its step,
    undone_by: str                         # for messages: "jdp.replicate",
    step: str                              # "jdp.pmap.unreplicate", "jdp.pmap.train_step"


_LAYOUTS: dict = {}


def register(layout: Layout) -> None:
    """Make `layout` known by its name (an adapter calls this once, at its import)."""
    if not isinstance(layout, Layout) or layout.name == GLOBAL:
        raise ValueError(f"jdp.core.layouts.register: {layout!r}; expected a Layout whose name "
                         f"is not {GLOBAL!r}")
    _LAYOUTS[layout.name] = layout


def names() -> tuple:
    """Every `layout=` value: 'global' first, then the adapters' in registration order."""
    return (GLOBAL, *_LAYOUTS)


def named(name: str) -> Layout | None:
    """The adapter layout called `name`; None for 'global'; a ValueError for anything else."""
    if isinstance(name, str) and name in _LAYOUTS:
        return _LAYOUTS[name]
    if name == GLOBAL:
        return None
    raise ValueError(f"layout={name!r}; expected one of {names()} ('global' is the default)")


def of(tree: Any, who: str = "jdp") -> Layout | None:
    """The adapter layout `tree` is in, or None (global arrays, host arrays, anything else);
    an adapter may refuse a tree whose layout it cannot tell (ValueError naming `who`)."""
    return next((layout for layout in _LAYOUTS.values() if layout.holds(tree, who)), None)


def to_global(tree: Any, who: str = "jdp") -> Any:
    """`tree` as one copy of global arrays if an adapter's layout holds it; else unchanged."""
    layout = of(tree, who)
    return tree if layout is None else layout.to_global(tree, who)


def like(template: Any, tree: Any, who: str = "jdp") -> Any:
    """`tree` (global, or host values) in the layout `template` is in."""
    layout = of(template, who)
    return tree if layout is None else layout.like(template, tree, who)
