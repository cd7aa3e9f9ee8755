"""Kernel-test setup: make _compare importable (pytest runs with
--import-mode=importlib, which puts no test folder on sys.path) and pick the
device the Triton kernels run on."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from comfyui_lora_runtime.kernels.registry import interpreting, triton_importable  # noqa: E402


@pytest.fixture
def kernel_device() -> str:
    """CUDA when present (compiled kernels), else the CPU under the Triton interpreter."""
    if not triton_importable():
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        return "cuda"
    if interpreting():
        return "cpu"
    pytest.skip("no CUDA and TRITON_INTERPRET is not set")
