"""The per-call runtime context a wrapper reads: quality tier, runtime scale, and the
per-adapter factors of this model call (strength schedules and branches, see `schedule`).

Held in a ContextVar, never on a class attribute, so two models (or two threads)
never see each other's settings. A call outside any context is treated like
``exact`` with runtime scale 1.0: the reference path.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..scaling import combined_factor
from ..settings import Tier, parse_tier


@dataclass(frozen=True)
class RuntimeContext:
    tier: Tier = Tier.EXACT
    scale: float = 1.0
    # this model call's factor per adapter name: (multiplier, row mask [rows] fp32 or None);
    # adapters not listed have factor 1.0 on every row. Set per model call by the sampler hook.
    adapters: Mapping[str, tuple[float, Any]] | None = field(default=None, compare=False)

    def adapter_factor(self, name: str) -> tuple[float, Any]:
        """(runtime scale of adapter `name` for this call, row mask or None): the context's
        scale times the adapter's scheduled multiplier (a python float product: x * 1.0 is x)."""
        if self.adapters is None:
            return self.scale, None
        m, mask = self.adapters.get(name, _UNIT)
        return combined_factor(self.scale, m), mask


_UNIT = (1.0, None)

_CURRENT: contextvars.ContextVar[RuntimeContext | None] = contextvars.ContextVar(
    "lora_runtime_context", default=None
)


def current_context() -> RuntimeContext | None:
    return _CURRENT.get()


@contextlib.contextmanager
def runtime_context(tier=None, scale: float | None = None, adapters: Mapping | None = None):
    """Enter a runtime context; unspecified fields inherit from the enclosing one."""
    outer = _CURRENT.get() or RuntimeContext()
    ctx = RuntimeContext(
        tier=parse_tier(tier) if tier is not None else outer.tier,
        scale=float(scale) if scale is not None else outer.scale,
        adapters=adapters if adapters is not None else outer.adapters,
    )
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
