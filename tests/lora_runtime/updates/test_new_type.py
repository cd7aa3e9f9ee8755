"""A new update type is its file and one entry in `UPDATE_TYPES`: key splitting, detection, format
labels, the supported-keys list, loading and matching pick it up with no other edit."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from comfyui_lora_runtime.lora_runtime.files.key_formats import split_key
from comfyui_lora_runtime.lora_runtime.files.load import load_adapter
from comfyui_lora_runtime.lora_runtime.files.match import match_adapter
from comfyui_lora_runtime.lora_runtime.updates import Update, detect
from comfyui_lora_runtime.lora_runtime.updates.base import as_linear
from comfyui_lora_runtime.lora_runtime.updates.registry import UPDATE_TYPES, format_of, supported
from comfyui_lora_runtime.lora_runtime.updates.trace_forms import DenseForm


class Doubled(Update):
    """A made-up type: delta = 2 * ``toy_delta`` ([out, in])."""

    kind = "doubled"
    label = "Doubled"
    FILE_KEYS = ((re.compile(r"\.toy_delta$"), "toy_delta"),)
    KEY_PARTS = ((re.compile(r"^toy_delta$"), ""),)
    ROLES = ("toy_delta",)
    FORMATS = ((1, re.compile(r"\.toy_delta$"), "toy"),)
    SUPPORTED = "Doubled (toy_delta)"

    def __init__(self, d, alpha=None, *, stem="", diff_b=None):
        super().__init__(stem, alpha, diff_b)
        self.d = as_linear(d, self.stem, "toy_delta")

    @classmethod
    def from_roles(cls, roles, names, alpha, *, stem, diff_b=None, **_):
        return cls(roles["toy_delta"], alpha, stem=stem, diff_b=diff_b)

    scale = 2.0
    out_features = property(lambda self: int(self.d.shape[0]))
    in_features = property(lambda self: int(self.d.shape[1]))

    def tensors(self):
        return {"toy_delta": self.d}

    def _delta(self, device, ct, rows, weight):
        d = self.d if rows is None else self.d[rows]
        return d.to(device=device, dtype=ct) * 2.0

    def _forward(self, x, factor, base_out_nobias, weight):
        return F.linear(x, self._on(x.device, x.dtype, "d", lambda: self.d)) * (2.0 * factor)

    def trace_form(self, device, dtype, weight=None):
        return DenseForm(self._on(device, dtype, "d", lambda: self.d)), 2.0


@pytest.fixture
def registered():
    UPDATE_TYPES.append(Doubled)
    try:
        yield Doubled
    finally:
        UPDATE_TYPES.remove(Doubled)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 6)
        self.k = nn.Linear(8, 6)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block()])


def test_a_registered_type_is_split_labelled_loaded_and_matched(registered, tmp_path):
    key = "diffusion_model.blocks.0.q.toy_delta"
    assert split_key(key) == ("diffusion_model.blocks.0.q", "toy_delta", None)
    assert format_of(key) == "toy"
    assert "Doubled (toy_delta)" in supported()
    d = torch.randn(6, 8)
    assert isinstance(detect({"toy_delta": d}, stem="l"), Doubled)

    torch.manual_seed(0)
    save_file({key: d, "diffusion_model.blocks.0.k.toy_delta": torch.randn(6, 8)}, str(tmp_path / "toy.safetensors"))
    adapter = load_adapter(tmp_path / "toy.safetensors")
    assert adapter.format == "toy"
    assert isinstance(adapter.layers["diffusion_model.blocks.0.q"].update, Doubled)
    targets, report = match_adapter(adapter, _Model(), log_coverage=False)
    assert set(targets) == {"blocks.0.q", "blocks.0.k"} and report.kinds == {"doubled": 2}
    torch.testing.assert_close(targets["blocks.0.q"].update.delta(), 2.0 * d)


def test_an_unregistered_type_is_not_known():
    """Without its list entry the same key is not an adapter key (the registry is the only hook)."""
    assert Doubled not in UPDATE_TYPES
    assert split_key("blocks.0.q.toy_delta") is None
    assert format_of("blocks.0.q.toy_delta") == "other"
