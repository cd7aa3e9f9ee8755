"""The per-call runtime context a wrapper reads: quality tier and runtime scale.

Held in a ContextVar, never on a class attribute, so two models (or two threads)
never see each other's settings. A call outside any context is treated like
``exact`` with runtime scale 1.0: the reference path.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

from .settings import Tier, parse_tier


@dataclass(frozen=True)
class RuntimeContext:
    tier: Tier = Tier.EXACT
    scale: float = 1.0


_CURRENT: contextvars.ContextVar[RuntimeContext | None] = contextvars.ContextVar(
    "lora_runtime_context", default=None
)


def current_context() -> RuntimeContext | None:
    return _CURRENT.get()


@contextlib.contextmanager
def runtime_context(tier=None, scale: float | None = None):
    """Enter a runtime context; unspecified fields inherit from the enclosing one."""
    outer = _CURRENT.get() or RuntimeContext()
    ctx = RuntimeContext(
        tier=parse_tier(tier) if tier is not None else outer.tier,
        scale=float(scale) if scale is not None else outer.scale,
    )
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
