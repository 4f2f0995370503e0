"""FSDP's step never peaks above the compiler's own placement of the gathers.

Gathering layer by layer holds one layer whole at a time in a deep model, but in a model whose
layers are small beside their activations (a ResNet's convolutions) the order it imposes can
keep more alive than the compiler's own schedule. At the step's first call both are compiled
when some layer gathers on its own, and the compiler's is kept when its peak
(`memory_analysis()`: arguments + outputs - donated + temporaries) is lower by 5 % or more,
which is said once (nearly equal peaks keep the layers, whose peak scales with one layer).
Every process keeps process 0's choice. The kept executable is jit's own: no third compile.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from jdp.distributed import broadcast_for
from jdp.spmd import layers as _layers

MiB = 2**20
MARGIN = 0.95   # the compiler's placement is kept when it peaks below this share of by-layer's


class LowerPeak:
    """`transform(body)` for an FSDP step, compiled by layer and by the compiler at its first
    call (or `lower`); calls go to the one with the lower peak."""

    def __init__(self, body: Callable, transform: Callable, who: str) -> None:
        self.who = who
        self.gathered: list = []
        self.by_layer = transform(_traced_with(body, lambda: self.gathered))
        self.by_compiler = transform(by_compiler(body))
        self.chosen: Any = None

    def __call__(self, *args: Any) -> Any:
        if self.chosen is None:
            self.chosen = self._choose(args)
        return self.chosen(*args)

    def lower(self, *args: Any) -> Any:
        if self.chosen is None:
            self.chosen = self._choose(args)
        return self.chosen.lower(*args)

    def _choose(self, args: tuple) -> Any:
        """Compile by layer; if a layer gathered on its own, by the compiler too; keep the
        lower peak (process 0's choice on every process)."""
        layers = peak(self.by_layer.lower(*args).compile())
        if not self.gathered:
            return self.by_layer
        compiler = peak(self.by_compiler.lower(*args).compile())
        use_compiler = bool(broadcast_for(np.bool_(compiler < MARGIN * layers), self.who))
        if use_compiler:
            warnings.warn(
                f"{self.who}(shard_params=...): gathering {len(self.gathered)} layer(s) one "
                f"at a time would peak at {layers / MiB:.1f} MiB per device, the compiler's "
                f"own placement of the gathers at {compiler / MiB:.1f} MiB: this step uses "
                "the compiler's (to choose it up front and compile once: "
                "jdp.layer_policy(loss_fn, enabled=False))",
                UserWarning, stacklevel=4)
        return self.by_compiler if use_compiler else self.by_layer


def by_compiler(body: Callable) -> Callable:
    """`body` traced with no layer gathering on its own: the compiler places every gather."""
    return _traced_with(body, lambda: False)


def _traced_with(body: Callable, by_layer: Callable[[], list | bool]) -> Callable:
    """`body` that, while traced, lets layers gather on their own (recording them in the list
    `by_layer()` gives) or not (False)."""
    def traced(*args: Any) -> Any:
        token = _layers._BY_LAYER.set(by_layer())
        try:
            return body(*args)
        finally:
            _layers._BY_LAYER.reset(token)
    return traced


def peak(compiled: Any) -> int:
    """A compiled step's peak bytes per device: arguments + outputs - donated + temporaries
    (0 where the backend gives no analysis)."""
    with contextlib.suppress(Exception):
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                   + m.temp_size_in_bytes)
    return 0
