"""Folding an adapted layer's slots into its weight, and taking them out again bit for bit.

Contract
- `merge(layer, only)`: the delta of the contributing slots (those named in `only`, default
  all) added into the weight with one rounding (scale and strength one after the other under
  the layer's ``merge_tier`` exact, as one product under lossless/high); the other slots stay
  dynamic. A quantized weight is re-quantized into a new Parameter (the old one is the record).
- `unmerge(layer, remember)`: the weight restored bit for bit (fingerprint-checked), the delta
  recomputed as its merge did; `remember` keeps the verified fingerprint (and a full copy) for
  the next merge of the same untouched weight.
- `delta_rows(layer, w, rows, slots, fold)`: fp32 weight delta of `slots` for `rows` (a new
  tensor every call); a weight-dependent delta (DoRA) is the one frozen at merge time while merged.
- `mergeable(layer)`: (True, '') when a merge may write into the layer's weight, else (False, why).
`MergeState` is what a layer keeps between the two (``layer.merge_state``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import MergeRefusedError, NonFiniteMergeError
from ..scaling import times
from . import quantized_merge
from .base_weight import (base_weight, float_weight_reason, own_storage, quant_layout, staged_reason,
                          weight_identity, wrapped)
from .merge import RestoreRecord, merge_weight, restore_weight


@dataclass
class MergeState:
    restore: "RestoreRecord | quantized_merge.QuantRestore | None" = None
    names: tuple[str, ...] = ()   # the merged slots
    folded: bool = False          # whether the merge folded scale x strength (its restore does too)
    verified: tuple | None = None  # (fingerprint, weight identity[, full copy]) right after a restore


def mergeable(layer: nn.Module) -> tuple[bool, str]:
    """Can a merge write into this layer's weight? Judged on the wrapped layer."""
    refusal = getattr(layer, "merge_refusal", "")
    if refusal:
        return False, refusal
    base = wrapped(layer)
    w = getattr(base, "weight", None)
    if w is None:
        return False, "layer has no weight"
    staged = staged_reason(base)
    if staged:
        return False, staged
    if quant_layout(w) is not None:  # merged as the host merges: re-quantized on the layout's grid
        if getattr(base, "weight_function", None):
            return False, "weight has weight-function patches"
        why = quantized_merge.can_requantize(w)
        return not why, why
    why = float_weight_reason(base)  # a GGUF F16/BF16/F32 weight is a plain float weight; quantized ones are not
    return not why, why


def merge(layer, only: set[str] | None = None) -> None:
    ok, why = mergeable(layer)
    if not ok:
        raise MergeRefusedError(f"{layer.layer_name}: cannot merge ({why}); use merge mode 'dynamic'")
    st = layer.merge_state
    if st.restore is not None:
        return
    slots = [s for s in layer.weight_slots() if only is None or s.name in only]
    if not slots:
        return
    if layer.quantized:
        _merge_quantized(layer, slots)
        return
    bw = base_weight(layer.get_base_layer())
    if not bw.writable:  # mergeable() judged it; a copy must never take a merge
        raise MergeRefusedError(f"{layer.layer_name}: cannot merge ({bw.reason}); use merge mode 'dynamic'")
    own_storage(layer.get_base_layer().weight)  # a GGUF file's read-only map is never written
    w = layer.weight2d
    _freeze_weight_deltas(slots, w)
    known, st.verified = st.verified, None
    if known is None or known[1] != weight_identity(w):
        known = None
    known_fp = known[0] if known is not None else None
    backup = known[2] if known is not None and len(known) > 2 and layer.restore_copy else None
    try:
        fold = layer.merge_folds
        st.restore = merge_weight(w, _chunk_deltas(w, slots, fold), what=layer.layer_name,
                                  known_fingerprint=known_fp, keep_copy=layer.restore_copy, backup=backup,
                                  scratch_deltas=True)
    except BaseException:
        for s in slots:
            s.frozen_delta = None
        raise
    _merged(layer, slots, fold)


