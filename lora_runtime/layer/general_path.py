"""What a call adds, slot by slot: the selection every route reads and the general eager path.

Contract
- `select(layer, ctx)`: (live weight slots, live offset slots, {name: (runtime scale, row mask)})
  of a call in `ctx`; slots scheduled to 0 there are left out (the call then gives the base
  bits). Every route (call plans, the fused factors, a traced call's fallback, cast-time
  patches) starts from it.
- `forward_general(layer, x, y, ctx, selection)`: ``y`` plus every selected slot's output, the
  reference arithmetic of every tier; a call plan's fast closures reproduce it op for op.
`layer` is an adapted layer (`wrapper.AdaptedLayer`); only its public members are read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..scaling import combined_factor, folds_scales, scale_delta, times
from . import stacking
from .base_weight import real_shape
from .stacking import can_add_inplace, row_mask

_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def select(layer, ctx):
    """(live weight slots, live offset slots, {name: (runtime scale, row mask)}) of a call in `ctx`."""
    dyn, offsets = layer.live_slots()
    if not dyn and not offsets or (ctx is not None and ctx.scale == 0.0):
        return [], [], {}
    # this call's runtime scale and row mask per slot: the context's scale, times a strength
    # schedule and a CFG-branch mask when the sampler set them (schedule.py)
    f = {s.name: layer.call_factor(s, ctx) for s in (*dyn, *offsets)}
    if ctx is not None and ctx.adapters is not None:  # slots scheduled to 0 this call: base bits
        dyn = [s for s in dyn if f[s.name][0] != 0.0]
        offsets = [s for s in offsets if f[s.name][0] != 0.0]
    return dyn, offsets, f


def forward_general(layer, x, y, ctx, selection) -> torch.Tensor:
    """Every path (the plans' fallback): `selection` from `select(layer, ctx)`."""
    dyn, offsets, f = selection
    if layer.is_conv:
        return _conv_forward(layer, x, y, dyn, offsets, f, ctx)
    if folds_scales(ctx):
        # an update that wants x W^T (DoRA, per-row norm) reads it off the base output before
        # anything is added to it (y - bias) instead of a second base GEMM; reference: recomputed
        first = [s for s in dyn if s.update.needs_base_output]
        y0 = base_out_nobias(layer, y) if first else None
        first = [masked(layer, slot_delta(layer, x, s, f[s.name][0], ctx, y0=y0), f[s.name][1]) for s in first]
        stacked = [s for s in dyn if s.stackable]
        if stacked:  # one pair of GEMMs for every update that answers stack()
            f0 = f[stacked[0].name]
            if f0[1] is None and all(f[s.name] == f0 for s in stacked):
                y = stacking.add_stacked(layer, x, y, stacked, f0[0])  # uniform: scale rides as addmm_'s alpha
            else:
                y = stacking.add_stacked_per_slot(layer, x, y, stacked, [f[s.name] for s in stacked])
        for d in first:
            y = y.add_(d) if can_add_inplace(y) else y + d
        dyn = [s for s in dyn if not s.stackable and not s.update.needs_base_output]
    for s in dyn:
        # the delta is a fresh tensor, scaled in place; accumulate in place too (same bits)
        d = masked(layer, slot_delta(layer, x, s, f[s.name][0], ctx), f[s.name][1])
        y = y.add_(d) if can_add_inplace(y) else y + d
    return add_offsets(layer, y, offsets, f, ctx)


def masked(layer, d: torch.Tensor, mask) -> torch.Tensor:
    """The delta on the rows of this call's chosen CFG branch only (exact: the last factor)."""
    return d if mask is None else times(d, row_mask(mask, d, layer.layer_name))


def add_offsets(layer, y: torch.Tensor, offsets, f, ctx) -> torch.Tensor:
    """diff_b output offsets (cached and shared: never in place); on a conv, per channel."""
    for s in offsets:
        rs, mask = f[s.name]
        off = s.update.bias_delta(y.device, y.dtype)
        if layer.is_conv:
            off = off.reshape(-1, *([1] * (y.dim() - 2)))
        off = scale_delta(off, (s.strength, rs), ctx)
        y = y + (off if mask is None else times(off, row_mask(mask, y, layer.layer_name)))
    return y


def base_out_nobias(layer, y: torch.Tensor) -> torch.Tensor | None:
    """x W^T read off the base output, or None (`base_bias_to_subtract`): then it is recomputed."""
    ok, fb = layer.base_bias_to_subtract()
    if not ok:
        return None
    return y if fb is None else y - fb.to(y.device, y.dtype)


def slot_delta(layer, x: torch.Tensor, s, rs: float, ctx, y0=None) -> torch.Tensor:
    """One slot's output delta (no diff_b). An update with a `stack()` pair, in `exact`:
    ((x A^T) B^T), then each non-unit factor (scale, strength, runtime scale) in order. Other
    updates: their own `forward`, then strength and runtime scale; in lossless/high their
    product goes into the update's forward (onto its small inner tensor)."""
    v = s.update
    st = v.stack(x.device, x.dtype)
    if st is not None:
        a, b, scale = st
        return scale_delta(F.linear(F.linear(x, a), b), (scale, s.strength, rs), ctx, inplace=True)
    w = layer.dense_weight if v.needs_weight else None
    if folds_scales(ctx):
        return v.forward(x, combined_factor(s.strength, rs), base_out_nobias=y0, weight=w, include_bias=False)
    return scale_delta(v.forward(x, 1.0, weight=w, include_bias=False), (s.strength, rs), ctx, inplace=True)


def _conv_forward(layer, x, y, dyn, offsets, f, ctx):
    """Conv layers: each live slot's dense kernel delta (strength folded in, cached per
    strength/device/dtype: a patch embedding's kernel is small) through the layer's own
    convolution geometry, then its runtime scale and row mask."""
    conv = layer.get_base_layer()
    shape = real_shape(conv.weight)
    fn = _CONV_FN[len(shape) - 2]
    cache = layer.factor_cache
    for s in dyn:
        key = ("conv", s.name, s.strength, x.device, x.dtype)
        k = cache.get(key)
        if k is None:
            d = times(s.update.delta(x.device, torch.float32), s.strength, inplace=True)
            k = cache[key] = d.reshape(shape).to(x.dtype)
        rs, mask = f[s.name]
        d = scale_delta(fn(x, k, None, conv.stride, conv.padding, conv.dilation, conv.groups), (rs,), ctx,
                        inplace=True)
        d = masked(layer, d, mask)
        y = y.add_(d) if can_add_inplace(y) else y + d
    return add_offsets(layer, y, offsets, f, ctx)
