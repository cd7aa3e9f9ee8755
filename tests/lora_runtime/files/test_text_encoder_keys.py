"""Text-encoder keys (kohya lora_te_/lora_te1_/lora_te2_, diffusers text_encoder./
text_encoder_2.) in a model LoRA are their own class: the model part is applied (bit for
bit what the same file without them gives), the report counts them as text-encoder layers
and tensors, never as "no such layer"; a file holding only them is refused saying so; the
family guess ignores them. Files built here at test time."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_lora_runtime.lora_runtime import (AdapterMatchError, AdapterSpec, applied, load_adapter,
                                               match_adapter, plan)
from comfyui_lora_runtime.lora_runtime.files.header_check import check_adapter_file

from testkit.fixtures import TinyWanLike, make_adapter_tensors, write_kohya

X = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))


def _te_tensors(n_kohya=4, n_diffusers=2):
    g = torch.Generator().manual_seed(5)
    t = {}
    for i in range(n_kohya):  # 3 tensors each: down, up, alpha
        stem = f"lora_te{1 + i % 2}_text_model_encoder_layers_{i}_self_attn_q_proj"
        t[f"{stem}.lora_down.weight"] = torch.randn(4, 768, generator=g)
        t[f"{stem}.lora_up.weight"] = torch.randn(768, 4, generator=g)
        t[f"{stem}.alpha"] = torch.tensor(4.0)
    for i in range(n_diffusers):  # 2 tensors each
        stem = f"text_encoder_2.text_model.encoder.layers.{i}.mlp.fc1"
        t[f"{stem}.lora_A.weight"] = torch.randn(4, 1280, generator=g)
        t[f"{stem}.lora_B.weight"] = torch.randn(5120, 4, generator=g)
    return t  # 6 layers, 16 tensors


@pytest.fixture
def model():
    return TinyWanLike(dtype=torch.float32)


def _out(model, path, mode="dynamic"):
    with torch.no_grad(), applied(model, plan(model, [AdapterSpec(str(path))], mode, "exact"), fusion_backend=None):
        return model(X)


@pytest.mark.parametrize("mode", ["dynamic", "merge"])
def test_the_model_part_is_applied_and_the_text_encoder_part_reported(model, tmp_path, mode):
    pairs = make_adapter_tensors(model, r=4, seed=2, scale=0.3)
    write_kohya(tmp_path / "model_only.safetensors", pairs, alpha=2.0)
    both = {**load_file(str(tmp_path / "model_only.safetensors")), **_te_tensors()}
    save_file(both, str(tmp_path / "with_te.safetensors"))
    snap = {k: v.clone() for k, v in model.state_dict().items()}
    base = model(X)
    got = _out(model, tmp_path / "with_te.safetensors", mode)          # default: unmatched keys are an error
    want = _out(model, tmp_path / "model_only.safetensors", mode)
    assert torch.equal(got, want) and not torch.equal(got, base)
    assert all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())
    _, cov = match_adapter(load_adapter(tmp_path / "with_te.safetensors"), model)
    d = cov.to_dict()
    assert d["unmatched"] == 0 and d["text_encoder_layers"] == 6 and d["text_encoder_tensors"] == 16
    assert d["file_layers"] == len(pairs) and d["keys_total"] == 3 * len(pairs) + 16
    assert "6 text-encoder layers (16 tensors) not applied: this node patches the model only" in d["notes"]
    assert "no such layer" not in cov.summary() and "6 text-encoder layers (16 tensors)" in cov.summary()
    assert d["scale_source"] == f"per-layer .alpha tensors ({len(pairs)} layers)", d["scale_source"]  # model layers


def test_a_file_with_only_text_encoder_keys_is_refused_saying_so(model, tmp_path):
    p = tmp_path / "te_only.safetensors"
    save_file(_te_tensors(), str(p))
    snap = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(AdapterMatchError) as e:
        _out(model, p, "merge")
    msg = str(e.value)
    assert "te_only.safetensors" in msg and "only text-encoder weights (6 layers, 16 tensors" in msg
    assert "looks like an adapter for" not in msg and "no such layer" not in msg
    assert all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())
    header = check_adapter_file(p)   # the same refusal when the prompt is validated
    assert "te_only.safetensors" in header and "only text-encoder weights (6 layers, 16 tensors" in header


def test_the_family_guess_ignores_text_encoder_keys(model, tmp_path):
    """A Flux LoRA with more text-encoder layers than model layers is still named a Flux adapter."""
    t = {f"lora_unet_double_blocks_{i}_img_attn_qkv.lora_down.weight": torch.zeros(2, 8) for i in range(2)}
    t.update({f"lora_unet_double_blocks_{i}_img_attn_qkv.lora_up.weight": torch.zeros(8, 2) for i in range(2)})
    t.update(_te_tensors())
    p = tmp_path / "flux_with_te.safetensors"
    save_file(t, str(p))
    with pytest.raises(AdapterMatchError, match=r"flux_with_te.safetensors.*look like an adapter for Flux"):
        match_adapter(load_adapter(p), model)


def test_unmatched_counts_name_layers_and_tensors_separately(model, tmp_path):
    pairs = make_adapter_tensors(model, r=2, seed=2, only=["ffn"])
    sd = {}
    for name, (dn, up) in pairs.items():
        sd[f"diffusion_model.{name}.lora_down.weight"], sd[f"diffusion_model.{name}.lora_up.weight"] = dn, up
        sd[f"diffusion_model.{name}.alpha"] = torch.tensor(2.0)
    sd["diffusion_model.blocks.7.ffn.0.lora_down.weight"] = torch.zeros(2, 32)
    sd["diffusion_model.blocks.7.ffn.0.lora_up.weight"] = torch.zeros(64, 2)
    sd["diffusion_model.blocks.7.ffn.0.alpha"] = torch.tensor(2.0)
    p = tmp_path / "partial.safetensors"
    save_file(sd, str(p))
    with pytest.raises(AdapterMatchError, match=r"1 layers or keys \(3 tensors\) would not be applied"):
        match_adapter(load_adapter(p), model)
    _, cov = match_adapter(load_adapter(p), model, lenient=True)
    assert cov.to_dict()["unmatched_tensors"] == 3 and "1 layers or keys (3 tensors) not loaded" in cov.summary()
