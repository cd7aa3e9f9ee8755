"""Launch options of the bundled host, given explicitly per run.

ComfyUI takes these on its command line (e.g. ``--bf16-unet``); the bundled host
takes them as arguments: ``execute_prompt(..., unet_dtype="bf16")`` or, around any
code, ``with options.using(unet_dtype="bf16"):``. Nothing is written to
``os.environ``, so an option ends with the run that set it.

Only when no option is given does the host read its process default from the
environment: ``LORA_RUNTIME_UNET_DTYPE`` (``fp32`` / ``bf16`` / ``fp16``), else
float32, what ComfyUI uses on the CPU.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator

UNET_DTYPE_ENV = "LORA_RUNTIME_UNET_DTYPE"
UNET_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # name -> torch dtype

_unet_dtype: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "comfyui_lora_runtime_unet_dtype", default=None)


def _check(name: str, where: str) -> str:
    key = str(name).strip().lower()
    if key not in UNET_DTYPES:
        raise ValueError(f"{where}={name!r}: use one of {', '.join(UNET_DTYPES)}")
    return key


def unet_dtype_name() -> str:
    """The active weight dtype name: the option in effect (`using`), else the
    environment default, else "fp32"."""
    name = _unet_dtype.get()
    if name is not None:
        return name
    return _check(os.environ.get(UNET_DTYPE_ENV, "fp32"), UNET_DTYPE_ENV)


def unet_dtype():
    """Storage and compute dtype of loaded diffusion models: float32 by default (what
    ComfyUI uses on the CPU); ``bf16`` emulates a GPU ComfyUI (or ComfyUI's
    ``--bf16-unet``), where merge rounding matters."""
    import torch  # here, so the executor and the workflow converter stay torch-free
    return getattr(torch, UNET_DTYPES[unet_dtype_name()])


@contextlib.contextmanager
def using(unet_dtype: str | None = None) -> Iterator[None]:
    """Run the body with these options (None: keep the one in effect)."""
    if unet_dtype is None:
        yield
        return
    token = _unet_dtype.set(_check(unet_dtype, "unet_dtype"))
    try:
        yield
    finally:
        _unet_dtype.reset(token)
