"""Fused linear + GELU(tanh): y = gelu_tanh(x @ W^T + b), one rounding.

The GEMM accumulates in fp32; the bias add and the GELU run on the fp32
accumulator and the result is rounded to x.dtype once, at the store. The eager
chain (`linear_gelu_tanh_eager`) rounds twice in fp16/bf16: after the linear
and after the GELU. That makes the fused kernel at least as close to an fp64
ground truth as eager, which is what the `lossless` tier asks.

- `linear_gelu_tanh`        the op; backend "auto" or a registered name (kernels.registry):
                            "triton" (this file), "cublaslt" (linear_gelu_cublaslt), "torch"
- `linear_gelu_tanh_torch`  the reference: the same fp32 math through torch
- `linear_gelu_tanh_eager`  the unfused chain in the input dtype (benchmarks)
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from . import registry
from .registry import FLOATS, Backend, interpreting, triton_importable

logger = logging.getLogger(__name__)

__all__ = ["linear_gelu_tanh", "linear_gelu_tanh_torch", "linear_gelu_tanh_eager"]

OP = "linear_gelu_tanh"


def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     *, backend: str = "auto") -> torch.Tensor:
    """gelu_tanh(x @ weight^T + bias). x: [..., K], weight: [N, K], bias: [N] or None."""
    registry.validate(OP, x, weight, bias)
    return registry.resolve(OP, backend, x, weight, bias).fn(x, weight, bias)


def linear_gelu_tanh_torch(x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: the fused kernel's math in fp32 via torch, cast once to x.dtype."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return F.gelu(y, approximate="tanh").to(x.dtype)


def linear_gelu_tanh_eager(x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The unfused eager chain in the input dtype (what a model does without us)."""
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


if triton_importable():
    import triton
    import triton.language as tl

    from ._triton_utils import (INTERPRET_META, bias_gelu_store, gemm_tile, grouped_tile, launch_tiles,
                                main_precision, out_buffer)

    @triton.jit
    def _linear_gelu_tanh_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr,
        M, N, K,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
        HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = gemm_tile(x_ptr, w_ptr, offs_m, offs_n, M, N, K,
                        stride_xm, stride_xk, stride_wn, stride_wk,
                        UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        bias_gelu_store(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on,
                        HAS_BIAS, True)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lead, K = x.shape[:-1], x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)  # a view when it can be; strides go to the kernel
    M = x2.shape[0]
    interp = interpreting()
    out = out_buffer(M, N, x.dtype, x.device, interp)
    if M == 0 or N == 0:
        return out.to(x.dtype).reshape(*lead, N)
    b = bias if bias is not None else out  # any pointer; never read when HAS_BIAS is False
    args = (x2, weight, b, out, M, N, K,
            x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
            out.stride(0), out.stride(1))
    flags = dict(HAS_BIAS=bias is not None, UPCAST=interp,
                 PRECISION="ieee" if interp else main_precision(x.dtype))
    launch_tiles(_linear_gelu_tanh_kernel, "linear_gelu_tanh", M, N, K, args, flags,
                 INTERPRET_META if interp else None)
    return out.to(x.dtype).reshape(*lead, N)


registry.register(Backend(OP, "triton", _launch, frozenset(FLOATS), frozenset({"cuda", "cpu"}),
                          frozenset({"bias", "gelu", "fp32_epilogue"}), 20, registry.triton_available,
                          "Triton GEMM with bias + GELU(tanh) on the fp32 accumulator"))
registry.register(Backend(OP, "torch", linear_gelu_tanh_torch, frozenset(FLOATS), frozenset({"cuda", "cpu"}),
                          frozenset({"bias", "gelu", "fp32_epilogue"}), 0,
                          description="the fp32 torch reference"))
