"""Merges per tier (contracts.md s.1 and s.3): `exact` applies scale then strength, one after
the other, bit for bit; `lossless`/`high` apply their product in one pass after the GEMM
(ComfyUI's order: its merge's bits) and stay within the lossless contract against an fp64
ground truth.
Either way the restore is bit-exact, copy and lean write the same bits, and a restore after
the tier changed recomputes what its merge used."""
import pytest
import torch

from comfyui_lora_runtime.lora_runtime import AdapterSpec, LoraInjector, AdaptedLayer, plan
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
from comfyui_lora_runtime.lora_runtime.settings import Tier

from testkit.fixtures import TinyWanLike, make_adapter_tensors, write_kohya

ALPHA, RANK, STRENGTH = 12.0, 16, 0.7   # scale 0.75: neither factor is a power of two


def _wrapped(dtype, tier, copy=False, seed=0, out_f=384, in_f=256):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g) / in_f ** 0.5)
    lin = lin.to(dtype)
    down = (torch.randn(RANK, in_f, generator=g) / in_f ** 0.5).to(torch.bfloat16)
    up = (torch.randn(out_f, RANK, generator=g) * 0.05).to(torch.bfloat16)
    w = AdaptedLayer(lin, "layer")
    w.add_adapter("a", LayerAdapter("layer", down=down, up=up, alpha=ALPHA), STRENGTH)
    w.merge_tier, w.restore_copy = tier, copy
    return w, down.float(), up.float()


def _errors(merged, truth):
    e = merged.double() - truth
    return e.pow(2).mean().sqrt().item(), e.abs().max().item(), e.mean().abs().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_merge_applies_scale_then_strength(dtype):
    w, down, up = _wrapped(dtype, Tier.EXACT)
    before = w.weight.detach().clone()
    expected = (before.float() + (up @ down).mul(ALPHA / RANK).mul(STRENGTH)).to(dtype)
    w.merge()
    assert torch.equal(w.weight, expected) and not torch.equal(w.weight, before)
    w.unmerge()
    assert torch.equal(w.weight, before)


@pytest.mark.parametrize("tier", [Tier.LOSSLESS, Tier.HIGH])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_folded_merge_is_one_product_within_the_lossless_contract(dtype, tier):
    w, down, up = _wrapped(dtype, tier)
    ref, _, _ = _wrapped(dtype, Tier.EXACT)
    before = w.weight.detach().clone()
    s = ALPHA / RANK * STRENGTH
    w.merge()
    ref.merge()
    folded = (before.float() + (up @ down) * s).to(dtype)
    assert torch.equal(w.weight, folded)                          # one pass with the product
    truth = before.double() + (up.double() @ down.double()) * s   # fp64 ground truth
    rms, mx, mean = _errors(w.weight, truth)
    rms_ref, mx_ref, _ = _errors(ref.weight, truth)
    assert rms <= 1.5 * rms_ref and mx <= 1.5 * mx_ref and mean <= 0.25 * rms_ref, (rms, rms_ref, mx, mx_ref)
    base_rms, _, _ = _errors(before, truth)                        # the wrong answer: the update left out
    assert rms < 0.05 * base_rms, (rms, base_rms)
    if dtype == torch.float32:
        assert not torch.equal(w.weight, ref.weight)               # it did fold: other fp32 bits than exact
    w.unmerge()
    assert torch.equal(w.weight, before)


@pytest.mark.parametrize("tier", [Tier.EXACT, Tier.LOSSLESS])
def test_copy_and_lean_write_the_same_bits_in_each_tier(tier):
    lean, _, _ = _wrapped(torch.bfloat16, tier)
    copy, _, _ = _wrapped(torch.bfloat16, tier, copy=True)
    before = lean.weight.detach().clone()
    lean.merge()
    copy.merge()
    assert torch.equal(lean.weight, copy.weight) and not torch.equal(lean.weight, before)
    lean.unmerge()
    copy.unmerge()
    assert torch.equal(lean.weight, before) and torch.equal(copy.weight, before)


@pytest.mark.parametrize("first,then", [(Tier.LOSSLESS, Tier.EXACT), (Tier.EXACT, Tier.LOSSLESS)])
def test_restore_recomputes_the_delta_its_merge_used(first, then):
    """A tier change between merge and restore: the restore still uses the merge's order
    (with the other order the lean record would not restore bit for bit: the fingerprint
    check would raise)."""
    w, _, _ = _wrapped(torch.float32, first, seed=3)
    before = w.weight.detach().clone()
    w.merge()
    w.merge_tier = then
    w.unmerge()
    assert torch.equal(w.weight, before)


def test_the_injector_merges_in_the_plans_tier(tmp_path):
    ref = TinyWanLike()
    path = write_kohya(tmp_path / "a.safetensors", make_adapter_tensors(ref, r=4, seed=1, scale=0.3), alpha=3.0)
    merged = {}
    for tier in ("exact", "lossless"):
        model = TinyWanLike()
        snap = {k: v.clone() for k, v in model.state_dict().items()}
        inj = LoraInjector(model)
        inj.apply(plan(model, [AdapterSpec(str(path), 0.7)], "merge", tier=tier))
        assert all(w.merge_tier is Tier(tier) and w.merge_state.folded == (tier != "exact") for w in inj.wrappers.values())
        merged[tier] = {k: v.clone() for k, v in model.state_dict().items()}
        inj.clear()
        assert all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())
    name = "blocks.0.ffn.0.weight"
    assert not torch.equal(merged["exact"][name], snap[name])
    assert torch.allclose(merged["lossless"][name], merged["exact"][name], rtol=1e-5, atol=1e-6)
