"""Adapters written by diffusers' own save function (``WanLoraLoaderMixin.save_lora_weights``:
``transformer.``-prefixed diffusers module names, PEFT ``lora_A``/``lora_B`` keys, the PEFT
config in the header's ``lora_adapter_metadata``) load onto the native (ComfyUI) Wan names
and give PEFT's own layer outputs within fp32 rounding; the wrong answers (adapter off,
the header's alpha ignored: scale 1.0) are far. diffusers and PEFT are test-only
dependencies; the pack never imports them."""
import copy

import pytest
import torch
from safetensors import safe_open
from torch import nn

from comfyui_lora_runtime.lora_runtime import AdapterSpec, applied, plan

from testkit.hf_imports import hf_import
from testkit.fixtures import TinyWanLike, linear_names, wan_native_to_diffusers

peft = hf_import("peft", reason="peft is a test dependency: pip install -e '.[test]'")
diffusers_loaders = hf_import("diffusers.loaders", reason="diffusers is a test dependency")


def _diffusers_named(native: TinyWanLike) -> nn.Module:
    """An nn.Module tree with diffusers' Wan module names holding the native model's Linears."""
    root = nn.Module()
    for name in linear_names(native):
        parts = wan_native_to_diffusers(name).split(".")
        mod = root
        for p in parts[:-1]:
            if not hasattr(mod, p):
                mod.add_module(p, nn.Module())
            mod = getattr(mod, p)
        mod.add_module(parts[-1], copy.deepcopy(native.get_submodule(name)))
    return root


@pytest.mark.parametrize("cfg", [dict(r=4, lora_alpha=12), dict(r=8, lora_alpha=8, use_rslora=True)],
                         ids=["alpha_ne_r", "rslora"])
def test_diffusers_save_lora_weights_file(tmp_path, cfg):
    native = TinyWanLike()
    dnamed = _diffusers_named(native)
    targets = ["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2", "proj_out"]
    config = peft.LoraConfig(target_modules=targets, init_lora_weights=False, **cfg)
    pm = peft.get_peft_model(dnamed, config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, prm in pm.named_parameters():
            if "lora_" in n:
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.2)
    sd = peft.get_peft_model_state_dict(pm)
    diffusers_loaders.WanLoraLoaderMixin.save_lora_weights(
        str(tmp_path), transformer_lora_layers=sd, transformer_lora_adapter_metadata=config.to_dict())
    path = tmp_path / "pytorch_lora_weights.safetensors"
    with safe_open(str(path), "pt") as f:  # what diffusers wrote: transformer.-prefixed keys + header config
        keys = list(f.keys())
        meta = f.metadata()
    assert all(k.startswith("transformer.") for k in keys) and any(".attn1.to_q." in k for k in keys)
    assert "lora_adapter_metadata" in meta

    xs = {k: torch.randn(3, k, generator=torch.Generator().manual_seed(k)) for k in (32, 64)}
    names = linear_names(native)
    model = copy.deepcopy(native)

    def run(root, name_of):
        return {n: root.get_submodule(name_of(n))(xs[native.get_submodule(n).in_features]) for n in names}

    with torch.no_grad():
        theirs = run(pm.base_model.model, wan_native_to_diffusers)
        off = run(native, str)
        with applied(model, plan(model, [AdapterSpec(str(path))], "dynamic", "lossless"),
                     fusion_backend=None) as rep:
            assert rep.coverage[0].applied_layers == rep.coverage[0].file_layers == len(names)
            assert "lora_adapter_metadata" in rep.coverage[0].scale_source
            ours = run(model, str)
    scale = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg.get("use_rslora") else cfg["r"])
    for n in names:
        size = theirs[n].abs().max()
        assert float((ours[n] - theirs[n]).abs().max() / size) < 2e-6, n
        assert float((off[n] - theirs[n]).abs().max() / size) > 1e-2, n
        # the wrong answer of ignoring the header's config: scale 1.0 instead of alpha/r (alpha/sqrt(r))
        wrong = off[n] + (ours[n] - off[n]) / scale
        assert float((wrong - theirs[n]).abs().max() / size) > 1e-2, n
