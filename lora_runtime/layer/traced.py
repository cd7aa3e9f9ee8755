"""What a compiled (traced) call of an adapted layer reads: tensors only, never the context.

Contract
- `build(layer)` (via `AdaptedLayer.prepare_trace`, after each state transition, never inside a
  trace): a `TracedFactors` for the current slot state: the factors as fp32 0-d tensors (slot
  factor, and the adapter's `AdapterCell` for the runtime factor and row mask). stack() pairs
  ride as pairs; every other update as its trace form (`updates.trace_forms`: LoKr, LoHa, full
  deltas, DoRA, sliced updates of those); convolutions as their kernel delta (a `conv` form).
  None when some live slot has neither.
- `traced_forward(layer, x, y)`: the call's output from them, or the general path
  (`general_path`) when there are none (a DoRA whose base output the host patches per call).
`layer` is an adapted layer (`wrapper.AdaptedLayer`); only its public members are read.
Design and numerics: docs/engine.md (torch.compile).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..scaling import combined_factor, per_rank
from ..updates.trace_forms import ConvForm
from .base_weight import real_shape
from .general_path import forward_general, select
from .runtime_context import adapter_cell, current_context
from .stacking import row_mask

_COMPUTE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class TracedFactors:
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


def build(lw) -> TracedFactors | None:
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
        return TracedFactors(None, (), lw.layer_name)
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
    return TracedFactors(device, tuple(slots), lw.layer_name, offsets, tuple(forms), base_bias)


def traced_forward(lw, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A compiled call: y + sum_i ((x A_i^T) * k_i * c_i [* row mask_i]) B_i^T + sum_f form_f(x) *
    k_f * c_f [* row mask_f] + sum_j diff_b_j * strength_j * c_j [* row mask_j], every factor an
    fp32 tensor read from `lw.traced_factors` (in place updates never re-trace); without them (or on
    another device) the general path, which reads the context (a graph break)."""
    tp = lw.traced_factors
    if tp is None or (tp.device is not None and tp.device != x.device):
        ctx = current_context()
        return forward_general(lw, x, y, ctx, select(lw, ctx))
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
