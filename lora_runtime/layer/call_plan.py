"""What one adapted call of a `LoraLinear` does, decided once and reused.

Contract
- `build(lw, ctx, device, dtype)`: a `CallPlan` for calls in context `ctx` with inputs on
  `device`/`dtype`, valid until the wrapper's slot state changes (the wrapper drops its plans
  then). Its ``run(x, y)`` adds this call's adapter output to the base output `y`, with the
  same ops in the same order as the general path (`LoraLinear._forward_general`), so every
  tier gives the same bits; ``run`` None: the call adds nothing.
- `build_trace_plan(lw)` (via `LoraLinear.prepare_trace`, after each state transition): what a
  compiled (traced) call reads: tensors only, the factors as fp32 0-d tensors (slot factor, and
  the adapter's `AdapterCell` for the runtime factor and row mask). stack() pairs ride as pairs;
  every other update as its trace form (`updates.trace_forms`: LoKr, LoHa, full deltas, DoRA,
  sliced updates of those).
  Convolutions ride as their kernel delta (a `conv` form). `traced_forward` uses it, or the
  general path when there is none (a DoRA whose base output the host patches per call).
Design and numerics: docs/engine.md (call plans, torch.compile).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..scaling import apply_steps, combined_factor, factor_steps, folds_scales, per_rank, times
from . import stacking
from ..updates.trace_forms import ConvForm
from .base_weight import real_shape
from .runtime_context import adapter_cell, current_context
from .stacking import can_add_inplace, row_mask

if TYPE_CHECKING:
    from .wrapper import LoraLinear


_COMPUTE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class CallPlan:
    __slots__ = ("ctx", "device", "dtype", "run")

    def __init__(self, ctx, device, dtype, run):
        self.ctx, self.device, self.dtype, self.run = ctx, device, dtype, run


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
    __slots__ = ("lw", "ctx", "dyn", "offsets", "f")

    def __init__(self, lw, ctx, dyn, offsets, f):
        self.lw, self.ctx, self.dyn, self.offsets, self.f = lw, ctx, dyn, offsets, f

    def __call__(self, x, y):
        return self.lw._forward_general(x, y, self.ctx, self.dyn, self.offsets, self.f)


def build(lw: "LoraLinear", ctx, device, dtype) -> CallPlan:
    dyn, offsets, f = lw._call_selection(ctx)
    if not dyn and not offsets:
        return CallPlan(ctx, device, dtype, None)
    simple = not offsets and not lw.is_conv and all(f[s.name][1] is None for s in dyn)
    plain = simple and all(s.stackable and not s.update.needs_base_output for s in dyn)
    run = None
    if plain and folds_scales(ctx):
        f0 = f[dyn[0].name]
        if all(f[s.name] == f0 for s in dyn):  # uniform: the general path's add_stacked
            a, bt, factor, vec = stacking.stacked_pair(lw, device, dtype, dyn)
            sib = getattr(lw, "_sibling", None)
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
        run = _General(lw, ctx, dyn, offsets, f)
    return CallPlan(ctx, device, dtype, run)


# --- compiled calls --------------------------------------------------------------------------
class TracePlan:
    """Per live stack() slot (A [r, in], B [out, r], slot factor fp32 0-d, AdapterCell); per other
    live slot (trace form, slot factor fp32 0-d, AdapterCell); per enabled slot
    with an output offset (diff_b fp32 [out], strength fp32 0-d, AdapterCell), on `device`.
    `base_bias`: what a form that reads the base output (DoRA) subtracts from the call's output
    to get x Wᵀ (None: the layer has no bias); `needs_y0`: some form reads it."""
    __slots__ = ("device", "slots", "offsets", "layer", "forms", "needs_y0", "base_bias")

    def __init__(self, device, slots, layer, offsets=(), forms=(), base_bias=None):
        self.device, self.slots, self.offsets, self.layer = device, slots, offsets, layer
        self.forms, self.base_bias = forms, base_bias
        self.needs_y0 = any(f[0].needs_base_output for f in forms)


def _trace_pair(s, device, dtype):
    """(A [R, in], B [out, R], k) of one live slot for a traced call, k its scale x strength as
    fp32 (0-d, or [R] per rank for a sliced update: its parts' A's stacked, their B's placed in
    their row blocks of a zero [out, R] B); None when the update is not made of stack() pairs."""
    v = s.update
    if v.needs_base_output:
        return None
    if v.row_parts is not None:
        parts = [(lo, hi, p.stack(device, dtype or p.stack()[0].dtype)) for lo, hi, p in v.row_parts]
        if any(st is None for _, _, st in parts) or any(p.needs_base_output for _, _, p in v.row_parts):
            return None
        a = torch.cat([st[0] for _, _, st in parts], 0)
        b = a.new_zeros(v.out_features, a.shape[0])
        r0 = 0
        for lo, hi, (pa, pb, _) in parts:
            b[lo:hi, r0:r0 + pa.shape[0]] = pb
            r0 += pa.shape[0]
        k = per_rank((st[0].shape[0], combined_factor(st[2], s.strength)) for _, _, st in parts).to(device)
        return a, b, k
    st = v.stack()
    if st is None:
        return None
    a, b, scale = v.stack(device, dtype or st[0].dtype)
    return a, b, torch.tensor(combined_factor(scale, s.strength), dtype=torch.float32, device=device)


def build_trace_plan(lw: "LoraLinear") -> TracePlan | None:
    """Built after a state transition (outside any trace). Enabled, unmerged slots count even at
    strength 0 (a factor of 0 then), so a strength change never changes what a trace reads; an
    output offset is added per call, merged or not (the merge writes the weight only). None
    (compiled calls take the general path, which reads the context and breaks the graph) when a
    live slot has neither a stack() pair (`_trace_pair`) nor a trace form, a form reads the base
    output and the host patches the weight or bias per call, or a convolution's update needs the
    weight. A convolution's slot is its dense kernel delta (times scale), convolved like the layer."""
    enabled = [s for s in lw.slots.values() if s.enabled]
    live = [s for s in enabled if not s.merged and s.has_weight_delta]
    offs = [s for s in enabled if s.update.diff_b is not None]
    if not live and not offs:
        return TracePlan(None, (), lw.layer_name)
    w = lw.weight
    if w is None or w.is_meta:
        return None
    device = w.device
    slots, forms = [], []
    conv = lw.get_base_layer() if lw.is_conv else None
    for s in live:
        if conv is not None:  # the eager path's dense kernel, without the strength
            if s.update.needs_weight:
                return None
            kern = s.update.delta(device, torch.float32).reshape(real_shape(conv.weight))
            geometry = (conv.stride, conv.padding, conv.dilation, conv.groups)
            forms.append((ConvForm(kern.to(w.dtype if w.dtype in _COMPUTE else torch.float32), *geometry),
                          torch.tensor(float(s.strength), dtype=torch.float32, device=device),
                          adapter_cell(s.name, device)))
            continue
        # the weight's dtype when it is a compute dtype (the usual case: the eager path's copy is
        # shared), else (fp8/int weights cast per call) the adapter's own; a traced call casts to x's
        pair = _trace_pair(s, device, w.dtype if w.dtype in _COMPUTE else None)
        if pair is not None:
            slots.append((*pair, adapter_cell(s.name, device)))
            continue
        form = s.update.trace_form(device, w.dtype if w.dtype in _COMPUTE else torch.float32,
                                   weight=lw.dense_weight if s.update.needs_weight else None)
        if form is None:
            return None
        form, scale = form
        k = torch.tensor(combined_factor(scale, s.strength), dtype=torch.float32, device=device)
        forms.append((form, k, adapter_cell(s.name, device)))
    base_bias = None
    if any(f[0].needs_base_output for f in forms):
        ok, base_bias = lw.base_bias_to_subtract()
        if not ok:
            return None
    spatial = [1] * (len(real_shape(conv.weight)) - 2) if conv is not None else []  # [C] -> [C, 1, ...]
    offsets = tuple((s.update.bias_delta(device, torch.float32).reshape(-1, *spatial),
                     torch.tensor(float(s.strength), dtype=torch.float32, device=device),
                     adapter_cell(s.name, device)) for s in offs)
    return TracePlan(device, tuple(slots), lw.layer_name, offsets, tuple(forms), base_bias)


