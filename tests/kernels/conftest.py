"""Kernel-test setup: pick the device the Triton kernels run on."""
import pytest
import torch

from comfyui_lora_runtime.kernels.registry import interpreting, triton_importable


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
