"""The call plan: what one adapted call adds, decided once per (slot state, context, device, dtype).

Contract
- `build(layer, ctx, device, dtype)`: a `CallPlan`, valid until the layer's slot state changes
  (the layer drops its plans then). Every eager route reads it:
  - ``selection``: `general_path.select(layer, ctx)`, the slots this call adds and their
    factors;
  - ``run(x, y)``: adds this call's adapter output to the base output `y`, with the same ops
    in the same order as `general_path.forward_general`, so every tier gives the same bits;
    None: the call adds nothing;
  - ``fused(x)``: what a LoRA-aware fused kernel takes for this call (`stacking.fused_factors`,
    or with per-branch rows `stacking.row_scaled_factors`), built once per plan.
A compiled call cannot read the context: it reads `traced` factors (built per slot state), whose
fallback is the same selection.
`layer` is an adapted layer (`wrapper.AdaptedLayer`); only its public members are read.
Design and numerics: docs/engine.md (call plans).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..scaling import apply_steps, combined_factor, factor_steps, folds_scales, times
from . import stacking
from .base_weight import real_shape
from .general_path import forward_general, select
from .stacking import can_add_inplace

_UNBUILT = object()


class CallPlan:
    """See the module contract. `fused` and its per-row variants are built on first use."""
    __slots__ = ("layer", "ctx", "device", "dtype", "selection", "run", "_fused", "_row_mask", "_rows")

    def __init__(self, layer, ctx, device, dtype, selection, run):
        self.layer, self.ctx, self.device, self.dtype = layer, ctx, device, dtype
        self.selection, self.run = selection, run
        self._fused, self._row_mask, self._rows = _UNBUILT, None, {}

    def fused(self, x: torch.Tensor):
        """(A [R, K], B [N, R], scale) for a fused kernel on `x`: scale a float, an fp32 [R] per-rank
        vector or (a per-branch adapter in a batched CFG call) an fp32 [M, R] per-row-and-rank
        matrix over x's M flattened rows; strength, schedule factor, runtime scale and row mask
        all in it. None when some live update cannot be fused (`unfusable_reason`)."""
        st = self._fused
        if st is _UNBUILT:
            st = self._fused = stacking.fused_factors(self.layer, self.ctx, self.device, self.dtype)
            self._row_mask = self.layer.call_has_row_mask(self.ctx)
        if st is not None or not self._row_mask:
            return st
        key = tuple(x.shape[:-1])
        st = self._rows.get(key, _UNBUILT)
        if st is _UNBUILT:
            if len(self._rows) >= 8:
                self._rows.clear()
            st = self._rows[key] = stacking.row_scaled_factors(self.layer, self.ctx, x)
        return st


def _stacked(a, bt, vec, alpha, share=None):
    """lossless/high, every live slot a stack() pair, no mask/offset: `stacking.addmm_stacked`'s
    ops (same bits), its Python inlined into one closure (this runs on every call). `share`
    (group, index, ctx): h comes from the sibling group's shared shrink GEMM (shared_shrink.py)."""
    r, n = int(a.shape[0]), int(bt.shape[1])
    linear, grad_on = F.linear, torch.is_grad_enabled

    if share is None:
        def run(x, y):
            h = linear(x, a)
            if vec is not None:
                h = times(h, vec, inplace=True)
            if not y.is_contiguous() or (y.requires_grad and grad_on()):
                return stacking.addmm_stacked(x, y, a, bt, vec, alpha)  # not in place: the general helper
            y.view(-1, n).addmm_(h.view(-1, r) if h.is_contiguous() else h.reshape(-1, r), bt, alpha=alpha)
            return y
    else:
        shrink, i, ctx = share[0].shrink, share[1], share[2]

        def run(x, y):
            if not y.is_contiguous() or (y.requires_grad and grad_on()):
                return stacking.addmm_stacked(x, y, a, bt, vec, alpha)
            h = shrink(i, x, ctx, a)
            if vec is not None:
                h = times(h, vec, inplace=True)
            y.view(-1, n).addmm_(h if h.dim() == 2 else h.reshape(-1, r), bt, alpha=alpha)
            return y
    run.shrink_a = a  # what a sibling's shared shrink GEMM reads for this plan
    return run


