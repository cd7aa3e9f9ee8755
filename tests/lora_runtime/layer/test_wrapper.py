"""The wrapper: reads through to the wrapped layer, knows its live state, stacks adapters."""
import pytest
import torch
import torch.nn.functional as F

from comfyui_lora_runtime.lora_runtime import AdaptedLayer, runtime_context
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter

from testkit.fixtures import assert_lossless, lora_pair, reference_forward, truth_fp64


class CastLinear(torch.nn.Linear):
    """Stands in for ComfyUI's cast Linear: extra attributes a guard may read."""
    comfy_cast_weights = True
    weight_function = []
    bias_function = []


def test_reads_through_to_the_wrapped_layer():
    lin = CastLinear(8, 6)
    lin.some_flag = "x"
    w = AdaptedLayer(lin, "blocks.0.ffn.0")
    assert w.weight is lin.weight and w.bias is lin.bias
    assert w.in_features == 8 and w.out_features == 6
    assert w.comfy_cast_weights is True and w.some_flag == "x"
    assert w.get_base_layer() is lin
    outer = AdaptedLayer(w, "outer")
    assert outer.get_base_layer() is lin and outer.weight is lin.weight
    with pytest.raises(AttributeError):
        w.not_there


def test_lora_active_follows_live_state():
    lin = torch.nn.Linear(8, 6)
    w = AdaptedLayer(lin, "l")
    assert not w.lora_active
    la = LayerAdapter("l", *lora_pair(6, 8, 2, 0))
    w.add_adapter("a", la, 1.0)
    assert w.lora_active
    w.set_enabled("a", False)
    assert not w.lora_active
    w.set_enabled("a", True)
    w.set_strength("a", 0.0)
    assert not w.lora_active
    w.set_strength("a", 0.5)
    w.merge()
    assert not w.lora_active  # merged, no output offset: the weight holds the update
    w.unmerge()
    off = LayerAdapter("l", diff_b=torch.ones(6))
    w.add_adapter("offset", off, 1.0)
    w.merge()
    assert w.lora_active and w.has_output_offset  # diff_b is never folded into the weight
    with runtime_context(scale=0.0):
        assert not w.lora_active
    w.unmerge()


def test_output_offset_is_added_even_when_merged():
    lin = torch.nn.Linear(8, 6)
    w = AdaptedLayer(lin, "l")
    off = torch.randn(6)
    w.add_adapter("o", LayerAdapter("l", diff_b=off), 0.5)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(w(x), lin(x) + off * 0.5)
        w.merge()
        assert torch.equal(w(x), lin(x) + off * 0.5)
        w.unmerge()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strengths", [(1.0, 1.0), (0.7, -0.4)])
def test_several_adapters_in_one_stacked_gemm_pair(dtype, strengths):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96).to(dtype)
    w = AdaptedLayer(lin, "l")
    # realistic update size (delta ~ a few % of the output) and enough elements that the
    # RMS/max statistics of the error are stable; a delta as large as the base output makes
    # the error a function of a handful of roundings of x A^T.
    pairs = [lora_pair(96, 64, r, 10 + r, 0.12, dtype) for r in (4, 8, 16)]
    alphas = [4.0, None, 8.0]
    ss = [strengths[0], strengths[1], 1.0]
    for i, ((d, u), a, s) in enumerate(zip(pairs, alphas, ss)):
        w.add_adapter(f"a{i}", LayerAdapter("l", down=d, up=u, alpha=a), s)
    slots = [(d, u, (a or d.shape[0]) / d.shape[0], s) for (d, u), a, s in zip(pairs, alphas, ss)]
    x = torch.randn(4, 64, 64).to(dtype)
    ref = reference_forward(x, lin.weight, lin.bias, slots)
    with torch.no_grad(), runtime_context(tier="lossless"):
        y = w(x)
    assert_lossless(y, ref, truth_fp64(x, lin.weight, lin.bias, slots), f"{dtype} {strengths}")
    # wrong answers: base only, and any one adapter dropped
    base = lin(x)
    delta = (ref - base).abs().mean()
    assert (y - base).abs().mean() > 0.5 * delta
    for k in range(3):
        partial = reference_forward(x, lin.weight, lin.bias, slots[:k] + slots[k + 1:])
        assert (y.float() - partial.float()).abs().max() > 10 * (y.float() - ref.float()).abs().max()


def test_disable_one_of_two():
    lin = torch.nn.Linear(16, 16)
    w = AdaptedLayer(lin, "l")
    (d1, u1), (d2, u2) = lora_pair(16, 16, 2, 1), lora_pair(16, 16, 2, 2)
    w.add_adapter("a", LayerAdapter("l", down=d1, up=u1), 1.0)
    w.add_adapter("b", LayerAdapter("l", down=d2, up=u2), 1.0)
    w.set_enabled("a", False)
    x = torch.randn(4, 16)
    with torch.no_grad(), runtime_context(tier="exact"):
        assert torch.equal(w(x), reference_forward(x, lin.weight, lin.bias, [(d2, u2, 1.0, 1.0)]))


def test_diff_and_dora_dynamic_equal_their_merge():
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 24).double()
    w = AdaptedLayer(lin, "l")
    d, u = lora_pair(24, 32, 4, 3, 0.3)
    diff = torch.randn(24, 32) * 0.01
    mag = lin.weight.detach().float().norm(dim=1, keepdim=True) * 1.1
    w.add_adapter("dora", LayerAdapter("l", down=d, up=u, alpha=2.0, dora_scale=mag), 0.8)
    w.add_adapter("diff", LayerAdapter("l", diff=diff), 0.5)
    x = torch.randn(5, 32).double()
    # ground truth by hand: DoRA weight, then strength blend; plus the diff
    W = lin.weight.detach()
    wc = W + (u.double() @ d.double()) * 0.5
    wd = wc * (mag.double() / wc.norm(dim=1, keepdim=True))
    W_new = W + 0.8 * (wd - W) + 0.5 * diff.double()
    truth = F.linear(x, W_new, lin.bias)
    with torch.no_grad(), runtime_context(tier="exact"):
        y = w(x)
        w.merge()
        ym = w(x)
        w.unmerge()
    assert torch.allclose(y, truth, atol=1e-5)  # fp32 delta math on an fp64 layer
    assert torch.allclose(ym, truth, atol=1e-5)
    assert not torch.allclose(y, lin(x), atol=1e-3)


def test_state_changes_while_merged_are_refused():
    w = AdaptedLayer(torch.nn.Linear(4, 4), "l")
    w.add_adapter("a", LayerAdapter("l", *lora_pair(4, 4, 1, 0)), 1.0)
    w.merge()
    with pytest.raises(RuntimeError, match="unmerge before"):
        w.set_strength("a", 0.5)
    w.unmerge()


@pytest.mark.parametrize("tier", ["exact", "lossless"])
def test_autograd_path_equals_inference_path_and_backprops(tier):
    """In-place accumulation is used only outside autograd; with grad on, the same bits and a gradient."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 12)
    w = AdaptedLayer(lin, "l")
    d, u = lora_pair(12, 16, 4, 1, 0.3)
    w.add_adapter("a", LayerAdapter("l", down=d, up=u, alpha=2.0), 0.7)
    w.add_adapter("b", LayerAdapter("l", diff=torch.randn(12, 16) * 0.1), 0.5)
    x = torch.randn(3, 16)
    with runtime_context(tier=tier, scale=0.6):
        with torch.no_grad():
            y0 = w(x)
        y1 = w(x)
    assert torch.equal(y0, y1)
    y1.sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
