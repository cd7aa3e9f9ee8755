"""Stacked low-rank pairs of one layer: every slot whose update answers `stack()` shares one pair of
GEMMs (dynamic path in lossless/high) and one fused-kernel call.

Contract
- `stacked_pair` concatenates the updates' `stack()` pairs with their scale times strength (no
  runtime scale), cached on the layer until its slot state changes.
- `add_stacked` / `add_stacked_per_slot` add ``sum_i (x A_i^T) f_i B_i^T`` to the base output in
  place (addmm_), the factors applied through `scaling`.
- `fused_factors` / `row_scaled_factors`: what a fused kernel takes for a call, or None; a
  call plan builds them once (`CallPlan.fused`); `unfusable_reason` says why there are none.
`layer` is an adapted layer (`wrapper.AdaptedLayer`); only its public members are read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import LoraRuntimeError
from ..scaling import combined_factor, per_rank, times


def can_add_inplace(y: torch.Tensor) -> bool:
    """In-place accumulation into the base output: only when it is a plain contiguous tensor
    outside autograd (a leaf-free inference output)."""
    return y.is_contiguous() and not (torch.is_grad_enabled() and y.requires_grad)


def row_mask(mask: torch.Tensor, like: torch.Tensor, layer: str) -> torch.Tensor:
    """A per-row 0/1 mask [rows] of the model call shaped to broadcast over `like` (batch on dim
    0, or batch-major flattened rows), in its dtype (0 and 1 are exact in every float dtype)."""
    n = mask.shape[0]
    lead = like.shape[0] if like.dim() else 1
    if lead != n:
        if like.dim() < 2 or lead % n:
            raise LoraRuntimeError(
                f"{layer}: a per-branch adapter needs the batch on dim 0 of this layer's input, but it has "
                f"{lead} rows for a call of {n}; set the adapter's branch to 'both'")
        mask = mask.repeat_interleave(lead // n)
    return mask.to(like.device, like.dtype).view(-1, *([1] * (like.dim() - 1)))


def rank_of(s) -> int:
    return int(s.update.stack()[0].shape[0])


def stacked_pair(lw, device, dtype, slots=None):
    """(A_cat [R, in], B_cat^T [R, out], uniform factor, per-rank fp32 factors or None) of the
    stackable slots: each update's `stack()`, its scale times the slot's strength (no runtime
    scale). Cached until the slot state changes."""
    slots = [s for s in lw.weight_slots() if not s.merged and s.stackable] if slots is None else slots
    key = (device, dtype, tuple(s.name for s in slots))
    st = lw.factor_cache.get(key)
    if st is None:
        stacks = [s.update.stack(device, dtype) for s in slots]
        factors = [combined_factor(scale, s.strength) for s, (_, _, scale) in zip(slots, stacks)]
        a = stacks[0][0] if len(stacks) == 1 else torch.cat([p[0] for p in stacks], 0)
        b = stacks[0][1] if len(stacks) == 1 else torch.cat([p[1] for p in stacks], 1)
        uniform = all(f == factors[0] for f in factors)
        vec = None if uniform else per_rank((p[0].shape[0], f) for p, f in zip(stacks, factors)).to(device)
        st = lw.factor_cache[key] = (a, b.t(), factors[0] if uniform else 1.0, vec)
    return st


def fused_factors(lw, ctx, device, dtype):
    """(A_cat [R, in], B_cat [out, R], scale) for a fused kernel in `ctx` (see `AdaptedLayer.stack`)."""
    rs = ctx.scale if ctx is not None else 1.0
    live, offsets = lw.live_slots()
    if not live or offsets or lw.is_conv or any(not s.stackable for s in live):
        return None
    if ctx is not None and ctx.adapters is not None:  # this call's per-adapter factors
        f = {s.name: lw.call_factor(s, ctx) for s in live}
        if any(m is not None for _, m in f.values()):
            return None  # a per-row (per-branch) factor: the fused kernel takes per-rank scales only
        live = [s for s in live if f[s.name][0] != 0.0]
        if not live:
            return None
        if any(f[s.name][0] != f[live[0].name][0] for s in live):
            a, bt, _, _ = stacked_pair(lw, device, dtype, live)
            return a, bt.t(), per_rank((rank_of(s), combined_factor(s.update.scale, s.strength, f[s.name][0]))
                                       for s in live).to(device)
        rs = f[live[0].name][0]
    a, bt, factor, vec = stacked_pair(lw, device, dtype, live)
    scale = combined_factor(factor, rs) if vec is None else times(vec, rs)
    return a, bt.t(), scale


def row_scaled_factors(lw, ctx, x: torch.Tensor):
    """`fused_factors` with the CFG row masks folded into an fp32 [M, R] scale over x's M rows."""
    live, offsets = lw.live_slots()
    if not live or offsets or lw.is_conv or any(not s.stackable for s in live):
        return None
    f = {s.name: lw.call_factor(s, ctx) for s in live}
    live = [s for s in live if f[s.name][0] != 0.0]
    if not live:
        return None
    a, bt, _, _ = stacked_pair(lw, x.device, x.dtype, live)
    rows = x.numel() // x.shape[-1]
    cols = []
    for s in live:
        rs, mask = f[s.name]
        per_row = torch.full((rows,), combined_factor(s.update.scale, s.strength, rs), dtype=torch.float32,
                             device=x.device)
        if mask is not None:
            m = row_mask(mask, x, lw.layer_name).to(torch.float32)[..., 0].expand(x.shape[:-1]).reshape(-1)
            per_row = per_row * m
        cols.append(per_row[:, None].expand(rows, rank_of(s)))
    return a, bt.t(), torch.cat(cols, 1)