@torch.no_grad()
def _merge_quantized(layer, slots) -> None:
    """Merge into a quantized weight: the merged weight re-quantized into a new Parameter; the
    old Parameter (bytes and scales untouched) is the restore record."""
    base = layer.get_base_layer()
    old = base.weight
    w = layer.weight2d                     # fp32 dequantized copy
    _freeze_weight_deltas(slots, w)
    try:
        fold = layer.merge_folds
        exact = w.add_(delta_rows(w, slice(None), slots, fold))
        # one summing pass says "finite" for nearly every weight; the element-wise check runs only
        # when the sum is not finite (an inf/NaN, or finite values whose sum overflows)
        if not math.isfinite(float(exact.sum())) and not bool(torch.isfinite(exact).all()):
            raise NonFiniteMergeError(f"{layer.layer_name}: the merged weight is not finite (inf/NaN); nothing "
                                      "was written. Lower the adapter's strength")
        new = quantized_merge.requantized(old, exact.reshape(old.shape), layer.requant_seed)
    except BaseException:
        for s in slots:
            s.frozen_delta = None
        raise
    base.weight = nn.Parameter(new, requires_grad=False)
    layer.merge_state.restore = quantized_merge.QuantRestore(old)
    _merged(layer, slots, fold)


def _merged(layer, slots, fold: bool) -> None:
    """The weight holds `slots` now (the record set); the restore recomputes the delta as the merge did."""
    st = layer.merge_state
    st.folded = fold
    for s in slots:
        s.merged = True
    st.names = tuple(s.name for s in slots)
    layer.weight_changed()


def unmerge(layer, remember: bool = False) -> None:
    st = layer.merge_state
    if st.restore is None:
        return
    slots = [layer.slots[n] for n in st.names]
    if isinstance(st.restore, quantized_merge.QuantRestore):
        layer.get_base_layer().weight = st.restore.param  # the very Parameter it held: same bytes
        _unmerged(layer, slots)
        return
    w = layer.weight2d
    record = st.restore
    fp = restore_weight(w, record, _chunk_deltas(w, slots, st.folded), what=layer.layer_name)
    _unmerged(layer, slots)
    if remember:
        st.verified = (fp, weight_identity(w)) if record.full is None else (fp, weight_identity(w), record.full)


def _unmerged(layer, slots) -> None:
    """The weight is back: the slots are dynamic again, no record, no verified fingerprint."""
    for s in slots:
        s.merged = False
        s.frozen_delta = None
    st = layer.merge_state
    st.restore = None
    st.names = ()
    layer.weight_changed()
    st.verified = None


def _freeze_weight_deltas(slots, w: torch.Tensor) -> None:
    """A DoRA delta depends on the weight: taken from the weight before the merge writes."""
    for s in slots:
        if s.update.needs_weight:
            s.frozen_delta = times(s.update.delta(w.device, torch.float32, weight=w), s.strength, inplace=True)


def _chunk_deltas(w: torch.Tensor, slots, fold: bool):
    """`delta_rows` for merge / restore row chunks, with the weight read once (no per-chunk
    attribute walk; the caller holds no_grad)."""
    return lambda rows: delta_rows(w, rows, slots, fold)


def delta_rows(w: torch.Tensor, rows, slots, fold: bool) -> torch.Tensor:
    """A new tensor on every call (the merge writes into it): the updates' deltas are new
    tensors (`Update.delta`), a frozen delta is cloned. `fold`: each slot's scale and strength
    applied as one product (`Update.folded_delta`); else one after the other, the `exact` order."""
    out = None
    for s in slots:
        if s.frozen_delta is not None:
            d = s.frozen_delta[rows]
            out = d.clone() if out is None else out.add_(d)  # never write into the frozen delta
            continue
        weight = w if s.update.needs_weight else None
        if fold:
            d = s.update.folded_delta(w.device, s.strength, rows, weight=weight)
        else:
            d = times(s.update.delta(w.device, torch.float32, rows, weight=weight), s.strength, inplace=True)
        out = d if out is None else out.add_(d)
    if out is None:
        out = torch.zeros((w[rows].shape[0], w.shape[1]), dtype=torch.float32, device=w.device)
    return out