def traced_forward(lw: "LoraLinear", x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A compiled call: y + sum_i ((x A_i^T) * k_i * c_i [* row mask_i]) B_i^T + sum_f form_f(x) *
    k_f * c_f [* row mask_f] + sum_j diff_b_j * strength_j * c_j [* row mask_j], every factor an
    fp32 tensor read from the trace plan (in place updates never re-trace)."""
    tp = lw._trace_plan
    if tp is None or (tp.device is not None and tp.device != x.device):
        ctx = current_context()
        return lw._forward_general(x, y, ctx, *lw._call_selection(ctx))
    y0 = None
    if tp.needs_y0:  # x Wᵀ, read off the base output before anything is added to it
        y0 = y if tp.base_bias is None else y - tp.base_bias.to(y.dtype)
    for form, k, cell in tp.forms:
        if form.dtype != x.dtype:
            form = form.cast(x.dtype)
        o = form.out(x, y0)
        o = (o.float() * (k * cell.factor)).to(o.dtype)
        if cell.mask is not None:
            o = o * row_mask(cell.mask, o, tp.layer)
        y = y + o
    for a, b, k, cell in tp.slots:
        if a.dtype != x.dtype:
            a, b = a.to(x.dtype), b.to(x.dtype)
        h = F.linear(x, a)
        h = (h.float() * (k * cell.factor)).to(h.dtype)
        if cell.mask is not None:
            h = h * row_mask(cell.mask, h, tp.layer)
        y = y + F.linear(h, b)
    for off, k, cell in tp.offsets:
        o = (off * (k * cell.factor)).to(y.dtype)
        y = y + (o if cell.mask is None else o * row_mask(cell.mask, y, tp.layer))
    return y