def unfusable_reason(lw) -> str:
    """Why `fused_factors` gives nothing for a call now (for the fusion report)."""
    if lw.call_has_row_mask():
        return "a per-branch adapter in a CFG batch: the fused kernel takes a per-rank scale, not a per-row one"
    live, offsets = lw.live_slots()
    kinds = sorted({s.update.kind for s in live if not s.stackable})
    if kinds:
        return f"{'/'.join(kinds)} update: a fused kernel takes plain LoRA only"
    if offsets:
        return "an output offset (diff_b) rides on the layer"
    if lw.is_conv:
        return "a convolution"
    return "no live low-rank update"


def add_stacked(lw, x: torch.Tensor, y: torch.Tensor, slots, rs: float) -> torch.Tensor:
    """y += sum_i (x A_i^T) B_i^T * s_i * rs with one pair of GEMMs, in place."""
    a, bt, factor, vec = stacked_pair(lw, x.device, x.dtype, slots)
    if vec is not None:  # per-adapter factors differ: one multiply on the small [T, R] tensor
        return addmm_stacked(x, y, a, bt, vec.to(x.dtype), rs)
    return addmm_stacked(x, y, a, bt, None, combined_factor(factor, rs))


def addmm_stacked(x, y, a, bt, vec, alpha) -> torch.Tensor:
    """y += ((x A^T) [* vec]) B^T * alpha, in place when y allows (add_stacked's arithmetic
    with its factors already worked out; a call plan calls it directly)."""
    h = F.linear(x, a)
    if vec is not None:
        h = times(h, vec, inplace=True)
    if not can_add_inplace(y):
        y = y.contiguous() if not y.requires_grad else y.clone()
    y.view(-1, y.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), bt, alpha=alpha)
    return y


def add_stacked_per_slot(lw, x, y, slots, factors) -> torch.Tensor:
    """y += sum_i (x A_i^T) * f_i * mask_i B_i^T: one pair of GEMMs; the per-adapter factors
    (scale * strength * this call's runtime scale) and row masks on h [T, R]."""
    a, bt, factor, vec = stacked_pair(lw, x.device, x.dtype, slots)
    key = ("per_slot", x.device, x.dtype, tuple(s.name for s in slots), tuple(rs for rs, _ in factors))
    ranks = lw.factor_cache.get(key)
    if ranks is None:  # one small vector per distinct factor set (at most one per step)
        ranks = lw.factor_cache[key] = per_rank(
            (rank_of(s), combined_factor(s.factor, rs)) for s, (rs, _) in zip(slots, factors)
        ).to(x.device, x.dtype)
    h = times(F.linear(x, a), ranks, inplace=True)
    r0 = 0
    for s, (_, mask) in zip(slots, factors):
        r = rank_of(s)
        if mask is not None:  # a 0/1 row mask, in place on this slot's ranks
            h[..., r0:r0 + r].mul_(row_mask(mask, h, lw.layer_name))
        r0 += r
    if not can_add_inplace(y):
        y = y.contiguous() if not y.requires_grad else y.clone()
    y.view(-1, y.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), bt)
    return y
