"""Merging into a host-quantized weight (a ``QuantizedTensor``) and putting it back.

A merge into a quantized layout happens as the host's own LoRA merge does it: dequantize,
add the delta in fp32, re-quantize with the layout's own settings. The stored weight is never
written: the merged weight is a new tensor in a new Parameter, and the restore puts the old
Parameter (its quantized bytes and scales) back.

Contract
- `can_requantize(w)`: '' when the layout can re-quantize a merged weight, else why not.
- `requantized(w, merged, seed)`: the merged fp32 weight on the layout's own grid: the layout's
  ``requantize_from_float`` with its scale recalculated (as the host's merge), and the host's
  stochastic-rounding seed for this weight when it gives one (0: round to nearest). Per-tensor fp8
  with a seed: the same bytes and params, drawn through `fp8_rounding` where its probe holds.
- `grid_round(w, exact, seed)`: the fp32 values that merge would leave (the rounding-loss
  measure reads them); takes every row, since a layout's scale may span the whole tensor.
- `QuantRestore`: what a merged layer keeps to restore: the Parameter it held before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import fp8_rounding
from .base_weight import dequantized, quant_layout, stored_tensors


def can_requantize(w) -> str:
    layout = quant_layout(w)
    if layout is None:
        return "weight is not host-quantized"
    if not callable(getattr(w, "requantize_from_float", None)):
        return f"weight is quantized ({layout}) and its layout cannot re-quantize a merged weight"
    return ""


def requantized(w: torch.Tensor, merged: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """`merged` (fp32, the weight's logical shape) re-quantized on `w`'s layout (see module doc)."""
    kwargs = {"scale": "recalculate"}
    merged = merged.to(torch.float32)
    out = None
    if seed:
        kwargs["stochastic_rounding"] = seed
        out = fp8_rounding.requantized(w, merged, seed)
    if out is None:
        out = w.requantize_from_float(merged, **kwargs)
    return out.to(w.dtype) if out.dtype != w.dtype else out


@torch.no_grad()
def grid_round(w: torch.Tensor, exact: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """What a merge of the fp32 weight `exact` into `w`'s layout leaves, back in fp32."""
    return dequantized(requantized(w, exact.reshape(w.shape), seed)).reshape(exact.shape)


def stored_bytes(w: torch.Tensor) -> int:
    """Bytes of a quantized tensor's stored data and scales."""
    return sum(t.numel() * t.element_size() for t in stored_tensors(w))


@dataclass
class QuantRestore:
    """A merged quantized layer's restore record: the Parameter it held before the merge."""
    param: nn.Parameter

    @property
    def nbytes(self) -> int:
        return stored_bytes(self.param)
