"""Backend choice for the fused kernels: Triton where it can run, torch otherwise.

- "auto" takes Triton only when every tensor is on CUDA and triton imports. It
  never picks the Triton interpreter: that runs a GEMM tile by tile in numpy and
  is orders of magnitude slower than torch on the CPU.
- "triton" is honoured on CUDA, and on CPU tensors when TRITON_INTERPRET=1 (how
  the tests run the kernels on machines without a GPU). Anything else raises
  KernelUnavailableError saying why and what to do.
- "torch" always runs the fp32 torch reference of the op.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton")


class KernelUnavailableError(RuntimeError):
    """A Triton kernel was requested where it cannot run."""


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    """True when `import triton` works (cached: the import is slow)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything
        logger.debug("triton is not importable: %r", exc)
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1).

    Triton reads this variable when a kernel is decorated, so it must be set
    before the kernel modules are imported (tests/conftest.py does that).
    """
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def resolve_backend(requested: str, *tensors: torch.Tensor | None) -> str:
    """Return "triton" or "torch" for `requested` in {"auto", "torch", "triton"}.

    None entries in `tensors` (an absent bias) are ignored.
    """
    if requested not in BACKENDS:
        raise ValueError(f"unknown kernel backend {requested!r}; use one of {', '.join(BACKENDS)}")
    if requested == "torch":
        return "torch"
    present = [t for t in tensors if t is not None]
    all_cuda = bool(present) and all(t.is_cuda for t in present)
    if requested == "auto":
        return "triton" if all_cuda and triton_importable() else "torch"
    # requested == "triton"
    if not triton_importable():
        raise KernelUnavailableError(
            "backend='triton' was requested but triton cannot be imported; "
            "install it (pip install 'comfyui-lora-runtime[triton]') or use backend='auto'"
        )
    if all_cuda:
        return "triton"
    devices = sorted({str(t.device) for t in present})
    if interpreting() and not any(t.is_cuda for t in present):
        return "triton"
    raise KernelUnavailableError(
        f"backend='triton' needs every tensor on one CUDA device, got {devices}; "
        "move the tensors to CUDA, use backend='auto' (falls back to torch), or set "
        "TRITON_INTERPRET=1 before importing the kernels to run them slowly on the CPU"
    )
