"""Load LoRA Adapter (model + CLIP) on a CLIP built by real ComfyUI: the CLIP it returns
encodes exactly (torch.equal) as the CLIP of ComfyUI's own `load_lora_for_models` (what
LoraLoader calls) for the same file and strength, differs from the unpatched CLIP, and the
layers ComfyUI's key map has no place for are counted (error by default, a line when
skipped). The CLIP is ComfyUI's SD1 CLIP-L class with a small config (ComfyUI's
``clip_l_model_config`` option: 2 layers, width 64) and seeded weights, so nothing is
downloaded. Runs in ComfyUI's python, in-process (a CLIP cannot travel through /prompt
without a text-encoder file of the full CLIP-L shape)."""
from __future__ import annotations

from testkit.comfyui.probe import run_probe


SCRIPT = r'''
import json, os, sys, types
comfy_dir, loras = sys.argv[1], sys.argv[2]
sys.path.insert(0, comfy_dir)
import torch
import comfy.cli_args
comfy.cli_args.args.cpu = True
import comfy.sd, comfy.sd1_clip, comfy.utils
import folder_paths
from safetensors.torch import save_file

opts = {"clip_l_model_config": {"hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4,
                                "num_hidden_layers": 2, "projection_dim": 64}}
target = types.SimpleNamespace(clip=comfy.sd1_clip.SD1ClipModel, tokenizer=comfy.sd1_clip.SD1Tokenizer, params={})
clip = comfy.sd.CLIP(target=target, model_options=opts)
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    for name, p in clip.cond_stage_model.named_parameters():
        p.copy_(torch.ones_like(p) if "layer_norm" in name and name.endswith("weight")
                else torch.randn(p.shape, generator=g) * 0.05)
sd = clip.cond_stage_model.state_dict()
t = {}
parts = {"self_attn_q_proj": "self_attn.q_proj", "self_attn_out_proj": "self_attn.out_proj", "mlp_fc1": "mlp.fc1",
         "mlp_fc2": "mlp.fc2"}
for i in (0, 1, 5):  # the CLIP has layers 0 and 1
    for kohya, part in parts.items():
        stem = f"lora_te_text_model_encoder_layers_{i}_{kohya}"
        out, inn = sd[f"clip_l.transformer.text_model.encoder.layers.0.{part}.weight"].shape
        t[f"{stem}.lora_down.weight"] = torch.randn(4, inn, generator=g) * 0.2
        t[f"{stem}.lora_up.weight"] = torch.randn(out, 4, generator=g) * 0.2
        t[f"{stem}.alpha"] = torch.tensor(2.0)
path = os.path.join(loras, "te_clip.safetensors")
save_file(t, path)
folder_paths.add_model_folder_path("loras", loras, is_default=True)

import comfyui_lora_runtime as pack
from comfyui_lora_runtime.nodes import host
from comfyui_lora_runtime.lora_runtime import LoraRuntimeError
node = pack.NODE_CLASS_MAPPINGS["LoraRuntimeLoadAdapterModelClip"]
res = {"host": host.NAME, "valid": node.VALIDATE_INPUTS("te_clip.safetensors")}
try:
    node().load(None, clip, "te_clip.safetensors", 1.0, 0.7, unmatched_keys="error")
    res["error"] = ""
except LoraRuntimeError as e:
    res["error"] = str(e)
out = node().load(None, clip, "te_clip.safetensors", 1.0, 0.7, unmatched_keys="skip and report")
mine = out["result"][1]
ref = comfy.sd.load_lora_for_models(None, clip, comfy.utils.load_torch_file(path, safe_load=True), 0.0, 0.7)[1]

def enc(c):
    cond, pooled = c.encode_from_tokens(c.tokenize("red 7"), return_pooled=True)
    return cond.clone(), pooled.clone()

a, b, p = enc(mine), enc(ref), enc(clip)
res.update(model_passed=out["result"][0] is None, coverage=out["ui"]["lora_coverage"][0],
           equal=bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])),
           differs=float((a[0] - p[0]).abs().max()), same_clip=mine is clip)
print("RESULT " + json.dumps(res))
'''


def test_model_clip_node_on_a_comfyui_clip_equals_comfyuis_lora_loader(tmp_path, comfy_checkout):
    comfy, python = comfy_checkout
    (tmp_path / "loras").mkdir()
    r = run_probe(python, comfy, SCRIPT, [tmp_path / "loras"], tmp_path, timeout=600)[-1]
    assert r["host"] == "comfyui" and r["valid"] is True
    assert "te_clip.safetensors has 4 text-encoder layers (12 tensors) that this CLIP has no place for" in r["error"]
    assert "lora_te_text_model_encoder_layers_5_" in r["error"]
    cov = r["coverage"]
    assert (cov["text_encoder_applied_layers"], cov["text_encoder_applied_tensors"]) == (8, 24)
    assert (cov["text_encoder_layers"], cov["text_encoder_tensors"]) == (4, 12)
    assert r["model_passed"] and not r["same_clip"]
    assert r["equal"], "the node's CLIP encodes differently from ComfyUI's load_lora_for_models CLIP"
    assert r["differs"] > 1e-3, "the patched CLIP encodes as the unpatched one"
