"""The Merge Mode node's restore_memory option: 'copy' samples the same bits as 'lean',
keeps a full copy of each merged weight (reported), and leaves every weight bit-identical."""
import pytest
import torch

from comfyui_lora_runtime.lora_runtime.layer.wrapper import runtime_leftovers
from comfyui_lora_runtime.nodes import lifecycle
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter, LoraMergeMode, LoraQualityTier
from comfyui_lora_runtime.nodes.report import text

from testkit.nodes_helpers import _sample, _weights


def _model(base, restore):
    m = LoadLoraAdapter().load(base, "style.safetensors", 0.8)["result"][0]
    return LoraQualityTier().set_tier(LoraMergeMode().set_mode(m, "merge", restore)[0], "exact")[0]


def test_copy_samples_the_lean_bits_and_reports_its_memory(base):
    w0 = _weights(base)
    lean, _ = _sample(_model(base, "lean"))
    m = _model(base, "copy")
    copy, _ = _sample(m)
    r = lifecycle.last_report(m)
    assert torch.equal(copy, lean)                                   # same merge, same bits
    assert not torch.equal(copy, _sample(base)[0])                   # not the base model
    dm = base.model.diffusion_model
    adapted = {n for n, mod in dm.named_modules() if isinstance(mod, torch.nn.Linear)}
    assert r["restore_memory"] == "copy" and r["decision"]["chosen"] == "merge"
    # a full copy: at least one weight's bytes per merged layer, far above the lean record
    assert r["restore_bytes"] >= min(dm.get_submodule(n).weight.numel() * 2 for n in adapted)
    assert "restore record (copy)" in text(r)
    assert runtime_leftovers(dm) == []
    w1 = _weights(base)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_lean_record_is_smaller_than_the_copy(base):
    m_lean, m_copy = _model(base, "lean"), _model(base, "copy")
    _sample(m_lean)
    _sample(m_copy)
    lean, copy = lifecycle.last_report(m_lean), lifecycle.last_report(m_copy)
    # the embedded style adapter is a strong update on a tiny model (about a quarter of the elements
    # cross a rounding boundary); typical adapters keep ~1 % (tests/lora_runtime/layer/test_merge.py)
    assert lean["restore_memory"] == "lean" and 0 < lean["restore_bytes"] < copy["restore_bytes"] / 2


def test_unknown_restore_memory_is_refused(base):
    with pytest.raises(ValueError, match="'full'.*lean, copy"):
        LoraMergeMode().set_mode(base, "merge", "full")