def _segmented(segments, n):
    """lossless/high with sliced updates (one fused weight, several row ranges): one shrink GEMM
    over every segment's A, then per segment ``y[:, lo:hi] += h_seg B_seg^T * alpha`` in place
    (addmm_ on a column block: no zero-filled full-width delta). `segments`: ((A, B^T, lo, hi,
    alpha), ...); the stacked pair's arithmetic per segment."""
    a = segments[0][0] if len(segments) == 1 else torch.cat([sg[0] for sg in segments], 0)
    parts, r0 = [], 0
    for sa, bt, lo, hi, alpha in segments:
        r = int(sa.shape[0])
        parts.append((r0, r0 + r, bt, lo, hi, alpha))
        r0 += r
    parts = tuple(parts)
    linear, grad_on = F.linear, torch.is_grad_enabled

    def run(x, y):
        h = linear(x.reshape(-1, x.shape[-1]), a)
        if not y.is_contiguous() or (y.requires_grad and grad_on()):
            y = y.clone() if y.requires_grad else y.contiguous()
        y2 = y.view(-1, n)
        for h0, h1, bt, lo, hi, alpha in parts:
            y2[:, lo:hi].addmm_(h[:, h0:h1], bt, alpha=alpha)
        return y
    return run


def _segments(dyn, f, device, dtype):
    """The (A, B^T, lo, hi, alpha) segments of the live slots when each is a stack() pair or a
    sliced update whose parts all are; else None."""
    segs = []
    for s in dyn:
        v, k = s.update, combined_factor(s.strength, f[s.name][0])
        parts = v.row_parts if v.row_parts is not None else ((0, v.out_features, v),) if s.stackable else None
        if parts is None:
            return None
        for lo, hi, pv in parts:
            st = pv.stack(device, dtype)
            if st is None or pv.needs_base_output:
                return None
            pa, pb, scale = st
            segs.append((pa, pb.t(), int(lo), int(hi), combined_factor(scale, k)))
    return tuple(segs)


class _Exact:
    """exact (or no context), every live slot a stack() pair, no mask/offset: per slot
    ((x A^T) B^T) times each non-unit factor in order, accumulated in slot order."""
    __slots__ = ("pairs",)

    def __init__(self, pairs):
        self.pairs = pairs   # ((A, B, steps), ...)

    def __call__(self, x, y):
        for a, b, steps in self.pairs:
            d = apply_steps(F.linear(F.linear(x, a), b), steps, inplace=True)
            y = y.add_(d) if can_add_inplace(y) else y + d
        return y


class _General:
    __slots__ = ("lw", "ctx", "selection")

    def __init__(self, lw, ctx, selection):
        self.lw, self.ctx, self.selection = lw, ctx, selection

    def __call__(self, x, y):
        return forward_general(self.lw, x, y, self.ctx, self.selection)


def build(lw, ctx, device, dtype) -> CallPlan:
    selection = select(lw, ctx)
    dyn, offsets, f = selection
    if not dyn and not offsets:
        return CallPlan(lw, ctx, device, dtype, selection, None)
    simple = not offsets and not lw.is_conv and all(f[s.name][1] is None for s in dyn)
    plain = simple and all(s.stackable and not s.update.needs_base_output for s in dyn)
    run = None
    if plain and folds_scales(ctx):
        f0 = f[dyn[0].name]
        if all(f[s.name] == f0 for s in dyn):  # uniform: the general path's add_stacked
            a, bt, factor, vec = stacking.stacked_pair(lw, device, dtype, dyn)
            sib = lw.sibling
            share = None if sib is None else (sib[0], sib[1], ctx)
            if vec is None:
                run = _stacked(a, bt, None, combined_factor(factor, f0[0]), share)
            else:
                run = _stacked(a, bt, vec.to(dtype), f0[0], share)
    elif plain:
        pairs = []
        for s in dyn:
            a, b, scale = s.update.stack(device, dtype)
            pairs.append((a, b, factor_steps((scale, s.strength, f[s.name][0]), ctx)))
        run = _Exact(tuple(pairs))
    elif simple and folds_scales(ctx) and any(s.update.row_parts is not None for s in dyn):
        segs = _segments(dyn, f, device, dtype)
        if segs is not None:
            run = _segmented(segs, real_shape(lw.weight)[0])
    if run is None:
        run = _General(lw, ctx, selection)
    return CallPlan(lw, ctx, device, dtype, selection, run)
