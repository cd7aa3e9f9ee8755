"""Adapters written by PEFT itself (`save_pretrained`: adapter_model.safetensors +
adapter_config.json beside it): our applied output equals PEFT's own forward within
fp32 rounding, for alpha != r, rsLoRA, rank/alpha patterns and DoRA, and differs from
the wrong answers (adapter off; scale 1.0, what the loader applied before it read the
config). PEFT is a test-only dependency; the pack never imports it."""
import copy

import pytest
import torch

from comfyui_lora_runtime.lora_runtime import AdapterSpec, applied, plan

from testkit.hf_imports import hf_import
from testkit.fixtures import TinyWanLike

peft = hf_import("peft", reason="peft is a test dependency: pip install -e '.[test]'")

X = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(5))
TARGETS = ["q", "k", "v", "o", "ffn.0", "ffn.2"]

CASES = {
    "alpha_ne_r": dict(r=8, lora_alpha=32),
    "rslora": dict(r=8, lora_alpha=16, use_rslora=True),
    "patterns": dict(r=8, lora_alpha=8, rank_pattern={"ffn.0": 4}, alpha_pattern={"ffn.0": 2, "o": 24}),
    "dora": dict(r=4, lora_alpha=8, use_dora=True),
}


def _peft_model(base, cfg):
    config = peft.LoraConfig(target_modules=TARGETS, init_lora_weights=False, **cfg)
    pm = peft.get_peft_model(copy.deepcopy(base), config)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # visible, non-trivial adapter weights (init_lora_weights=False is random too)
        for n, prm in pm.named_parameters():
            if "lora_" in n:
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.2)
            if "lora_magnitude_vector" in n:
                prm.mul_(1.0 + 0.1 * torch.randn(prm.shape, generator=g))
    return pm.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_ours_equals_peft_on_its_own_files(tmp_path, case):
    base = TinyWanLike(dtype=torch.float32)
    pm = _peft_model(base, CASES[case])
    pm.save_pretrained(str(tmp_path / case))
    path = tmp_path / case / "adapter_model.safetensors"
    assert path.is_file() and (tmp_path / case / "adapter_config.json").is_file()
    with torch.no_grad():
        theirs = pm(X)
        off = base(X)
        model = copy.deepcopy(base)
        for tier in ("exact", "lossless"):
            with applied(model, plan(model, [AdapterSpec(str(path))], "dynamic", tier), fusion_backend=None):
                ours = model(X)
            size = theirs.abs().max()
            err = float((ours - theirs).abs().max() / size)
            assert err < 2e-6, (case, tier, err)                       # fp32 rounding
            assert float((off - theirs).abs().max() / size) > 1e-2     # the adapter matters
    if case != "dora":  # the scale the loader applied before it read adapter_config.json: 1.0
        import json
        cfg = json.loads((tmp_path / case / "adapter_config.json").read_text())
        cfg.update(lora_alpha=cfg["r"], use_rslora=False, alpha_pattern={}, rank_pattern={})
        (tmp_path / case / "adapter_config.json").write_text(json.dumps(cfg))
        with torch.no_grad(), applied(model, plan(model, [AdapterSpec(str(path))], "dynamic", "exact"),
                                      fusion_backend=None):
            wrong = model(X)
        assert float((wrong - theirs).abs().max() / theirs.abs().max()) > 1e-3, case
