"""Fused GPU kernels (Triton) with their fp32 torch references; see each module."""
from ._dispatch import KernelUnavailableError, resolve_backend
from .linear_gelu_tanh import linear_gelu_tanh, linear_gelu_tanh_eager, linear_gelu_tanh_torch
from .lora_linear import lora_linear, lora_linear_eager, lora_linear_torch

__all__ = [
    "KernelUnavailableError", "resolve_backend",
    "linear_gelu_tanh", "linear_gelu_tanh_torch", "linear_gelu_tanh_eager",
    "lora_linear", "lora_linear_torch", "lora_linear_eager",
]
