"""On the nodes: a LoRA with text-encoder keys loads with 'unmatched keys: error' (text-encoder keys are not unmatched),
the model part gives the same image as the file without them, and the loader's coverage,
the sampler's report and its text say "N text-encoder layers (M tensors) not applied"."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_lora_runtime.lora_runtime import LoraRuntimeError
from comfyui_lora_runtime.nodes import report
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter

from testkit.nodes_helpers import _sample, _weights

jsonschema = pytest.importorskip("jsonschema")


def _te():
    g = torch.Generator().manual_seed(1)
    t = {}
    for i in range(3):
        stem = f"lora_te_text_model_encoder_layers_{i}_mlp_fc1"
        t[f"{stem}.lora_down.weight"], t[f"{stem}.lora_up.weight"] = torch.randn(4, 64, generator=g), \
            torch.randn(256, 4, generator=g)
        t[f"{stem}.alpha"] = torch.tensor(4.0)
    return t  # 3 layers, 9 tensors


def test_text_encoder_keys_on_the_loader_and_the_report(base, models_dir):
    loras = models_dir / "loras"
    save_file({**load_file(str(loras / "style.safetensors")), **_te()}, str(loras / "style_te.safetensors"))
    w0 = _weights(base)
    out = LoadLoraAdapter().load(base, "style_te.safetensors", 1.0)
    cov = out["ui"]["lora_coverage"][0]
    assert cov["text_encoder_layers"] == 3 and cov["text_encoder_tensors"] == 9 and cov["unmatched"] == 0
    y, rep = _sample(out["result"][0])
    y_ref, _ = _sample(LoadLoraAdapter().load(base, "style.safetensors", 1.0)["result"][0])
    assert torch.equal(y, y_ref) and not torch.equal(y, _sample(base)[0])
    assert "3 text-encoder layers (9 tensors) not applied: this node patches the model only" in report.text(rep)
    schema = json.loads(report.SCHEMA_PATH.read_text())
    assert [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(rep)] == []
    assert all(torch.equal(w0[k], v) for k, v in _weights(base).items())


def test_a_text_encoder_only_file_is_refused_at_validation_and_at_the_node(base, models_dir):
    save_file(_te(), str(models_dir / "loras" / "te_only.safetensors"))
    msg = LoadLoraAdapter.VALIDATE_INPUTS("te_only.safetensors")
    assert isinstance(msg, str) and "te_only.safetensors holds only text-encoder weights" in msg
    with pytest.raises(LoraRuntimeError, match="te_only.safetensors holds only text-encoder weights"):
        LoadLoraAdapter().load(base, "te_only.safetensors", 1.0)
