"""Where each adapter's scale comes from (lora_runtime/files/scale_sources.py): every source a
real file keeps it in, in the documented precedence, checked on the applied output
against a reference with the intended scale and against the wrong one (the scale the
loader used before: 1.0), and the report says where it came from."""
import json

import pytest
import torch
from safetensors.torch import save_file

from comfyui_lora_runtime.lora_runtime import load_adapter, match_adapter

from testkit.scale_checks import R, X, applied_output as _out, check_scale as _check, expected_output as _expected
from testkit.scale_checks import peft_sd as _peft_sd


def test_peft_folder_adapter_config_json_beside_the_file(model, pairs, tmp_path):
    d = tmp_path / "peft_out"
    d.mkdir()
    save_file(_peft_sd(pairs), str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    (d / "adapter_config.json").write_text(json.dumps({"r": R, "lora_alpha": 16, "peft_type": "LORA"}))
    _check(model, pairs, d / "adapter_model.safetensors", lambda n: 16 / R, X, "adapter_config.json beside")


def test_rslora_scales_by_the_square_root_of_the_rank(model, pairs, tmp_path):
    d = tmp_path / "rs"
    d.mkdir()
    save_file(_peft_sd(pairs), str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"r": R, "lora_alpha": 8, "use_rslora": True}))
    cov = _check(model, pairs, d / "adapter_model.safetensors", lambda n: 8 / R ** 0.5, X, "rsLoRA")
    assert "sqrt" in cov.scale_source


def test_alpha_pattern_and_rank_note(model, pairs, tmp_path):
    cfg = {"r": 8, "lora_alpha": 8, "alpha_pattern": {"ffn.0": 2}}
    p = tmp_path / "pat.safetensors"
    save_file(_peft_sd(pairs), str(p), metadata={"adapter_config": json.dumps({"default": cfg})})
    cov = _check(model, pairs, p, lambda n: (2 if n.endswith("ffn.0") else 8) / R, X, "alpha_pattern")
    assert any("config says rank 8" in n for n in cov.notes)


def test_diffusers_flat_lora_adapter_metadata(model, pairs, tmp_path):
    p = tmp_path / "diffusers.safetensors"
    meta = {"transformer.lora_alpha": 2, "transformer.r": R, "transformer.target_modules": ["q"]}
    save_file(_peft_sd(pairs, "transformer."), str(p), metadata={"lora_adapter_metadata": json.dumps(meta)})
    _check(model, pairs, p, lambda n: 2 / R, X, "lora_adapter_metadata")


def test_per_layer_alpha_tensor_wins_over_the_config(model, pairs, tmp_path):
    sd = {}
    for name, (down, up) in pairs.items():
        stem = "diffusion_model." + name
        sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"] = down.contiguous(), up.contiguous()
        sd[f"{stem}.alpha"] = torch.tensor(1.0)
    p = tmp_path / "kohya_with_config.safetensors"
    save_file(sd, str(p), metadata={"adapter_config": json.dumps({"lora_alpha": 64})})
    _check(model, pairs, p, lambda n: 1.0 / R, X, "per-layer .alpha")


def test_kohya_without_alpha_tensors_ignores_ss_network_alpha_like_kohya_and_comfyui(model, pairs, tmp_path):
    sd = {}
    for name, (down, up) in pairs.items():
        stem = "lora_unet_" + name.replace(".", "_")
        sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"] = down.contiguous(), up.contiguous()
    p = tmp_path / "kohya_no_alpha.safetensors"
    save_file(sd, str(p), metadata={"ss_network_alpha": "1", "ss_network_dim": str(R)})
    got = _out(model, p, X)
    size = got.abs().max()
    assert (got - _expected(model, pairs, lambda n: 1.0, X)).abs().max() < 1e-5 * size  # alpha = rank: scale 1
    assert (got - _expected(model, pairs, lambda n: 1 / R, X)).abs().max() > 1e-2 * size  # not ss_network_alpha
    _, cov = match_adapter(load_adapter(p), model)
    d = cov.to_dict()
    assert "alpha = rank" in d["scale_source"] and any("ss_network_alpha=1" in n for n in d["notes"])


def test_a_config_that_is_not_json_is_an_error_naming_the_file(model, pairs, tmp_path):
    from comfyui_lora_runtime.lora_runtime import LoraRuntimeError
    p = tmp_path / "broken_meta.safetensors"
    save_file(_peft_sd(pairs), str(p), metadata={"adapter_config": "{lora_alpha: 16"})
    with pytest.raises(LoraRuntimeError, match=r"broken_meta.safetensors.*adapter_config.*not valid JSON"):
        load_adapter(p)
