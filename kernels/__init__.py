"""GEMM ops with their backends (kernels.registry) and fp32 torch references; see each module."""
from . import registry
from .linear_gelu_tanh import linear_gelu_tanh, linear_gelu_tanh_eager, linear_gelu_tanh_torch
from .lora_linear import lora_linear, lora_linear_eager, lora_linear_torch
from . import linear_gelu_cublaslt, lora_linear_cublas  # noqa: E402,F401  (register their backends)
from .registry import KernelUnavailableError, use_backend

__all__ = [
    "KernelUnavailableError", "registry", "use_backend",
    "linear_gelu_tanh", "linear_gelu_tanh_torch", "linear_gelu_tanh_eager",
    "lora_linear", "lora_linear_torch", "lora_linear_eager",
]
