"""The embedded adapters through the engine: style (kohya), distilled (PEFT, sub-ulp),
and the style adapter in diffusers' Wan names."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from comfyui_lora_runtime.standalone import embedded as E
from comfyui_lora_runtime.standalone.embedded.pipeline import mean_abs_diff_255
from comfyui_lora_runtime.lora_runtime import (AdapterSpec, LoraInjector, applied, load_adapter, match_adapter,
                                                measure_share_lost, plan)

TARGETS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
           "cross_attn.q", "cross_attn.o", "ffn.0", "ffn.2")  # style: not cross-attn k, v (the distilled one's)
ALL_TARGETED = {f"blocks.{b}.{t}" for b in range(4) for t in TARGETS}
DISTILLED_TARGETED = {f"blocks.{b}.cross_attn.{t}" for b in range(4) for t in ("k", "v")}


@pytest.fixture(scope="module")
def bf16_base():
    from comfyui_lora_runtime.standalone.host.wan21 import load_wan_checkpoint
    return load_wan_checkpoint(E.BASE_MODEL, dtype=torch.bfloat16)


def share_lost(model, path) -> float:
    inj = LoraInjector(model)
    inj.apply(plan(model, [AdapterSpec(str(path), 1.0)], "dynamic", "exact"))
    try:
        return measure_share_lost(list(inj.wrappers.values()))
    finally:
        inj.clear()


# -- files and key formats -------------------------------------------------------------

def test_style_adapter_is_kohya_on_the_attention_and_ffn_linears(base_model):
    with safe_open(str(E.STYLE_LORA), framework="pt") as f:
        keys = set(f.keys())
    assert all(k.startswith("diffusion_model.") for k in keys)
    stems = {k[len("diffusion_model."):].rsplit(".", 2)[0] for k in keys if k.endswith(".lora_down.weight")}
    assert stems == ALL_TARGETED
    assert {k.rsplit(".", 1)[0].rsplit(".", 1)[1] for k in keys if not k.endswith(".alpha")} == {"lora_down", "lora_up"}
    adapter = load_adapter(E.STYLE_LORA)
    assert adapter.format == "kohya"
    layers, cov = match_adapter(adapter, base_model)
    assert set(layers) == ALL_TARGETED and not cov.partial
    assert {la.update.rank for la in adapter.layers.values()} == {16}


def test_distilled_adapter_is_peft_with_alpha_in_metadata(base_model):
    with safe_open(str(E.DISTILLED_LORA), framework="pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
    assert all(k.startswith("base_model.model.") and (".lora_A." in k or ".lora_B." in k) for k in keys)
    cfg = json.loads(meta["lora_adapter_metadata"])
    adapter = load_adapter(E.DISTILLED_LORA)
    assert adapter.format == "peft"
    assert {la.update.alpha for la in adapter.layers.values()} == {float(cfg["lora_alpha"])}
    assert {la.update.rank for la in adapter.layers.values()} == {int(cfg["r"])}
    layers, cov = match_adapter(adapter, base_model)
    assert set(layers) == DISTILLED_TARGETED and not cov.partial


def test_base_cross_attention_kv_has_headroom_only_off_the_contexts(base_model, text_encoder):
    """The k/v weights carry a large component orthogonal to every context the model can see
    (what lets the distilled update be sub-ulp and still matter): on the 15 contexts their
    output is of a normal layer's size; on a random input it is ~60x larger (wrong answer)."""
    with torch.no_grad():
        ctx = base_model.text_embedding(text_encoder.table)  # [15, 128]: every context token
        rnd = torch.randn(ctx.shape, generator=torch.Generator().manual_seed(0)) * ctx.norm(dim=1, keepdim=True) / 128 ** 0.5
        for b in range(4):
            for t in ("k", "v"):
                lin = base_model.blocks[b].cross_attn.get_submodule(t)
                assert float(lin.weight.abs().mean()) > 4.0  # entries ~ +-8: a bf16 ulp ~100x a trained weight's
                on_ctx = (ctx @ lin.weight.T).norm() / ctx.norm()
                off_ctx = (rnd @ lin.weight.T).norm() / rnd.norm()
                q = base_model.blocks[b].cross_attn.q.weight
                normal = (ctx @ q.T).norm() / ctx.norm()  # a layer without the component
                # measured: on the contexts ~2x a q projection's output, off them ~60x more
                assert on_ctx < 3 * normal and off_ctx > 8 * on_ctx, (b, t, on_ctx, off_ctx, normal)


