"""Test-wide setup.

Triton decides at decoration time whether a @triton.jit function is compiled or
interpreted, so TRITON_INTERPRET must be set before any kernel module is
imported. Without CUDA we always interpret: CI has no GPU.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
