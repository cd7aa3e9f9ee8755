"""Test-wide setup.

- The shared helpers are the package ``testkit`` in this folder: this folder goes on
  sys.path here, once, instead of a ``pythonpath`` list in pyproject.toml. Test modules
  import only ``testkit`` and the pack (``comfyui_lora_runtime``), never each other.
- Triton decides at decoration time whether a @triton.jit function is compiled or
  interpreted, so TRITON_INTERPRET must be set before any kernel module is imported.
  Without CUDA we always interpret: CI has no GPU.
- The repo root is a package (ComfyUI imports its ``__init__.py``, which uses relative
  imports); pytest would import that file as a lone module to set the root package up,
  which fails for a checkout whose folder name is no identifier (``git clone`` names it
  ``comfyui-lora-runtime``). The root holds no test fixtures, so its setup is skipped;
  the tests import the pack as the installed package ``comfyui_lora_runtime``.
- Each test ends with the bundled host's models unloaded (it keeps them loaded between
  samplings, as ComfyUI does).
"""
import os
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        for node in item.listchain():
            if isinstance(node, pytest.Package) and Path(node.path).resolve() == ROOT:
                node.setup = lambda: None
                return


@pytest.fixture(autouse=True)
def _bundled_host_unloads_after_each_test():
    """Like a host restarted between tests: the bundled host keeps models loaded (and our adapters
    on them) between samplings, so each test ends by unloading whatever it left loaded."""
    yield
    mm = sys.modules.get("comfyui_lora_runtime.standalone.host.model_management")
    if mm is not None:
        mm.unload_all_models()
