"""LoRA-aware fused linear: y = act(x W^T + b + ((x A^T) * scale) B^T), one rounding.

lora_a [R, K] holds the down matrices of one or several adapters stacked along
ranks, lora_b [N, R] the matching up matrices; scale is one float for the whole
delta or an fp32 [R] vector of per-rank factors (each adapter's factor repeated
over its ranks), so several adapters with their own strengths share one pair of
GEMMs. act is GELU(tanh) when gelu=True.

How the delta gets into the fused GEMM ("expand in the epilogue"):
1. shrink: a small kernel computes h = (x A^T) * scale into an fp32 [M, R]
   buffer (fp32 accumulation; the scale is applied once, on the fp32 h; a float
   scale of exactly 1.0 is skipped, a per-rank tensor is always applied, where a
   1.0 entry changes no bit).
2. main: each program runs its K loop over W into an fp32 accumulator, then a
   second, short loop over R adds h_tile @ B_tile^T to the same accumulator,
   then the bias and GELU epilogue, then the one rounding to x.dtype.
Why not K-concatenation ([x | h] @ [W | B]^T): it needs a copy of x with h
appended and a copy of W with B appended (or a kernel reading two sources per
K step), and h would have to be rounded to x.dtype to share the MMA with x;
keeping h in fp32 is what makes the result `lossless`.

h stays fp32, so its product with B cannot use a bf16 MMA directly. On GPUs:
- bf16: h is split into three bf16 parts, hi = bf16(h), mid = bf16(h - hi),
  lo = bf16(h - hi - mid), whose sum is h exactly (3 x 8 significant bits), and
  all three go through the native bf16 MMA with B. B is exactly bf16, so every
  product is exact in the fp32 accumulator: the same as an fp32 h @ B^T, for 3
  bf16 MMAs per rank tile (about 3R/K of the main loop's MMA work). A 2-part split
  (16 bits of h) was tried first and failed the tests' 1-ulp check where the
  output cancels to ~1e-5 (pre-activation off by ~4e-6 at K=41, R=21).
- fp16: the h and B tiles go through an fp32 dot with input_precision="tf32x3"
  (no hi/lo split: an fp16 hi could overflow where fp32 h does not).
- fp32: everything "ieee", as F.linear with TF32 off.
Under the interpreter every dot runs in fp32 (see _triton_utils), the bf16 split
included, so the CPU tests exercise the split arithmetic.

- `lora_linear`        the op; backend "auto" or a registered name (kernels.registry): "triton"
                       (this file), "kconcat_cached" / "kconcat_rebuilt" / "delta_first"
                       (lora_linear_cublas), "torch"
- `lora_linear_torch`  the reference: the same fp32 math through torch
- `lora_linear_eager`  the unfused PEFT-shaped chain in the input dtype (benchmarks,
                       and the low-precision error the tests hold the kernel to)
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from . import registry
from .registry import FLOATS, Backend, interpreting, triton_importable

logger = logging.getLogger(__name__)

__all__ = ["lora_linear", "lora_linear_torch", "lora_linear_eager"]

Scale = float | torch.Tensor
OP = "lora_linear"
#: the capability of taking an [M, R] scale (a CFG row mask times per-adapter factors)
ROW_SCALE = frozenset({"row_scale"})


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                lora_a: torch.Tensor, lora_b: torch.Tensor, scale: Scale,
                *, gelu: bool = False, backend: str = "auto", state: dict | None = None) -> torch.Tensor:
    """act(x W^T + b + ((x A^T) * scale) B^T).

    x [..., K], weight [N, K], bias [N] or None, lora_a [R, K], lora_b [N, R]
    (R may be 0: no adapter), scale a float, an fp32 [R] tensor of per-rank factors, or
    an fp32 [M, R] tensor of per-row-and-rank factors (M rows of x flattened; backends
    with the "row_scale" capability).
    `state`: a caller-owned dict a backend may keep derived tensors in (the cached
    [W | B] of "kconcat_cached"); None keeps nothing.
    """
    scale = registry.validate(OP, x, weight, bias, lora_a, lora_b, scale)
    needs = ROW_SCALE if isinstance(scale, torch.Tensor) and scale.dim() == 2 else frozenset()
    be = registry.resolve(OP, backend, x, weight, bias, lora_a, lora_b, needs=needs)
    return be.fn(x, weight, bias, lora_a, lora_b, scale, gelu=gelu, state=state)


def lora_linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      lora_a: torch.Tensor, lora_b: torch.Tensor, scale: Scale,
                      *, gelu: bool = False) -> torch.Tensor:
    """Reference: the fused kernel's math in fp32 via torch, cast once to x.dtype."""
    xf = x.float()
    y = F.linear(xf, weight.float(), None if bias is None else bias.float())
    if lora_a.shape[0] > 0:
        h = F.linear(xf, lora_a.float())
        if isinstance(scale, torch.Tensor):
            h = h * (scale.float() if scale.dim() == 1 else scale.float().reshape(h.shape))
        elif scale != 1.0:  # a unit factor is never multiplied
            h = h * scale
        y = y + F.linear(h, lora_b.float())
    if gelu:
        y = F.gelu(y, approximate="tanh")
    return y.to(x.dtype)


