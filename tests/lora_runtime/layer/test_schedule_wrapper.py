"""Per-call adapter factors in the wrapper and the fused sites (issue 12): a scheduled
multiplier is the adapter's runtime scale, a branch is a per-row 0/1 mask. Each numeric
claim against a hand-built reference and against the wrong answer (schedule ignored).
The fused sites: tests/lora_runtime/fusion/test_fusion_schedule.py."""
import pytest
import torch
import torch.nn.functional as F

from comfyui_lora_runtime.lora_runtime import AdaptedLayer, runtime_context
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter

from testkit.fixtures import assert_lossless, lora_pair, reference_forward, truth_fp64

ROWS = 4  # a CFG batch of 2 + 2: negative rows first (cond_or_uncond [1, 0])
POS_ROWS = torch.tensor([0.0, 0.0, 1.0, 1.0])


def _layer(dtype=torch.float32, two=False):
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 48).to(dtype)
    w = AdaptedLayer(lin, "l")
    slots = []
    for name, seed, alpha, strength in (("a", 1, 2.0, 0.7),) + ((("b", 2, 8.0, -0.6),) if two else ()):
        down, up = lora_pair(48, 32, 4, seed, scale=0.3, dtype=dtype)
        w.add_adapter(name, LayerAdapter("l", down, up, alpha=alpha), strength)
        slots.append([down, up, alpha / 4, strength])
    x = torch.randn(ROWS, 5, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    return w, lin, slots, x


def _call(w, x, tier, adapters, scale=1.0):
    with torch.no_grad(), runtime_context(tier=tier, scale=scale, adapters=adapters):
        return w(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unit_factor_is_the_unscheduled_path_bitwise(dtype):
    w, lin, slots, x = _layer(dtype, two=True)
    for tier in ("exact", "lossless", "high"):
        plain = _call(w, x, tier, None)
        assert torch.equal(_call(w, x, tier, {"a": (1.0, None), "b": (1.0, None)}), plain), tier
        assert torch.equal(_call(w, x, tier, {}), plain), tier          # listed nowhere: factor 1
        assert not torch.equal(_call(w, x, tier, {"a": (0.5, None)}), plain), tier  # the factor is live
    assert torch.equal(_call(w, x, "exact", None), reference_forward(x, lin.weight, lin.bias, slots))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scheduled_multiplier_is_the_adapters_runtime_scale(dtype):
    w, lin, slots, x = _layer(dtype, two=True)
    base = F.linear(x, lin.weight, lin.bias)
    # exact: per slot ((x A^T) B^T) * a/r * s * (scale * multiplier), the reference order
    got = _call(w, x, "exact", {"a": (0.5, None), "b": (0.0, None)}, scale=0.6)
    want = reference_forward(x, lin.weight, lin.bias, [slots[0]], runtime_scale=0.6 * 0.5)
    assert torch.equal(got, want)
    ignored = reference_forward(x, lin.weight, lin.bias, slots, runtime_scale=0.6)  # the schedule ignored
    assert not torch.allclose(got.float(), ignored.float(), atol=1e-2)
    # every adapter at 0 this call: the base output, bit for bit, and lora_active says so
    with runtime_context(tier="lossless", adapters={"a": (0.0, None), "b": (0.0, None)}):
        assert not w.lora_active
    assert torch.equal(_call(w, x, "lossless", {"a": (0.0, None), "b": (0.0, None)}), base)
    assert torch.equal(_call(w, x, "exact", {"a": (0.0, None), "b": (0.0, None)}), base)
    # lossless: different factors per adapter in one stacked GEMM pair
    lossless = _call(w, x, "lossless", {"a": (0.5, None), "b": (2.0, None)}, scale=0.6)
    s2 = [[*slots[0][:3], slots[0][3] * 0.5], [*slots[1][:3], slots[1][3] * 2.0]]
    ref = reference_forward(x, lin.weight, lin.bias, s2, runtime_scale=0.6)
    assert_lossless(lossless, ref, truth_fp64(x, lin.weight, lin.bias, s2, 0.6), "per-adapter factors")
    assert not torch.allclose(lossless.float(), ignored.float(), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_positive_only_rows(dtype):
    w, lin, slots, x = _layer(dtype)
    mask = POS_ROWS
    base = F.linear(x, lin.weight, lin.bias)
    full = _call(w, x, "exact", None)
    got = _call(w, x, "exact", {"a": (1.0, mask)})
    # hand-built reference: the reference delta, times the row mask as the last factor
    d = F.linear(F.linear(x, slots[0][0]), slots[0][1]) * slots[0][2] * slots[0][3]
    assert torch.equal(got, base + d * mask.to(dtype).view(-1, 1, 1))
    assert torch.equal(got[2:], full[2:]) and torch.equal(got[:2], base[:2])  # rows: adapter / untouched
    assert not torch.equal(got, full) and not torch.equal(got, base)          # the wrong answers
    for tier in ("lossless", "high"):
        lo = _call(w, x, tier, {"a": (1.0, mask)})
        assert torch.equal(lo[:2], base[:2]), tier  # the other branch's rows get nothing, bit for bit
        assert_lossless(lo[2:], full[2:], truth_fp64(x, lin.weight, lin.bias, slots)[2:], tier)
        assert not torch.allclose(lo[:2].float(), full[:2].float(), atol=1e-2)


def test_rows_flattened_batch_major_and_a_bad_layout():
    w, lin, slots, x = _layer()
    x2 = x.reshape(-1, 32)  # [B*L, D]: a layer that flattens the batch
    got = _call(w, x2, "exact", {"a": (1.0, POS_ROWS)}).reshape(ROWS, 5, 48)
    assert torch.equal(got, _call(w, x, "exact", {"a": (1.0, POS_ROWS)}))
    with pytest.raises(Exception, match="branch to 'both'"):
        _call(w, x[:, :1, :].reshape(ROWS, 32)[:3], "exact", {"a": (1.0, POS_ROWS)})


@pytest.mark.parametrize("tier", ["exact", "lossless"])
def test_conv_and_output_offset_slots_follow_the_factors(tier):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 2, stride=2)
    w = AdaptedLayer(conv, "patch_embedding")
    down, up = lora_pair(8, 12, 2, 5, scale=0.3)  # LoCon: down [r, in * kh * kw]
    w.add_adapter("a", LayerAdapter("patch_embedding", down, up, alpha=2.0), 0.7)
    x = torch.randn(ROWS, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    base, full = conv(x), _call(w, x, tier, None)
    got = _call(w, x, tier, {"a": (1.0, POS_ROWS)})
    assert torch.equal(got[:2], base[:2]) and torch.equal(got[2:], full[2:])
    assert torch.equal(_call(w, x, tier, {"a": (0.5, None)}), _call(w, x, tier, None, scale=0.5))
    assert not torch.equal(got, full) and not torch.equal(_call(w, x, tier, {"a": (0.5, None)}), full)

    lin = torch.nn.Linear(32, 48)
    w = AdaptedLayer(lin, "l")
    w.add_adapter("b", LayerAdapter("l", diff_b=torch.randn(48)), 0.9)   # an output offset only
    x = torch.randn(ROWS, 5, 32)
    base, full = lin(x), _call(w, x, tier, None)
    got = _call(w, x, tier, {"b": (1.0, POS_ROWS)})
    assert torch.equal(got[:2], base[:2]) and torch.equal(got[2:], full[2:]) and not torch.equal(got, full)
    assert torch.equal(_call(w, x, tier, {"b": (0.0, None)}), base)
