"""Triton pieces shared by the GEMM kernels: tile order, the K loop, the epilogue,
and the launcher (configs per shape bucket: launch_configs). Import only when `triton_importable()`.

Under TRITON_INTERPRET=1 every tile is numpy code, so the launchers skip autotune
and use INTERPRET_META (small tiles keep the CPU test run short), convert tiles
to fp32 before tl.dot (the interpreter's bf16 dot is wrong), and have low-precision
results stored as fp32 and rounded by torch (the interpreter truncates fp32->bf16
instead of rounding to nearest even).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .launch_configs import BucketKey, LaunchConfig, choose, dtype_key, m_bucket

# One fixed config for the interpreter; tl.dot needs every dim >= 16.
INTERPRET_META = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4)
INTERPRET_RANK_BLOCK = 16


@triton.jit
def gelu_tanh_f32(u):
    # 0.5*u*(1 + tanh(z)) == u * sigmoid(2z): the same function without the
    # cancellation for u << 0. sigmoid(t) from e = exp(-|t|) never overflows;
    # gelu(+inf) = inf and gelu(-inf) = nan, as torch gives.
    t = 1.5957691216057308 * (u + 0.044715 * u * u * u)  # 2 * sqrt(2/pi) * (...)
    e = tl.exp(-tl.abs(t))
    sig = tl.where(t >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    return u * sig


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Walk the output GROUP_M row-tiles at a time so neighbouring programs share
    # rows of x and columns of W in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def gemm_tile(x_ptr, w_ptr, offs_m, offs_n, M, N, K,
              stride_xm, stride_xk, stride_wn, stride_wk,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # acc[BLOCK_M, BLOCK_N] = x[offs_m, :] @ W[offs_n, :]^T in fp32; W is read
    # through its strides as the [K, N] tile, so no transposed copy is made.
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    row_ok = offs_m[:, None] < M
    col_ok = offs_n[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        xt = tl.load(x_ptrs, mask=row_ok & (offs_k[None, :] < k_left), other=0.0)
        wt = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & col_ok, other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def bias_gelu_store(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on,
                    HAS_BIAS: tl.constexpr, APPLY_GELU: tl.constexpr):
    # The epilogue on the fp32 accumulator; the store is the only rounding.
    col_ok = offs_n < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if APPLY_GELU:
        acc = gelu_tanh_f32(acc)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & col_ok[None, :])


# ---- launcher helpers (plain python) ----

def main_precision(dtype):
    """tl.dot input_precision for the x @ W^T loop: fp32 GEMMs stay IEEE fp32
    (what F.linear does with TF32 off); fp16/bf16 tiles use the native MMA."""
    import torch
    return "ieee" if dtype == torch.float32 else None


def out_buffer(rows: int, cols: int, dtype, device, interpret: bool):
    """The kernel's output: fp32 under the interpreter for fp16/bf16 (rounded by
    torch afterwards, see the module docstring), else the final dtype."""
    import torch
    store_dtype = torch.float32 if interpret else dtype
    return torch.empty((rows, cols), dtype=store_dtype, device=device)


def launch_tiles(kernel, op: str, M: int, N: int, K: int, args: tuple, flags: dict,
                 interpret_meta: dict | None, extra_meta: dict | None = None) -> None:
    """Launch a tiled GEMM kernel over cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) programs: the
    fixed interpreter config when `interpret_meta` is given, else the config of this
    shape bucket (launch_configs.choose: committed table, else tuned once per bucket).
    args[0] is x (its dtype and device key the bucket)."""
    extra = extra_meta or {}
    if interpret_meta is not None:
        grid = (triton.cdiv(M, interpret_meta["BLOCK_M"]) * triton.cdiv(N, interpret_meta["BLOCK_N"]),)
        kernel[grid](*args, **flags, **interpret_meta, **extra)
        return

    def launch(cfg: LaunchConfig) -> None:
        grid = (triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N),)
        kernel[grid](*args, **flags, **cfg.meta(), **extra)

    x = args[0]
    key = BucketKey(op, dtype_key(x.dtype), N, K, m_bucket(M))
    launch(choose(key, x.device, launch))
