"""Import a Hugging Face test dependency (peft, diffusers) so that it sees Hugging Face's packages, not ours.

Run from the repo root (``python -m pytest``), the root is on ``sys.path`` and this pack's top-level
``kernels/`` folder answers to the name of Hugging Face's ``kernels`` package, which transformers imports
when it finds it: the import fails. ``hf_import`` imports with the root off ``sys.path`` and our
``kernels`` out of ``sys.modules``, then puts both back. Only the dependency itself being absent skips;
any other import error fails the test module, never a silent skip."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _is_root(entry: str) -> bool:
    try:
        return Path(entry or ".").resolve() == REPO
    except OSError:
        return False


def hf_import(name: str, reason: str):
    saved_path = list(sys.path)
    ours = sys.modules.pop("kernels", None)
    try:
        sys.path[:] = [p for p in sys.path if not _is_root(p)]
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] == name.split(".")[0]:
                pytest.skip(reason, allow_module_level=True)
            raise
    finally:
        sys.path[:] = saved_path
        if ours is not None:
            sys.modules["kernels"] = ours
