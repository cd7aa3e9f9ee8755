"""LoRA-aware linear at cuBLAS speed: backends "kconcat_cached", "kconcat_rebuilt" and
"delta_first" of `lora_linear` (reference: lora_linear.lora_linear_torch).

Every path starts from the small h = (x A^T) * scale [M, R]: the per-rank scale (strength,
schedule factor) or per-row-and-rank scale (a CFG branch's row mask too) is applied there,
on R columns, so a new strength or branch never touches a weight-sized tensor. A float scale of exactly 1.0 is not multiplied; a per-rank scale is
multiplied in fp32 and h rounded once to x.dtype.

- K-concatenation: y = [x | h] [W | B]^T + b in ONE GEMM over K + R, the adapter's
  products summed into the base GEMM's fp32 accumulator; with gelu, bias and GELU(tanh)
  in cuBLASLt's epilogue where `linear_gelu_cublaslt.epilogue_check` passed for this device
  and dtype (else one in-place GELU after). [W | B] is N x (K + R): "kconcat_cached" keeps it
  in the caller's `state` dict (rebuilt only when W or B change: a copy of the weight in
  memory, `cached_bytes(state)`), "kconcat_rebuilt" builds it on every call.
- Delta first: d = b + h B^T, then the base GEMM accumulates into it in place,
  d.addmm_(x, W^T) (beta = 1): the delta is rounded once at its own small size and the
  sum once at the end; GELU in place after.
Both round the output once where the eager chain rounds the base output, the delta and
their sum; their error against an fp64 truth is within the `lossless` rule (tests).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import registry
from .linear_gelu_cublaslt import epilogue_check
from .registry import FLOATS, Backend

__all__ = ["lora_linear_kconcat", "lora_linear_delta_first", "cached_bytes"]

OP = "lora_linear"


def scaled_h(x2: torch.Tensor, lora_a: torch.Tensor, scale) -> torch.Tensor:
    """h = (x2 A^T) * scale in x2.dtype, [M, R]."""
    h = F.linear(x2, lora_a if lora_a.dtype == x2.dtype else lora_a.to(x2.dtype))
    if isinstance(scale, torch.Tensor):
        return (h * scale).to(x2.dtype) if x2.dtype != torch.float32 else h.mul_(scale)
    return h if scale == 1.0 else h.mul_(scale)


def _gelu_(t: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_(t, approximate="tanh")


def _wb(weight, lora_b, state: dict | None, keep: bool) -> torch.Tensor:
    """[W | B] as an [N, K + R] tensor in W's dtype: from `state` when W and B are the
    tensors (and versions) it was built from, else built now (and kept when `keep`)."""
    key = (weight.data_ptr(), weight._version, tuple(weight.shape), lora_b.data_ptr(), lora_b._version,
           tuple(lora_b.shape), lora_b.dtype, weight.dtype, weight.device)
    if state is not None and keep:
        hit = state.get("wb")
        if hit is not None and hit[0] == key:
            return hit[1]
    wb = torch.cat([weight, lora_b.to(weight.dtype)], 1)
    if state is not None and keep:
        state["wb"] = (key, wb)
    return wb


def cached_bytes(state: dict | None) -> int:
    """Bytes the K-concat cache holds in `state`."""
    hit = (state or {}).get("wb")
    return 0 if hit is None else hit[1].numel() * hit[1].element_size()


def lora_linear_kconcat(x, weight, bias, lora_a, lora_b, scale, gelu=False, state=None, *, keep=True):
    lead, K = x.shape[:-1], x.shape[-1]
    N, R = weight.shape[0], lora_a.shape[0]
    x2 = x.reshape(-1, K)
    if R == 0:
        xp, wb = x2, weight
    else:
        xp = torch.cat([x2, scaled_h(x2, lora_a, scale)], 1)
        wb = _wb(weight, lora_b, state, keep)
    if gelu and bias is not None and x.is_cuda and not epilogue_check(x.device, x.dtype):
        y = torch._addmm_activation(bias, xp, wb.t(), use_gelu=True)
    else:
        y = F.linear(xp, wb, bias)
        if gelu:
            y = _gelu_(y)
    return y.reshape(*lead, N)


def _kconcat_rebuilt(x, weight, bias, lora_a, lora_b, scale, gelu=False, state=None):
    return lora_linear_kconcat(x, weight, bias, lora_a, lora_b, scale, gelu, state, keep=False)


def lora_linear_delta_first(x, weight, bias, lora_a, lora_b, scale, gelu=False, state=None):
    lead, K = x.shape[:-1], x.shape[-1]
    N, R = weight.shape[0], lora_a.shape[0]
    x2 = x.reshape(-1, K)
    if R == 0:
        d = F.linear(x2, weight, bias)
    else:
        h = scaled_h(x2, lora_a, scale)
        bt = (lora_b if lora_b.dtype == x.dtype else lora_b.to(x.dtype)).t()
        d = torch.addmm(bias, h, bt) if bias is not None else torch.mm(h, bt)
        d.addmm_(x2, weight.t())
    if gelu:
        d = _gelu_(d)
    return d.reshape(*lead, N)


_CAPS = frozenset({"bias", "gelu", "per_rank_scale", "row_scale"})
_DEV = frozenset({"cuda", "cpu"})
registry.register(Backend(OP, "delta_first", lora_linear_delta_first, frozenset(FLOATS), _DEV, _CAPS, 30,
                          description="delta first (b + h B^T), then the base GEMM accumulating into it"))
registry.register(Backend(OP, "kconcat_cached", lora_linear_kconcat, frozenset(FLOATS), _DEV,
                          _CAPS | {"cache"}, 26,
                          description="[x | h] [W | B]^T in one GEMM, [W | B] kept per site",
                          cache_key="wb", cache_bytes=cached_bytes))
registry.register(Backend(OP, "kconcat_rebuilt", _kconcat_rebuilt, frozenset(FLOATS), _DEV, _CAPS, 24,
                          description="[x | h] [W | B]^T in one GEMM, [W | B] built per call"))
