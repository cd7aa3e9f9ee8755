"""A forced bf16 merge of the distilled adapter loses most of its effect on the output;
the style adapter's survives. Measured on sampled latents against the fp32 reference
(fp32 weights, adapter dynamic, exact tier)."""
from pathlib import Path

import pytest
import torch

from comfyui_lora_runtime.lora_runtime import AdapterSpec, applied, plan

ROOT = Path(__file__).resolve().parents[2]
from comfyui_lora_runtime.standalone.embedded import require_committed_weights

require_committed_weights()  # a checkout without them fails here, never skips

from comfyui_lora_runtime.standalone.embedded import BASE_MODEL, DISTILLED_LORA, STYLE_LORA, TEXT_ENCODER  # noqa: E402
from comfyui_lora_runtime.standalone.embedded.text_encoder import TinyTextEncoder  # noqa: E402
from comfyui_lora_runtime.standalone.host.sampling import ksampler  # noqa: E402
from comfyui_lora_runtime.standalone.host.wan21 import load_wan_checkpoint  # noqa: E402

PROMPTS = [f"{c} {d}" for c in ("red", "green", "blue", "white") for d in (0, 3, 7)]


def _sample(model, cfg):
    te = TinyTextEncoder.load(TEXT_ENCODER)
    with torch.no_grad():
        return ksampler(model, seed=7, steps=20, cfg=cfg, sampler_name="euler", scheduler="simple",
                        positive=[[te.encode_batch(PROMPTS), {}]], negative=[[te.encode(""), {}]],
                        latent={"samples": torch.zeros(len(PROMPTS), 16, 1, 8, 8)})["samples"]


def _effect_lost(lora, cfg):
    spec = [AdapterSpec(str(lora))]
    m32 = load_wan_checkpoint(BASE_MODEL, dtype=torch.float32)
    off = _sample(m32, cfg)
    with applied(m32, plan(m32, spec, "dynamic", "exact"), fusion_backend=None):
        ref = _sample(m32, cfg)
    m16 = load_wan_checkpoint(BASE_MODEL, dtype=torch.bfloat16)
    with applied(m16, plan(m16, spec, "merge", "exact"), fusion_backend=None) as rep:
        assert rep.decision.chosen == "merge"
        merged_sd = {k.replace(".base_layer", ""): v.float().clone() for k, v in m16.state_dict().items()}
    mm = load_wan_checkpoint(BASE_MODEL, dtype=torch.float32)
    mm.load_state_dict(merged_sd)
    merged = _sample(mm, cfg)
    effect = (ref - off).norm()
    assert effect > 1e-3 * off.norm()  # the adapter really does something
    return ((merged - ref).norm() / effect).item()


def test_forced_merge_loses_most_of_the_distilled_effect():
    assert _effect_lost(DISTILLED_LORA, cfg=1.0) >= 0.5  # measured 0.85


def test_forced_merge_keeps_the_style_effect():
    assert _effect_lost(STYLE_LORA, cfg=5.0) < 0.05  # measured 0.003