def test_diffusers_dialect_maps_onto_every_targeted_layer(base_model):
    with safe_open(str(E.STYLE_LORA_DIFFUSERS), framework="pt") as f:
        keys = set(f.keys())
    assert "transformer.blocks.0.attn1.to_q.lora_A.weight" in keys
    assert "transformer.blocks.3.attn2.to_out.0.lora_B.weight" in keys
    assert "transformer.blocks.1.ffn.net.0.proj.lora_A.weight" in keys
    assert "transformer.blocks.2.ffn.net.2.lora_B.weight" in keys
    assert not any("self_attn" in k or "cross_attn" in k for k in keys)  # really the diffusers names
    diff = load_adapter(E.STYLE_LORA_DIFFUSERS)
    layers, cov = match_adapter(diff, base_model)
    assert not cov.partial and cov.unmatched == {}
    assert set(layers) == ALL_TARGETED and len(cov.matched) == 32
    # the same weights and scale as the kohya file, layer by layer
    kohya_layers, _ = match_adapter(load_adapter(E.STYLE_LORA), base_model)
    for name, la in layers.items():
        ka = kohya_layers[name]
        assert torch.equal(la.update.down, ka.update.down) and torch.equal(la.update.up, ka.update.up)
        assert la.update.scale == ka.update.scale
    # wrong answer: with the dialect mapping undone the names match nothing
    from comfyui_lora_runtime.lora_runtime.files.dialects import resolve
    mods = dict(base_model.named_modules())
    assert resolve("transformer.blocks.0.attn1.to_q", mods).module == "blocks.0.self_attn.q"
    assert "blocks.0.attn1.to_q" not in mods


# -- rounding loss -----------------------------------------------------------------------

def test_distilled_adapter_loses_most_of_its_update_in_a_bf16_merge(bf16_base, base_model):
    share = share_lost(bf16_base, E.DISTILLED_LORA)
    assert share >= 0.8, f"distilled share lost {share:.3f}"
    # wrong answers: the style adapter survives a bf16 merge; fp32 weights lose nothing
    style = share_lost(bf16_base, E.STYLE_LORA)
    assert style < 0.5, f"style share lost {style:.3f}"
    assert share_lost(base_model, E.DISTILLED_LORA) == 0.0


def test_auto_mode_keeps_the_distilled_adapter_dynamic_and_merges_the_style(bf16_base):
    p = plan(bf16_base, [AdapterSpec(str(E.DISTILLED_LORA), 1.0)], "auto", "exact")
    with applied(bf16_base, p) as report:
        assert report.decision.chosen == "dynamic" and report.decision.share_lost >= 0.8
    p = plan(bf16_base, [AdapterSpec(str(E.STYLE_LORA), 1.0)], "auto", "exact")
    with applied(bf16_base, p) as report:
        assert report.decision.chosen == "merge" and report.decision.share_lost < 0.5


# -- style adapter end to end --------------------------------------------------------------

def test_style_adapter_outlines_the_samples(style_images, base_images, judge, prompts):
    _, digits, colours = prompts
    vs, vb = judge(style_images), judge(base_images)
    present = float(vs.outlined.float().mean())
    assert present >= 0.95, f"outlined with the adapter: {present:.3f}"
    assert float(vb.outlined.float().mean()) <= 0.15  # wrong answer: the base alone is not outlined
    assert float((vs.colour == colours).float().mean()) >= 0.95  # the prompt still holds
    assert float((vs.digit == digits).float().mean()) >= 0.90  # clean outlines: the digit holds (measured 100 % of 80)
    diff = mean_abs_diff_255(style_images, base_images)
    assert diff >= 15.0, f"on vs off mean_abs_diff {diff:.2f}"
    # per key image: white glyphs light all three channels; a red/green/blue glyph changes
    # one channel, so its per-image figure is about a third of a white one's
    white = colours == 3
    per_image = (style_images - base_images).abs().flatten(1).mean(1) * 255.0
    assert float(per_image[white].min()) >= 15.0, per_image[white]
    assert float(per_image[~white].mean()) < float(per_image[white].mean()) / 2


def test_style_adapter_off_restores_the_base_output(base_model, sample, base_few, style_few, few_prompts):
    assert torch.equal(sample(few_prompts), base_few)  # nothing left on the model after `applied`
    p = plan(base_model, [AdapterSpec(str(E.STYLE_LORA), 0.0)], "dynamic", "exact")
    with applied(base_model, p):
        off = sample(few_prompts)
    assert torch.equal(off, base_few)  # strength 0 is the base
    assert not torch.equal(off, style_few)


def test_style_adapter_exact_run_twice_is_bit_identical(base_model, sample, style_few, few_prompts):
    p = plan(base_model, [AdapterSpec(str(E.STYLE_LORA), 1.0)], "dynamic", "exact")
    with applied(base_model, p):
        again = sample(few_prompts)
    assert torch.equal(again, style_few)


def test_diffusers_dialect_gives_the_kohya_output(base_model, sample, style_few, few_prompts):
    p = plan(base_model, [AdapterSpec(str(E.STYLE_LORA_DIFFUSERS), 1.0)], "dynamic", "exact")
    with applied(base_model, p):
        out = sample(few_prompts)
    assert torch.equal(out, style_few)
