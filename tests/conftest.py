"""Test-wide setup.

Triton decides at decoration time whether a @triton.jit function is compiled or
interpreted, so TRITON_INTERPRET must be set before any kernel module is
imported. Without CUDA we always interpret: CI has no GPU. Each test ends with the
bundled host's models unloaded.
"""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _bundled_host_unloads_after_each_test():
    """Like a host restarted between tests: the bundled host keeps models loaded (and our adapters
    on them) between samplings, so each test ends by unloading whatever it left loaded."""
    yield
    mm = sys.modules.get("comfyui_lora_runtime.host.bundled.model_management")
    if mm is not None:
        mm.unload_all_models()
