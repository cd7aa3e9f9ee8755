"""Fixtures for the bundled-host tests: the ComfyUI reference vectors.

The reference folder is ``tests/data/comfyui-0.3.64`` (shipped with the repo; see
tests/data/README.md), or ``$LORA_RUNTIME_REFERENCE_DIR``; a missing file fails the
test that needs it, naming the file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch


def _reference_dir() -> Path:
    env = os.environ.get("LORA_RUNTIME_REFERENCE_DIR")
    if env:
        return Path(env)
    from testkit.refdata import REF
    return REF


@pytest.fixture(scope="session")
def ref_dir() -> Path:
    d = _reference_dir()
    if not (d / "README.md").is_file():
        pytest.fail(f"ComfyUI reference vectors not found at {d}: tests/data ships with the repo "
                    "(restore it from git) or set LORA_RUNTIME_REFERENCE_DIR")
    return d


@pytest.fixture(scope="session")
def load_ref(ref_dir):
    """load_ref(name) -> dict of tensors from <ref>/<name>.safetensors."""
    from safetensors.torch import load_file

    def _load(name: str) -> dict[str, torch.Tensor]:
        return load_file(str(ref_dir / f"{name}.safetensors"))

    return _load


@pytest.fixture(scope="session")
def ref_json(ref_dir):
    def _load(name: str):
        return json.loads((ref_dir / name).read_text())

    return _load


@pytest.fixture(scope="session")
def tiny_wan(ref_dir):
    from comfyui_lora_runtime.standalone.host.wan21 import load_wan_checkpoint

    return load_wan_checkpoint(ref_dir / "tiny_wan_d128_l2.safetensors")


@pytest.fixture(scope="session")
def cond_pos(load_ref) -> torch.Tensor:
    return load_ref("cond_pos")["cond_pos"]  # [1, 4, 4096]