def lora_linear_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      lora_a: torch.Tensor, lora_b: torch.Tensor, scale: Scale,
                      *, gelu: bool = False) -> torch.Tensor:
    """The unfused chain in x.dtype, shaped like PEFT: base + B(A x) * scale.

    A per-rank scale has to sit between the two GEMMs: B((A x) * s).
    """
    y = F.linear(x, weight, bias)
    if lora_a.shape[0] > 0:
        h = F.linear(x, lora_a.to(x.dtype))
        if isinstance(scale, torch.Tensor):
            s = scale.to(x.dtype)
            y = y + F.linear(h * (s if s.dim() == 1 else s.reshape(h.shape)), lora_b.to(x.dtype))
        elif scale != 1.0:
            y = y + F.linear(h, lora_b.to(x.dtype)) * scale
        else:
            y = y + F.linear(h, lora_b.to(x.dtype))
    return F.gelu(y, approximate="tanh") if gelu else y


if triton_importable():
    import triton
    import triton.language as tl

    from ._triton_utils import (INTERPRET_META, INTERPRET_RANK_BLOCK, bias_gelu_store, gemm_tile,
                                grouped_tile, launch_tiles, main_precision, out_buffer)

    @triton.jit
    def _lora_shrink_kernel(
        x_ptr, a_ptr, s_ptr, h_ptr, scale,
        M, R, K,
        stride_xm, stride_xk, stride_ar, stride_ak, stride_hm, stride_hr,
        SCALE_MODE: tl.constexpr,  # 0: none (1.0), 1: one float, 2: per-rank vector
        UPCAST: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # h[M, R] = (x @ A^T) * scale, fp32 out.
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        h = gemm_tile(x_ptr, a_ptr, offs_m, offs_r, M, R, K,
                      stride_xm, stride_xk, stride_ar, stride_ak,
                      UPCAST, PRECISION, BLOCK_M, BLOCK_R, BLOCK_K)
        if SCALE_MODE == 1:
            h = h * scale
        elif SCALE_MODE == 2:
            h = h * tl.load(s_ptr + offs_r, mask=offs_r < R, other=0.0)[None, :]
        h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_r[None, :] * stride_hr
        tl.store(h_ptrs, h, mask=(offs_m[:, None] < M) & (offs_r[None, :] < R))

    @triton.jit
    def _lora_linear_kernel(
        x_ptr, w_ptr, b_ptr, h_ptr, lb_ptr, out_ptr,
        M, N, K, R,
        stride_xm, stride_xk, stride_wn, stride_wk,
        stride_hm, stride_hr, stride_bn, stride_br, stride_om, stride_on,
        HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, APPLY_GELU: tl.constexpr,
        UPCAST: tl.constexpr, PRECISION: tl.constexpr,
        SPLIT_BF16: tl.constexpr, LORA_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = gemm_tile(x_ptr, w_ptr, offs_m, offs_n, M, N, K,
                        stride_xm, stride_xk, stride_wn, stride_wk,
                        UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        if HAS_LORA:
            # The expand: acc += h[offs_m, :] @ B[offs_n, :]^T, still in fp32.
            offs_r = tl.arange(0, BLOCK_R)
            h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_r[None, :] * stride_hr
            b_ptrs = lb_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_r[:, None] * stride_br
            row_ok = offs_m[:, None] < M
            col_ok = offs_n[None, :] < N
            for rb in range(0, tl.cdiv(R, BLOCK_R)):
                r_left = R - rb * BLOCK_R
                ht = tl.load(h_ptrs, mask=row_ok & (offs_r[None, :] < r_left), other=0.0)
                bt = tl.load(b_ptrs, mask=(offs_r[:, None] < r_left) & col_ok, other=0.0)
                if SPLIT_BF16:
                    # h == hi + mid + lo exactly (3 x 8 bits = fp32's 24), and each
                    # part times a bf16 B is exact in the fp32 MMA accumulator.
                    hi = ht.to(tl.bfloat16)
                    rest = ht - hi.to(tl.float32)
                    mid = rest.to(tl.bfloat16)
                    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
                    if UPCAST:
                        btf = bt.to(tl.float32)
                        acc = tl.dot(hi.to(tl.float32), btf, acc, input_precision="ieee")
                        acc = tl.dot(mid.to(tl.float32), btf, acc, input_precision="ieee")
                        acc = tl.dot(lo.to(tl.float32), btf, acc, input_precision="ieee")
                    else:
                        acc = tl.dot(hi, bt, acc)
                        acc = tl.dot(mid, bt, acc)
                        acc = tl.dot(lo, bt, acc)
                else:
                    acc = tl.dot(ht, bt.to(tl.float32), acc, input_precision=LORA_PRECISION)
                h_ptrs += BLOCK_R * stride_hr
                b_ptrs += BLOCK_R * stride_br
        bias_gelu_store(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on,
                        HAS_BIAS, APPLY_GELU)

    # BLOCK_R = 32: ranks are 16..128 in practice, so 1-4 trips of the expand loop.
    RANK_BLOCK = 32


def _launch(x, weight, bias, lora_a, lora_b, scale, gelu, state=None) -> torch.Tensor:
    lead, K = x.shape[:-1], x.shape[-1]
    N, R = weight.shape[0], lora_a.shape[0]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    interp = interpreting()
    out = out_buffer(M, N, x.dtype, x.device, interp)
    if M == 0 or N == 0:
        return out.to(x.dtype).reshape(*lead, N)

    has_lora = R > 0
    if has_lora:
        h = _shrink(x2, lora_a, scale, interp)
        if lora_b.dtype != x.dtype:
            lora_b = lora_b.float()  # the expand reads B as fp32 or as x.dtype
    else:
        h = lora_b = out  # never read when HAS_LORA is False
    split = has_lora and x.dtype == torch.bfloat16 and lora_b.dtype == torch.bfloat16
    if interp or x.dtype == torch.float32:
        lora_precision = "ieee"
    else:
        lora_precision = "tf32x3"  # fp16 x / fp32 B on a GPU: near-fp32 on tensor cores

    b = bias if bias is not None else out
    args = (x2, weight, b, h, lora_b, out, M, N, K, R,
            x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
            h.stride(0), h.stride(1), lora_b.stride(0), lora_b.stride(1),
            out.stride(0), out.stride(1))
    flags = dict(HAS_BIAS=bias is not None, HAS_LORA=has_lora, APPLY_GELU=bool(gelu),
                 UPCAST=interp, PRECISION="ieee" if interp else main_precision(x.dtype),
                 SPLIT_BF16=split, LORA_PRECISION=lora_precision)
    op = "lora_linear" + ("_gelu" if gelu else "") + ("" if has_lora else "_r0")
    launch_tiles(_lora_linear_kernel, op, M, N, K, args, flags, INTERPRET_META if interp else None,
                 dict(BLOCK_R=INTERPRET_RANK_BLOCK if interp else RANK_BLOCK))
    return out.to(x.dtype).reshape(*lead, N)


def _shrink(x2: torch.Tensor, lora_a: torch.Tensor, scale: Scale, interp: bool) -> torch.Tensor:
    """h = (x2 @ lora_a^T) * scale as an fp32 [M, R] tensor."""
    M, K = x2.shape
    R = lora_a.shape[0]
    if lora_a.dtype != x2.dtype and lora_a.dtype != torch.float32:
        lora_a = lora_a.float()
    upcast = interp or lora_a.dtype != x2.dtype  # mixed dtypes meet in fp32
    fp32_dot = upcast or x2.dtype == torch.float32
    h = torch.empty((M, R), dtype=torch.float32, device=x2.device)
    if isinstance(scale, torch.Tensor):
        mode, s_ptr, s_val = 2, scale, 1.0
    elif scale == 1.0:
        mode, s_ptr, s_val = 0, h, 1.0
    else:
        mode, s_ptr, s_val = 1, h, scale
    if interp:
        bm, br, bk, warps = INTERPRET_META["BLOCK_M"], INTERPRET_RANK_BLOCK, INTERPRET_META["BLOCK_K"], 4
    else:
        # A fixed, untuned choice: the shrink is R/N of the main GEMM's work.
        bm, bk, warps = 64, 64, 4
        br = min(64, max(16, triton.next_power_of_2(R)))
    grid = (triton.cdiv(M, bm), triton.cdiv(R, br))
    _lora_shrink_kernel[grid](
        x2, lora_a, s_ptr, h, s_val, M, R, K,
        x2.stride(0), x2.stride(1), lora_a.stride(0), lora_a.stride(1), h.stride(0), h.stride(1),
        SCALE_MODE=mode, UPCAST=upcast, PRECISION="ieee" if fp32_dot else None,
        BLOCK_M=bm, BLOCK_R=br, BLOCK_K=bk, num_warps=warps)
    return h


def _torch_backend(x, weight, bias, lora_a, lora_b, scale, gelu=False, state=None):
    return lora_linear_torch(x, weight, bias, lora_a, lora_b, scale, gelu=gelu)


_CAPS = frozenset({"bias", "gelu", "per_rank_scale", "fp32_epilogue"})
registry.register(Backend(OP, "triton", _launch, frozenset(FLOATS), frozenset({"cuda", "cpu"}), _CAPS, 20,
                          registry.triton_available,
                          "Triton GEMM with the fp32 LoRA delta expanded in the epilogue"))
registry.register(Backend(OP, "torch", _torch_backend, frozenset(FLOATS), frozenset({"cuda", "cpu"}),
                          _CAPS | ROW_SCALE, 0,
                          description="the fp32 torch reference"))
