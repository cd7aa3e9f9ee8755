"""Load LoRA Adapter (model + CLIP) in the bundled host: the text-encoder part on the CLIP
equals a hand merge of the deltas into a copy of the text encoder (and differs from the
unpatched CLIP), the model part is exactly Load LoRA Adapter's, a text-encoder-only file
works here (the model-only loader still refuses it), layers the CLIP has no place for
follow unmatched_keys with layer and tensor counts, and the CLIP's weights are untouched."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_lora_runtime import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from comfyui_lora_runtime.standalone.host.clip import BundledCLIP, TinyClipTextModel
from comfyui_lora_runtime.standalone.host.core_nodes import CLIPLoader, CLIPTextEncode
from comfyui_lora_runtime.lora_runtime import LoraRuntimeError
from comfyui_lora_runtime.nodes import lifecycle, report
from comfyui_lora_runtime.nodes.clip_node import LoadLoraAdapterModelClip
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter

from testkit.nodes_helpers import _sample, _weights, _unloaded_weights

PREFIX = "clip_l.transformer.text_model.encoder.layers"
PARTS = {"self_attn_q_proj": "self_attn.q_proj", "self_attn_v_proj": "self_attn.v_proj", "mlp_fc1": "mlp.fc1",
         "mlp_fc2": "mlp.fc2"}
PROMPT = "red 7"


def _clip():
    return BundledCLIP(TinyClipTextModel.make(seed=3))


def _te_file(clip, layers=(0, 1), extra_layer=None, scale=0.05):
    """kohya text-encoder LoRA on `layers` of the tiny CLIP (rank 4, alpha 2); `extra_layer`: a
    layer index the CLIP does not have. Returns (tensors, {weight key: (down, up, alpha)})."""
    g = torch.Generator().manual_seed(5)
    sd = clip.cond_stage_model.state_dict()
    t, ref = {}, {}
    for i in list(layers) + ([extra_layer] if extra_layer is not None else []):
        for kohya, part in PARTS.items():
            stem = f"lora_te_text_model_encoder_layers_{i}_{kohya}"
            out, inn = sd[f"{PREFIX}.0.{part}.weight"].shape
            down, up = torch.randn(4, inn, generator=g) * scale, torch.randn(out, 4, generator=g) * scale
            t[f"{stem}.lora_down.weight"], t[f"{stem}.lora_up.weight"] = down, up
            t[f"{stem}.alpha"] = torch.tensor(2.0)
            ref[f"{PREFIX}.{i}.{part}.weight"] = (down, up, 2.0)
    return t, ref


def _hand_merged(clip, ref, strength):
    """The reference: a copy of the text encoder with W += strength * alpha/rank * up @ down."""
    m = copy.deepcopy(clip.cond_stage_model)
    sd = m.state_dict()
    with torch.no_grad():
        for key, (down, up, alpha) in ref.items():
            if key in sd:
                sd[key] += strength * (alpha / down.shape[0]) * (up @ down)
    return BundledCLIP(m).encode(PROMPT)[0][0]


def _clip_weights(clip):
    return {k: v.detach().clone() for k, v in clip.cond_stage_model.state_dict().items()}


@pytest.fixture
def loras(models_dir):
    return models_dir / "loras"


def test_registered_with_a_display_name():
    assert NODE_CLASS_MAPPINGS["LoraRuntimeLoadAdapterModelClip"] is LoadLoraAdapterModelClip
    assert NODE_DISPLAY_NAME_MAPPINGS["LoraRuntimeLoadAdapterModelClip"] == "Load LoRA Adapter (model + CLIP)"
    req = LoadLoraAdapterModelClip.INPUT_TYPES()["required"]
    assert list(req)[:5] == ["model", "clip", "lora_name", "strength_model", "strength_clip"]
    spec = LoadLoraAdapterModelClip.INPUT_TYPES()
    assert all(v[1].get("tooltip") for g in ("required", "optional") for v in spec[g].values())
    assert len(LoadLoraAdapterModelClip.OUTPUT_TOOLTIPS) == len(LoadLoraAdapterModelClip.RETURN_TYPES) == 2
    # the model loader's optional inputs carry over
    assert set(LoadLoraAdapter.INPUT_TYPES()["optional"]) <= set(LoadLoraAdapterModelClip.INPUT_TYPES()["optional"])


def test_text_encoder_part_equals_a_hand_merge_and_the_model_part_equals_load_lora_adapter(base, loras):
    clip = _clip()
    te, ref = _te_file(clip)
    save_file({**load_file(str(loras / "style.safetensors")), **te}, str(loras / "style_te.safetensors"))
    w_clip, w_model = _clip_weights(clip), _weights(base)
    out = LoadLoraAdapterModelClip().load(base, clip, "style_te.safetensors", 0.8, 0.7)
    model, new_clip = out["result"]
    cond = CLIPTextEncode().encode(new_clip, PROMPT)[0][0][0]
    want = _hand_merged(clip, ref, 0.7)
    plain = clip.encode(PROMPT)[0][0]
    # fp32 both ways; the runtime forms W + s*(scale*(up@down)), the reference W + s*scale*(up@down):
    # products rounded in another order, a few ulps of activations ~1 through 2 layers
    torch.testing.assert_close(cond, want, rtol=1e-5, atol=1e-5)
    assert (cond - plain).abs().max() > 1e-3  # the unpatched CLIP (the wrong answer) is far off
    # the model part: the same intent and the same image as Load LoRA Adapter
    only = LoadLoraAdapter().load(base, "style_te.safetensors", 0.8)["result"][0]
    a, b = lifecycle.read(model).adapters[0], lifecycle.read(only).adapters[0]
    assert replace_clip(a) == b and a.clip.startswith("8 text-encoder layers (24 tensors) applied to the CLIP")
    y, rep = _sample(model)
    assert torch.equal(y, _sample(only)[0])
    assert "8 text-encoder layers (24 tensors) applied to the CLIP (x0.7)" in report.text(rep)
    assert "this node patches the model only" not in report.text(rep)
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(report.SCHEMA_PATH.read_text())
    assert [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(rep)] == []
    cov = out["ui"]["lora_coverage"][0]
    assert (cov["text_encoder_applied_layers"], cov["text_encoder_applied_tensors"]) == (8, 24)
    assert cov["text_encoder_layers"] == 0 and not any("model only" in n for n in cov["notes"])
    # nothing written: the CLIP's and the model's weights are as they were; the input CLIP encodes as before
    assert all(torch.equal(w_clip[k], v) for k, v in _clip_weights(clip).items())
    assert all(torch.equal(w_model[k], v) for k, v in _unloaded_weights(base).items())
    assert torch.equal(clip.encode(PROMPT)[0][0], plain) and not clip.patches


def replace_clip(a):
    from dataclasses import replace
    return replace(a, clip="")


def test_text_encoder_only_file_works_here_and_the_model_only_loader_still_refuses_it(base, loras):
    clip = _clip()
    te, ref = _te_file(clip, layers=(1,))
    save_file(te, str(loras / "te_only.safetensors"))
    assert LoadLoraAdapterModelClip.VALIDATE_INPUTS("te_only.safetensors") is True
    msg = LoadLoraAdapter.VALIDATE_INPUTS("te_only.safetensors")
    assert isinstance(msg, str) and "te_only.safetensors holds only text-encoder weights" in msg
    assert "Load LoRA Adapter (model + CLIP)" in msg
    with pytest.raises(LoraRuntimeError, match="Load LoRA Adapter \\(model \\+ CLIP\\)"):
        LoadLoraAdapter().load(base, "te_only.safetensors", 1.0)
    out = LoadLoraAdapterModelClip().load(base, clip, "te_only.safetensors", 1.0, 1.0)
    model, new_clip = out["result"]
    assert model is base  # nothing for the diffusion model: it passes through
    torch.testing.assert_close(new_clip.encode(PROMPT)[0][0], _hand_merged(clip, ref, 1.0), rtol=1e-5, atol=1e-5)
    cov = out["ui"]["lora_coverage"][0]
    assert cov["file_layers"] == 0 and cov["text_encoder_applied_layers"] == 4


def test_layers_the_clip_lacks_are_an_error_with_error_and_a_counted_line_by_default(base, loras):
    clip = _clip()
    te, ref = _te_file(clip, layers=(0,), extra_layer=5)  # the tiny CLIP has layers 0 and 1
    save_file({**load_file(str(loras / "style.safetensors")), **te}, str(loras / "style_te5.safetensors"))
    w_clip = _clip_weights(clip)
    with pytest.raises(LoraRuntimeError, match=r"style_te5.safetensors has 4 text-encoder layers \(12 tensors\) "
                                               r"that this CLIP has no place for: no such layer in this CLIP"):
        LoadLoraAdapterModelClip().load(base, clip, "style_te5.safetensors", 1.0, 1.0, unmatched_keys="error")
    out = LoadLoraAdapterModelClip().load(base, clip, "style_te5.safetensors", 1.0, 1.0)   # default: skip and report
    model, new_clip = out["result"]
    cov = out["ui"]["lora_coverage"][0]
    assert (cov["text_encoder_applied_layers"], cov["text_encoder_applied_tensors"]) == (4, 12)
    assert (cov["text_encoder_layers"], cov["text_encoder_tensors"]) == (4, 12)
    line = cov["clip"]
    assert "4 text-encoder layers (12 tensors) not applied: no such layer in this CLIP" in line
    assert "lora_te_text_model_encoder_layers_5_" in line
    _, rep = _sample(model)
    assert "4 text-encoder layers (12 tensors) not applied: no such layer in this CLIP" in report.text(rep)
    torch.testing.assert_close(new_clip.encode(PROMPT)[0][0], _hand_merged(clip, ref, 1.0), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(w_clip[k], v) for k, v in _clip_weights(clip).items())


def test_strength_clip_zero_leaves_the_clip_and_says_so(base, loras):
    clip = _clip()
    te, _ = _te_file(clip)
    save_file({**load_file(str(loras / "style.safetensors")), **te}, str(loras / "style_te.safetensors"))
    out = LoadLoraAdapterModelClip().load(base, clip, "style_te.safetensors", 1.0, 0.0)
    assert out["result"][1] is clip
    assert out["ui"]["lora_coverage"][0]["clip"].startswith("text encoder: off (strength 0); 8 text-encoder layers")


def test_clips_stack_on_clones_and_the_bundled_loader_and_encoder_run_it(base, loras, models_dir):
    clip0 = _clip()
    (models_dir / "text_encoders").mkdir(exist_ok=True)
    save_file(clip0.cond_stage_model.state_dict(), str(models_dir / "text_encoders" / "tiny_clip.safetensors"))
    from comfyui_lora_runtime.standalone.host import folder_paths
    with folder_paths.activated(folder_paths.ModelFolders(models_dir=models_dir, output_dir=models_dir / "out")):
        clip = CLIPLoader().load_clip("tiny_clip.safetensors", "stable_diffusion")[0]
    assert torch.equal(clip.encode(PROMPT)[0][0], clip0.encode(PROMPT)[0][0])
    te, ref = _te_file(clip, layers=(0,))
    save_file(te, str(loras / "te0.safetensors"))
    once = LoadLoraAdapterModelClip().load(base, clip, "te0.safetensors", 1.0, 0.5)["result"][1]
    twice = LoadLoraAdapterModelClip().load(base, once, "te0.safetensors", 1.0, 0.5)["result"][1]
    torch.testing.assert_close(twice.encode(PROMPT)[0][0], _hand_merged(clip, ref, 1.0), rtol=1e-5, atol=1e-5)
    assert len(once.patches[f"{PREFIX}.0.mlp.fc1.weight"]) == 1  # the second load patched a clone


class CaptureCond:
    OUTPUT_NODE = True
    RETURN_TYPES = ()
    FUNCTION = "go"
    seen: list = []

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"conditioning": ("CONDITIONING",)}}

    def go(self, conditioning):
        CaptureCond.seen.append(conditioning[0][0].clone())
        return {"ui": {"n": [1]}}


def test_a_bundled_host_graph_loads_the_clip_applies_the_file_and_encodes(folders, models_dir, loras):
    from comfyui_lora_runtime.standalone.host.executor import execute_prompt
    from testkit.nodes_helpers import CLASSES
    clip = _clip()
    (models_dir / "text_encoders").mkdir(exist_ok=True)
    save_file(clip.cond_stage_model.state_dict(), str(models_dir / "text_encoders" / "tiny_clip.safetensors"))
    te, ref = _te_file(clip)
    save_file(te, str(loras / "te_only.safetensors"))
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": "tiny_clip.safetensors", "type": "stable_diffusion"}},
        "3": {"class_type": "LoraRuntimeLoadAdapterModelClip",
              "inputs": {"model": ["1", 0], "clip": ["2", 0], "lora_name": "te_only.safetensors",
                         "strength_model": 1.0, "strength_clip": 0.6}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": PROMPT, "clip": ["3", 1]}},
        "5": {"class_type": "CaptureCond", "inputs": {"conditioning": ["4", 0]}},
    }
    CaptureCond.seen.clear()
    res = execute_prompt(prompt, {**CLASSES, "CaptureCond": CaptureCond}, folders=folders)
    torch.testing.assert_close(CaptureCond.seen[-1], _hand_merged(clip, ref, 0.6), rtol=1e-5, atol=1e-5)
    assert (CaptureCond.seen[-1] - clip.encode(PROMPT)[0][0]).abs().max() > 1e-3
    assert res.ui["3"]["lora_coverage"][0]["text_encoder_applied_layers"] == 8
