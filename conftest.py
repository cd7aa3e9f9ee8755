"""pytest only (ComfyUI never imports this file). The pack's root folder is a package whose
``__init__.py`` uses relative imports; pytest sets a package up by importing its
``__init__.py``, and for a checkout in a folder whose name is no Python identifier (``git
clone`` names it ``comfyui-lora-runtime``) it imports it as a lone module, which fails every
test's setup. The root holds no test fixtures, so its package setup is skipped; the tests
import the pack as the installed package ``comfyui_lora_runtime``."""
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        for node in item.listchain():
            if isinstance(node, pytest.Package) and Path(node.path).resolve() == _ROOT:
                node.setup = lambda: None
                return
