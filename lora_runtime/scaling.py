"""The one place where a LoRA delta's scale factors are applied (contracts.md s.3).

    delta = ((x @ A^T) @ B^T) * (alpha / rank) * strength * runtime_scale

- A factor equal to 1.0 is never multiplied, in any tier.
- ``exact`` and calls with no runtime context: the non-unit factors are applied one
  after the other, in the order above (this *is* the reference path).
- ``lossless`` / ``high``: the product is applied once, or handed to the caller to
  fold into a GEMM's alpha; nothing at all when the product is 1.0.
"""
from __future__ import annotations

import math

import torch

from .runtime_context import RuntimeContext
from .settings import Tier


def folds_scales(ctx: RuntimeContext | None) -> bool:
    """May this call fold the factors into one product? Only inside a non-exact context."""
    return ctx is not None and ctx.tier is not Tier.EXACT


def nonunit(*factors: float) -> list[float]:
    return [float(f) for f in factors if float(f) != 1.0]


def combined_factor(*factors: float) -> float:
    """Product of the factors (1.0 when all are unit); python floats, so fp64 math."""
    return math.prod(nonunit(*factors), start=1.0)


def scale_delta(delta: torch.Tensor, factors: tuple[float, ...], ctx: RuntimeContext | None,
                inplace: bool = False) -> torch.Tensor:
    """Apply `factors` (ordered: alpha/rank, strength, runtime scale) to `delta` per the tier.

    `inplace=True` for a delta the caller just computed (same bits, no new allocation).
    Returns `delta` itself when every factor is unit.
    """
    mul = (lambda t, f: t.mul_(f)) if inplace and not (torch.is_grad_enabled() and delta.requires_grad) \
        else (lambda t, f: t * f)
    if folds_scales(ctx):
        s = combined_factor(*factors)
        return delta if s == 1.0 else mul(delta, s)
    for f in nonunit(*factors):
        delta = mul(delta, f)
    return delta
