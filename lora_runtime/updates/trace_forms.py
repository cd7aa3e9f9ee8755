"""Trace forms: an update's output as a few tensor ops a compiled (traced) call can run.

Contract
- An update's ``trace_form(device, dtype)`` gives ``(kind, tensors, scale)`` or None, built
  outside any trace (casts and dense caches happen there). ``form_out(kind, tensors, x, y0)
  * scale`` equals the update's ``forward(x, 1.0, y0, include_bias=False)`` up to rounding
  (the strength and runtime factor are the caller's, applied as fp32 tensors).
- Kinds: ``dense`` (d [out, in]): x dᵀ. ``pair`` (a [k, in], b [out, k]): (x aᵀ) bᵀ.
  ``kron`` (w1 [p, q], w2 [c, d]): x through kron(w1, w2) without forming it; ``kron2``
  (w1, w2a [c, r], w2b [r, d]): the same with w2 = w2a w2b kept factorised. ``dora``
  (g [out], inner kind, inner tensors, inner scale as an fp32 0-d tensor): the per-row DoRA
  output (g - 1) * y0 + g * inner(x), y0 = x Wᵀ (the base output without bias). ``conv``
  (kernel delta, stride, padding, dilation, groups): the layer's own convolution of x with the
  kernel delta, no bias (built by the layer, which knows the geometry). ``sliced`` (parts
  ((lo, hi, kind, tensors, scale as an fp32 0-d tensor), ...), out): each part's form times its
  scale in its column block of the output, zeros between.
- Only tensor ops on the arguments: no caches, no Python state, no data-dependent branches.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

KINDS = ("dense", "pair", "kron", "kron2", "dora", "conv", "sliced")
_CONV = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}


def cast_form(kind: str, tensors: tuple, dtype: torch.dtype) -> tuple:
    """`tensors` with every matrix in `dtype` (a dora form's fp32 inner scale stays fp32, a conv
    form's geometry is not a tensor)."""
    if kind == "dora":
        g, ik, it, iscale = tensors
        return g.to(dtype), ik, cast_form(ik, it, dtype), iscale
    if kind == "sliced":
        parts, out = tensors
        return tuple((lo, hi, k, cast_form(k, t, dtype), sc) for lo, hi, k, t, sc in parts), out
    return tuple(t.to(dtype) if isinstance(t, Tensor) else t for t in tensors)


def form_dtype(kind: str, tensors: tuple) -> torch.dtype:
    """The dtype the form's matrices are in."""
    if kind == "sliced":
        _, _, k, t, _ = tensors[0][0]
        return form_dtype(k, t)
    return tensors[0].dtype


def needs_base_output(kind: str) -> bool:
    return kind == "dora"


def form_out(kind: str, t: tuple, x: Tensor, y0: Tensor | None = None) -> Tensor:
    """The form's output for x [..., in] (see the module contract), in x's dtype."""
    if kind == "dense":
        return F.linear(x, t[0])
    if kind == "pair":
        return F.linear(F.linear(x, t[0]), t[1])
    if kind in ("kron", "kron2"):
        w1 = t[0]
        q = w1.shape[1]
        lead = x.shape[:-1]
        u = torch.matmul(w1, x.reshape(*lead, q, x.shape[-1] // q))   # [..., p, d]: mix over w1 first
        y = F.linear(u, t[1]) if kind == "kron" else F.linear(F.linear(u, t[2]), t[1])
        return y.reshape(*lead, -1)
    if kind == "dora":
        g, ik, it, iscale = t
        inner = form_out(ik, it, x)
        inner = (inner.float() * iscale).to(inner.dtype)
        return (g - 1) * y0 + g * inner
    if kind == "sliced":
        parts, out = t
        lead, pieces, at = x.shape[:-1], [], 0
        for lo, hi, k, pt, sc in parts:
            if lo > at:
                pieces.append(x.new_zeros(*lead, lo - at))
            o = form_out(k, pt, x)
            pieces.append((o.float() * sc).to(o.dtype))
            at = hi
        if at < out:
            pieces.append(x.new_zeros(*lead, out - at))
        return torch.cat(pieces, -1)
    if kind == "conv":
        k, stride, padding, dilation, groups = t
        return _CONV[k.dim()](x, k, None, stride, padding, dilation, groups)
    raise ValueError(f"unknown trace form {kind!r}")
