"""What one adapted call of a `LoraLinear` does, decided once and reused.

Contract
- `build(lw, ctx, device, dtype)`: a `CallPlan` for calls in context `ctx` with inputs on
  `device`/`dtype`, valid until the wrapper's slot state changes (the wrapper drops its plans
  then). Its ``run(x, y)`` adds this call's adapter output to the base output `y`, with the
  same ops in the same order as the general path (`LoraLinear._forward_general`), so every
  tier gives the same bits; ``run`` None: the call adds nothing.
- `build_trace_plan(lw)` (via `LoraLinear.prepare_trace`, after each state transition): what a
  compiled (traced) call reads: tensors only, the factors as fp32 0-d tensors (slot factor, and
  the adapter's `AdapterCell` for the runtime factor and row mask). `traced_forward` uses it, or
  the general path when there is none.
Design and numerics: docs/engine.md (call plans, torch.compile).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..scaling import apply_steps, combined_factor, factor_steps, folds_scales, times
from . import stacking
from .runtime_context import adapter_cell, current_context
from .stacking import can_add_inplace, row_mask

if TYPE_CHECKING:
    from .wrapper import LoraLinear


_COMPUTE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class CallPlan:
    __slots__ = ("ctx", "device", "dtype", "run")

    def __init__(self, ctx, device, dtype, run):
        self.ctx, self.device, self.dtype, self.run = ctx, device, dtype, run


def _stacked(a, bt, vec, alpha):
    """lossless/high, every live slot a stack() pair, no mask/offset: `stacking.addmm_stacked`'s
    ops (same bits), its Python inlined into one closure (this runs on every call)."""
    r, n = int(a.shape[0]), int(bt.shape[1])
    linear, grad_on = F.linear, torch.is_grad_enabled

    def run(x, y):
        h = linear(x, a)
        if vec is not None:
            h = times(h, vec, inplace=True)
        if not y.is_contiguous() or (y.requires_grad and grad_on()):
            return stacking.addmm_stacked(x, y, a, bt, vec, alpha)  # not in place: the general helper
        y.view(-1, n).addmm_(h.view(-1, r) if h.is_contiguous() else h.reshape(-1, r), bt, alpha=alpha)
        return y
    return run


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
    plain = (not offsets and not lw.is_conv and all(f[s.name][1] is None for s in dyn)
             and all(s.stackable and not s.update.needs_base_output for s in dyn))
    run = None
    if plain and folds_scales(ctx):
        f0 = f[dyn[0].name]
        if all(f[s.name] == f0 for s in dyn):  # uniform: the general path's add_stacked
            a, bt, factor, vec = stacking.stacked_pair(lw, device, dtype, dyn)
            if vec is None:
                run = _stacked(a, bt, None, combined_factor(factor, f0[0]))
            else:
                run = _stacked(a, bt, vec.to(dtype), f0[0])
    elif plain:
        pairs = []
        for s in dyn:
            a, b, scale = s.update.stack(device, dtype)
            pairs.append((a, b, factor_steps((scale, s.strength, f[s.name][0]), ctx)))
        run = _Exact(tuple(pairs))
    if run is None:
        run = _General(lw, ctx, dyn, offsets, f)
    return CallPlan(ctx, device, dtype, run)


# --- compiled calls --------------------------------------------------------------------------
class TracePlan:
    """Per live slot (A [r, in], B [out, r], slot factor fp32 0-d, AdapterCell), on `device`."""
    __slots__ = ("device", "slots", "layer")

    def __init__(self, device, slots, layer):
        self.device, self.slots, self.layer = device, slots, layer


def build_trace_plan(lw: "LoraLinear") -> TracePlan | None:
    """Built after a state transition (outside any trace). Enabled, unmerged slots count even at
    strength 0 (a factor of 0 then), so a strength change never changes what a trace reads. None
    (compiled calls take the general path, which reads the context and breaks the graph) when a
    live slot has no stack() pair or an output offset, or the layer is a convolution."""
    enabled = [s for s in lw.slots.values() if s.enabled]
    if any(s.update.diff_b is not None for s in enabled):  # merged or not, an offset is added per call
        return None
    live = [s for s in enabled if not s.merged]
    if not live:
        return TracePlan(None, (), lw.layer_name)
    if lw.is_conv or any(not s.stackable or s.update.needs_base_output for s in live):
        return None
    w = lw.weight
    if w is None or w.is_meta:
        return None
    device = w.device
    slots = []
    for s in live:
        # the weight's dtype when it is a compute dtype (the usual case: the eager path's copy is
        # shared), else (fp8/int weights cast per call) the adapter's own; a traced call casts to x's
        dtype = w.dtype if w.dtype in _COMPUTE else s.update.stack()[0].dtype
        a, b, scale = s.update.stack(device, dtype)
        k = torch.tensor(combined_factor(scale, s.strength), dtype=torch.float32, device=device)
        slots.append((a, b, k, adapter_cell(s.name, device)))
    return TracePlan(device, tuple(slots), lw.layer_name)


def traced_forward(lw: "LoraLinear", x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A compiled call: y + sum_i ((x A_i^T) * k_i * c_i [* row mask_i]) B_i^T, every factor
    an fp32 tensor read from the trace plan (in place updates never re-trace)."""
    tp = lw._trace_plan
    if tp is None or (tp.slots and tp.device != x.device):
        ctx = current_context()
        return lw._forward_general(x, y, ctx, *lw._call_selection(ctx))
    for a, b, k, cell in tp.slots:
        if a.dtype != x.dtype:
            a, b = a.to(x.dtype), b.to(x.dtype)
        h = F.linear(x, a)
        h = (h.float() * (k * cell.factor)).to(h.dtype)
        if cell.mask is not None:
            h = h * row_mask(cell.mask, h, tp.layer)
        y = y + F.linear(h, b)
    return y
