"""Trace forms: an update's output as a few tensor ops a compiled (traced) call can run.

Contract
- An update's ``trace_form(device, dtype)`` gives ``(form, scale)`` or None, built outside any
  trace (casts and dense caches happen there). ``form.out(x, y0) * scale`` equals the update's
  ``forward(x, 1.0, y0, include_bias=False)`` up to rounding (the strength and runtime factor
  are the caller's, applied as fp32 tensors).
- A form holds tensors only; ``out`` runs tensor ops on them (no caches, no Python state, no
  data-dependent branches). ``cast(dtype)`` gives the form with its matrices in `dtype`;
  ``dtype`` is the dtype they are in; ``needs_base_output``: ``out`` reads y0 = x Wᵀ.
- The shapes every type may use are here (`DenseForm`, `PairForm`, and the layer's `ConvForm`);
  a type with its own shape defines its form beside it (LoKr's Kronecker form, DoRA's per-row
  form, a sliced update's row blocks).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_CONV = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}


class TraceForm:
    """What a compiled call evaluates for one update (see the module contract)."""

    kind = ""
    needs_base_output = False

    def __init__(self, *tensors: Tensor):
        self.tensors = tensors

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype

    def cast(self, dtype: torch.dtype) -> "TraceForm":
        return type(self)(*(t.to(dtype) for t in self.tensors))

    def out(self, x: Tensor, y0: Tensor | None = None) -> Tensor:
        raise NotImplementedError


class DenseForm(TraceForm):
    """d [out, in]: x dᵀ."""

    kind = "dense"

    def out(self, x: Tensor, y0: Tensor | None = None) -> Tensor:
        return F.linear(x, self.tensors[0])


class PairForm(TraceForm):
    """a [k, in], b [out, k]: (x aᵀ) bᵀ."""

    kind = "pair"

    def out(self, x: Tensor, y0: Tensor | None = None) -> Tensor:
        a, b = self.tensors
        return F.linear(F.linear(x, a), b)


class ConvForm(TraceForm):
    """The layer's own convolution of x with a kernel delta, no bias (built by the layer, which
    knows the geometry)."""

    kind = "conv"

    def __init__(self, kernel: Tensor, stride, padding, dilation, groups):
        super().__init__(kernel)
        self.geometry = (stride, padding, dilation, groups)

    def cast(self, dtype: torch.dtype) -> "ConvForm":
        return ConvForm(self.tensors[0].to(dtype), *self.geometry)

    def out(self, x: Tensor, y0: Tensor | None = None) -> Tensor:
        k = self.tensors[0]
        return _CONV[k.dim()](x, k, None, *self.geometry)
