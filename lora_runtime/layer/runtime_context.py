"""The per-call runtime context a wrapper reads: quality tier, runtime scale, and the
per-adapter factors of this model call (strength schedules and branches, see `schedule`).

Held in a ContextVar, never on a class attribute, so two models (or two threads)
never see each other's settings. A call outside any context is treated like
``exact`` with runtime scale 1.0: the reference path.

Entering equal settings (same tier, scale and adapters mapping object) gives the same
context object, so per-layer call plans keyed by context identity are reused.

Traced code (torch.compile) cannot read a ContextVar: each adapter's runtime factor and row
mask are also published into an `AdapterCell` (an fp32 0-d tensor written in place) on every
context entry and exit, outside any traced region. Cells are process-wide: the compiled path
sees the most recently entered context (one sampling at a time, as in ComfyUI).
"""
from __future__ import annotations

import contextlib
import contextvars
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

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


class AdapterCell:
    """The runtime factor (scale times scheduled multiplier, fp32 0-d tensor on `device`) and row
    mask of one adapter for the current context, updated in place when a context is entered or
    left; what compiled code reads instead of the ContextVar."""

    __slots__ = ("name", "device", "factor", "mask", "value", "__weakref__")

    def __init__(self, name: str, device):
        self.name, self.device = name, device
        self.value, self.mask = None, None
        self.factor = torch.ones((), dtype=torch.float32, device=device)
        self.update(_CURRENT.get())

    def update(self, ctx: "RuntimeContext | None") -> None:
        m, mask = ctx.adapter_factor(self.name) if ctx is not None else (1.0, None)
        if m != self.value:
            with torch.no_grad():
                self.factor.fill_(m)
            self.value = m
        if mask is not None and mask.device != self.factor.device:
            mask = mask.to(self.factor.device)
        self.mask = mask


_CELLS: "weakref.WeakValueDictionary[tuple, AdapterCell]" = weakref.WeakValueDictionary()


def adapter_cell(name: str, device) -> AdapterCell:
    """The live cell of adapter `name` on `device` (shared by every layer that holds it)."""
    key = (name, torch.device(device))
    cell = _CELLS.get(key)
    if cell is None:
        cell = _CELLS[key] = AdapterCell(name, key[1])
    return cell


def _publish(ctx: RuntimeContext | None) -> None:
    for cell in list(_CELLS.values()):
        cell.update(ctx)


_INTERNED: dict[tuple, RuntimeContext] = {}


def _interned(tier, scale: float, adapters) -> RuntimeContext:
    key = (tier, scale, id(adapters))
    ctx = _INTERNED.get(key)
    if ctx is None or ctx.adapters is not adapters:  # the context holds `adapters`: its id stays valid
        if len(_INTERNED) > 256:
            _INTERNED.clear()
        ctx = _INTERNED[key] = RuntimeContext(tier=tier, scale=scale, adapters=adapters)
    return ctx


@contextlib.contextmanager
def runtime_context(tier=None, scale: float | None = None, adapters: Mapping | None = None):
    """Enter a runtime context; unspecified fields inherit from the enclosing one."""
    outer = _CURRENT.get() or RuntimeContext()
    ctx = _interned(parse_tier(tier) if tier is not None else outer.tier,
                    float(scale) if scale is not None else outer.scale,
                    adapters if adapters is not None else outer.adapters)
    token = _CURRENT.set(ctx)
    _publish(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
        _publish(_CURRENT.get())
