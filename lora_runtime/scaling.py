"""The one place where an update's factors are multiplied.

    delta = update(x) * scale * strength * runtime_scale

Contract
- A factor equal to 1.0 is never multiplied, in any tier.
- ``exact`` and calls with no runtime context: the non-unit factors are applied one after
  the other, in the order above (this *is* the reference path).
- ``lossless`` / ``high``: the product is applied once, or handed to the caller to fold
  into a GEMM's alpha or a kernel's per-rank scale; nothing at all when it is 1.0.
- Products of python floats are taken left to right (fp64 math), so a factor computed here
  in two steps has the same bits wherever it is used.
`ctx` is the call's runtime context (`layer.runtime_context.RuntimeContext`) or None.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from .settings import Tier


def folds_scales(ctx) -> bool:
    """May this call fold the factors into one product? Only inside a non-exact context."""
    return ctx is not None and ctx.tier is not Tier.EXACT


def nonunit(*factors: float) -> list[float]:
    return [float(f) for f in factors if float(f) != 1.0]


def combined_factor(*factors: float) -> float:
    """Product of the factors (1.0 when all are unit); python floats, so fp64 math."""
    return math.prod(nonunit(*factors), start=1.0)


def layer_strength(strength: float, block_factor: float) -> float:
    """One layer's strength: the adapter's strength times the layer's block factor (a block
    filter's multiplier). Python floats (fp64), unit factors skipped; the result is the slot's
    strength, so every tier applies it as it applies a strength."""
    return combined_factor(strength, block_factor)


def _mul(t: torch.Tensor, inplace: bool):
    if inplace and not (torch.is_grad_enabled() and t.requires_grad):
        return lambda d, f: d.mul_(f)
    return lambda d, f: d * f


def times(t: torch.Tensor, factor, inplace: bool = False) -> torch.Tensor:
    """`t` times one factor (a float, or a tensor that broadcasts); `t` itself when the
    factor is the float 1.0. `inplace=True` for a tensor the caller just made."""
    if not isinstance(factor, torch.Tensor) and float(factor) == 1.0:
        return t
    return _mul(t, inplace)(t, factor)


def scale_delta(delta: torch.Tensor, factors: tuple[float, ...], ctx,
                inplace: bool = False) -> torch.Tensor:
    """Apply `factors` (ordered: scale, strength, runtime scale) to `delta` per the tier.

    `inplace=True` for a delta the caller just computed (same bits, no new allocation).
    Returns `delta` itself when every factor is unit.
    """
    return apply_steps(delta, factor_steps(factors, ctx), inplace)


def factor_steps(factors: tuple[float, ...], ctx) -> tuple[float, ...]:
    """The multiplies `scale_delta` does for `factors` in `ctx`, in order (precomputable once
    per call plan): the folded product in lossless/high, each non-unit factor in exact."""
    if folds_scales(ctx):
        s = combined_factor(*factors)
        return () if s == 1.0 else (s,)
    return tuple(nonunit(*factors))


def apply_steps(delta: torch.Tensor, steps: tuple[float, ...], inplace: bool = False) -> torch.Tensor:
    """`delta` times each of `steps` in order (from `factor_steps`)."""
    if not steps:
        return delta
    mul = _mul(delta, inplace)
    for f in steps:
        delta = mul(delta, f)
    return delta


def per_rank(ranks_and_factors: Iterable[tuple[int, float]]) -> torch.Tensor:
    """fp32 [sum r] vector on the CPU: each update's factor repeated over its ranks (the scale
    of a stacked pair whose updates carry different factors)."""
    return torch.cat([torch.full((int(r),), f, dtype=torch.float32) for r, f in ranks_and_factors])
