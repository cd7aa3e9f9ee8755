"""linear + GELU(tanh) through cuBLASLt's bias+GELU epilogue: backend "cublaslt" of
`linear_gelu_tanh` (its reference: linear_gelu_tanh.linear_gelu_tanh_torch).

``torch._addmm_activation(b, x, W^T, use_gelu=True)`` runs the GEMM with the bias add
and the GELU on the fp32 accumulator and rounds once at the store, like the Triton
kernel, at cuBLAS's speed. Which GELU it computes depends on where it runs: on the
CPU it is the erf GELU (a different function, up to 4.7e-4 apart), on CUDA cuBLASLt's
epilogue is believed to be the tanh approximation. So the backend runs on CUDA only,
and only where `epilogue_check(device, dtype)` — run once per device and dtype on that
device — found the epilogue to compute GELU(tanh) to within one rounding of the dtype
while the erf GELU is measurably further away.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from . import registry
from .registry import FLOATS, Backend

logger = logging.getLogger(__name__)

__all__ = ["linear_gelu_cublaslt", "epilogue_check"]

_CHECKED: dict[tuple[str, torch.dtype], str] = {}


def linear_gelu_cublaslt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu_tanh(x @ weight^T + bias) in one cuBLASLt call (no bias: a zero bias)."""
    lead, K = x.shape[:-1], x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    b = bias if bias is not None else weight.new_zeros(N)
    return torch._addmm_activation(b, x2, weight.t(), use_gelu=True).reshape(*lead, N)


def _grid_case(device, dtype):
    """x [32, 16] of zeros, W [1024, 16], b [1024] spanning [-6, 6]: the pre-activation is
    b itself, exact in the dtype, so a path that rounds before its GELU is judged on the
    GELU alone."""
    b = torch.linspace(-6, 6, 1024).to(dtype)
    x = torch.zeros(32, 16, dtype=dtype)
    w = torch.full((1024, 16), 0.5, dtype=dtype)
    pre = b.double()[None, :].expand(32, -1)
    return x.to(device), w.to(device), b.to(device), pre


def epilogue_check(device, dtype) -> str:
    """'' when `_addmm_activation(use_gelu=True)` computes GELU(tanh) on `device` in
    `dtype` (every output within one ulp of the dtype + 2e-6 of the fp64 tanh GELU, and
    the erf GELU outside that); else why not. Runs once per (device, dtype)."""
    device = torch.device(device)
    key = (str(device), dtype)
    if key in _CHECKED:
        return _CHECKED[key]
    try:
        x, w, b, pre = _grid_case(device, dtype)
        y = torch._addmm_activation(b, x, w.t(), use_gelu=True).double().cpu()
        tanh_ref, erf_ref = F.gelu(pre, approximate="tanh"), F.gelu(pre)
        tol = torch.finfo(dtype).eps * tanh_ref.abs() + 2e-6
        off_tanh = int(((y - tanh_ref).abs() > tol).sum())
        off_erf = int(((y - erf_ref).abs() > tol).sum())
        err_t, err_e = float((y - tanh_ref).abs().max()), float((y - erf_ref).abs().max())
        if off_tanh == 0 and off_erf > 0:
            why = ""
        elif off_erf == 0 and off_tanh > 0:
            why = (f"torch._addmm_activation(use_gelu=True) computes the erf GELU on {device} "
                   f"({_dt(dtype)}: max error {err_e:.2e} vs erf, {err_t:.2e} vs tanh)")
        else:
            why = (f"torch._addmm_activation(use_gelu=True) on {device} ({_dt(dtype)}) is neither "
                   f"GELU(tanh) within one rounding nor erf (max error {err_t:.2e} vs tanh, {err_e:.2e} vs erf)")
    except Exception as exc:  # a device/driver without the epilogue: the backend is just unavailable
        why = f"torch._addmm_activation failed on {device} ({type(exc).__name__}: {str(exc)[:160]})"
    if why:
        logger.info("cublaslt linear+GELU unavailable: %s", why)
    _CHECKED[key] = why
    return why


def _dt(d) -> str:
    return str(d).rsplit(".", 1)[-1]


def _available(device: torch.device, dtype: torch.dtype, auto: bool) -> str:
    return epilogue_check(device, dtype)


registry.register(Backend("linear_gelu_tanh", "cublaslt", linear_gelu_cublaslt, frozenset(FLOATS),
                          frozenset({"cuda"}), frozenset({"bias", "gelu", "fp32_epilogue"}), 30, _available,
                          "cuBLASLt GEMM with the bias+GELU(tanh) epilogue (torch._addmm_activation)"))
