"""The engine on quantized bases: real comfy-kitchen ``QuantizedTensor`` weights in ComfyUI 0.33's
layer shape (the bundled host's `QuantLinear`: not an ``nn.Linear``, a cast with
``weight_function`` patches), in every mode, and a host path that skips a layer's forward.

References: the ideal float result (the dequantized weights as plain float weights, the same
adapter on them) and the base alone (the wrong answer)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("comfy_kitchen")

from comfyui_lora_runtime.standalone.host import quant_checkpoints, quant_ops  # noqa: E402
from comfyui_lora_runtime.lora_runtime import applied, plan  # noqa: E402
from comfyui_lora_runtime.lora_runtime.intent import AdapterSpec  # noqa: E402
from comfyui_lora_runtime.lora_runtime.decision import estimate  # noqa: E402
from comfyui_lora_runtime.lora_runtime.errors import LoraRuntimeError, MergeRefusedError  # noqa: E402
from comfyui_lora_runtime.lora_runtime.files.match import target_kind  # noqa: E402
from comfyui_lora_runtime.lora_runtime.layer import ran_guard  # noqa: E402
from comfyui_lora_runtime.lora_runtime.layer.base_weight import adapter_kind, base_weight  # noqa: E402
from comfyui_lora_runtime.lora_runtime.layer.wrapper import attached_wrapper  # noqa: E402
from comfyui_lora_runtime.lora_runtime.layer.schedule import Branch  # noqa: E402
from testkit.fixtures import TinyWanLike, lora_pair, write_kohya  # noqa: E402

# (layout, its options, model width): every layout ComfyUI 0.33 loads that quantizes on a CPU; the
# 4-bit convrot layouts rotate groups of 256 input columns, so their model is 256 wide. "scaled_fp8":
# a legacy scaled-fp8 state dict (per-layer scale_weight, a scaled_fp8 marker) loaded as ComfyUI 0.33
# loads it, into its float8_e4m3fn layout (ComfyUI's "TensorCoreFP8E4M3Layout" class)
LEGACY = "TensorCoreFP8E4M3Layout"
LAYOUTS = [
    pytest.param(("TensorCoreFP8Layout", {}, 64), id="float8_e4m3fn"),
    pytest.param((LEGACY, {"legacy": True}, 64), id="scaled_fp8"),
    pytest.param(("TensorCoreFP8Layout", {"dtype": torch.float8_e5m2}, 64), id="float8_e5m2"),
    pytest.param(("TensorWiseINT8Layout", {}, 64), id="int8_tensorwise"),
    pytest.param(("TensorCoreMXFP8Layout", {}, 64), id="mxfp8"),
    pytest.param(("TensorCoreNVFP4Layout", {}, 64), id="nvfp4"),
    pytest.param(("TensorCoreConvRotW4A4Layout", {}, 256), id="convrot_w4a4"),
    pytest.param(("AsymW4A8Int8Layout", {}, 256), id="asym_w4a8_int8"),
]
D, F_, R, ALPHA = 64, 128, 4, 4.0
_PLAIN = {}


def _quantized(layout):
    name, kwargs, width = layout
    if width not in _PLAIN:
        _PLAIN[width] = TinyWanLike(d=width, f=2 * width, n=2, dtype=torch.float32, seed=3)
    plain = _PLAIN[width]
    if kwargs.get("legacy"):
        return plain, _legacy_scaled_fp8(plain), width
    return plain, quant_checkpoints.quantize_model(plain, name, min_numel=1, **kwargs), width


def _legacy_scaled_fp8(plain):
    """`plain` with its Linears stored as a legacy scaled-fp8 file stores them (fp8 weight, fp32
    ``scale_weight``, an empty ``scaled_fp8`` marker) and loaded through ComfyUI 0.33's conversion
    (`convert_old_quants`: float8_e4m3fn comfy_quant layers)."""
    fp8 = quant_checkpoints.quantize_model(plain, LEGACY, min_numel=1, scale="recalculate")
    sd = {}
    for k, v in fp8.state_dict().items():
        if k.endswith(".comfy_quant"):
            continue
        sd[k[: -len("weight_scale")] + "scale_weight" if k.endswith(".weight_scale") else k] = v
    sd["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    q = quant_checkpoints.load_quantized_state_dict(copy.deepcopy(plain), quant_checkpoints.convert_old_quants(sd))
    layers = quant_checkpoints.quantized_layers(q)
    assert layers and all(m.quant_format == "float8_e4m3fn" and m.layout_type == LEGACY for m in layers.values())
    return q


def _stored(model):
    """Every quantized weight's stored bytes and scales (cloned), by layer."""
    out = {}
    for n, m in quant_checkpoints.quantized_layers(model).items():
        w = m.weight
        out[n] = [w._qdata.clone()] + [v.clone() for v in vars(w._params).values() if isinstance(v, torch.Tensor)]
    return out


def _same_bytes(a, b):
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k]) and all(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
                                   for x, y in zip(a[k], b[k]))
        for k in a)


def _adapter(tmp_path, model, scale, only=None, name="a.safetensors"):
    pairs = {}
    for i, (n, m) in enumerate(model.named_modules()):
        if isinstance(m, nn.Linear) and n.startswith("blocks.") and (only is None or n.endswith(only)):
            pairs[n] = lora_pair(m.out_features, m.in_features, R, seed=i, scale=scale)
    path = tmp_path / name
    write_kohya(path, pairs, alpha=ALPHA)
    return str(path), pairs


def _run(model, path, x, mode="dynamic", tier="lossless", **spec):
    p = plan(model, [AdapterSpec(path, 1.0, **spec)], mode=mode, tier=tier)
    with torch.no_grad(), applied(model, p) as rep:
        y = model(x)
    return y, rep


@pytest.fixture(scope="module")
def plain():
    return TinyWanLike(d=D, f=F_, n=2, dtype=torch.float32, seed=3)


def test_a_cast_linear_that_is_no_nn_linear_takes_an_adapter(plain):
    q = quant_checkpoints.quantize_model(plain, "TensorCoreFP8Layout", min_numel=1)
    layer = q.blocks[0].self_attn.q
    assert not isinstance(layer, nn.Linear) and target_kind(layer) == "linear"

    class Odd(nn.Module):  # a 2-D weight with no in/out features: not known to compute x W^T
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4, 8))

    kind, why = adapter_kind(Odd())
    assert kind == "" and "Odd" in why and "in_features" in why


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dynamic_on_each_layout_equals_the_ideal_float_result_and_keeps_the_bytes(tmp_path, layout):
    plain, q, d = _quantized(layout)
    ideal = quant_checkpoints.dequantized_model(q)
    path, _ = _adapter(tmp_path, plain, 0.05)
    x = torch.randn(2, 5, d, generator=torch.Generator().manual_seed(0))
    before = _stored(q)
    with torch.no_grad():
        y_base = q(x)
    y, rep = _run(q, path, x, "dynamic", "exact")
    y_ideal, _ = _run(ideal, path, x, "dynamic", "exact")
    # exact tier, fp32 model: the host's base output (dequantized fp32 weight) plus the same delta
    # in the same order as on the plain float weights: bit for bit
    assert torch.equal(y, y_ideal)
    assert (y - y_base).abs().max() > 1e-2   # the adapter is applied
    assert _same_bytes(before, _stored(q))
    assert rep.decision.chosen == "dynamic"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_base_weight_is_the_hosts_own_dequantization_in_fp32(layout):
    _, q, _ = _quantized(layout)
    layer = q.blocks[1].ffn[0]
    bw = base_weight(layer)
    assert not bw.writable and layout[0] in bw.reason
    assert torch.equal(bw.tensor, layer.weight.to(torch.float32).dequantize().as_subclass(torch.Tensor))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_merge_requantizes_as_the_host_and_restores_the_same_parameter(tmp_path, layout):
    plain, q, d = _quantized(layout)
    path, pairs = _adapter(tmp_path, plain, 0.3)
    x = torch.randn(2, 5, d, generator=torch.Generator().manual_seed(1))
    before = _stored(q)
    params = {n: m.weight for n, m in quant_checkpoints.quantized_layers(q).items()}
    with torch.no_grad():
        y_base = q(x)
    p = plan(q, [AdapterSpec(path, 1.0)], mode="merge", tier="lossless")
    with torch.no_grad(), applied(q, p) as rep:
        name = "blocks.0.ffn.0"
        layer = q.get_submodule(name)
        assert layer.weight is not params[name] and attached_wrapper(layer).merged
        down, up = pairs[name]
        w0 = params[name].to(torch.float32).dequantize()
        # ComfyUI's calculate_weight order: (strength * alpha / rank) * (up @ down), added in fp32
        expect = params[name].requantize_from_float(w0 + (1.0 * (ALPHA / R)) * torch.mm(up, down), scale="recalculate")
        assert torch.equal(layer.weight._qdata.view(torch.uint8), expect._qdata.view(torch.uint8))
        y = q(x)
    assert rep.decision.chosen == "merge"
    assert (y - y_base).abs().max() > 1e-2
    for n, m in quant_checkpoints.quantized_layers(q).items():
        assert m.weight is params[n]   # the very Parameter it held
    assert _same_bytes(before, _stored(q))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_auto_measures_on_the_layout_grid(tmp_path, layout, monkeypatch):
    """A small update (|dW| well under the grid step of every layout) reads > 50 % lost and stays
    dynamic; the share equals what the actual merge leaves (rel 1e-3). Every row is measured here
    (these weights are under SAMPLE_ELEMENTS): the grid is under test, the sampling has its own."""
    monkeypatch.setattr(estimate, "SAMPLE_SHARE", 1)
    plain, q, d = _quantized(layout)
    path, _ = _adapter(tmp_path, plain, 0.01)
    x = torch.randn(2, 5, d, generator=torch.Generator().manual_seed(2))
    y, rep = _run(q, path, x, "auto")
    assert rep.decision.chosen == "dynamic", rep.decision
    share = rep.decision.adapters[0].share_lost
    assert share > 0.5 and "round away" in rep.decision.adapters[0].reason
    # the same measure from an actual merge of every layer
    err = ref = 0.0
    p = plan(q, [AdapterSpec(path, 1.0)], mode="merge", tier="lossless")
    with torch.no_grad(), applied(q, p):
        for n, m in quant_checkpoints.quantized_layers(q).items():
            w = attached_wrapper(m)
            if w is None:
                continue
            old = w.merge_state.restore.param.to(torch.float32).dequantize()
            d = w.delta_rows(slice(None), None, True)
            merged = m.weight.to(torch.float32).dequantize()
            err += float((merged - old - d).double().pow(2).sum())
            ref += float(d.double().pow(2).sum())
    assert share == pytest.approx((err / ref) ** 0.5, rel=1e-3)


def test_plain_fp8_weights_refuse_merge_with_the_reason(plain, tmp_path):
    m = copy.deepcopy(plain)
    for mod in m.modules():
        if isinstance(mod, nn.Linear):
            mod.weight = nn.Parameter(mod.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    path, _ = _adapter(tmp_path, plain, 0.05)
    p = plan(m, [AdapterSpec(path, 1.0)], mode="merge")
    with pytest.raises(MergeRefusedError, match="float8_e4m3fn"):
        with applied(m, p):
            pass


# --- a host path that skips a layer's forward (ComfyUI 0.33's int8 feed-forward) -------------

class _Ffn(nn.Sequential):
    def forward(self, x):
        return quant_ops.linear_input_act(self[2], self[0](x), "gelu_tanh")


def _int8_bypass_model(plain):
    m = copy.deepcopy(plain)
    for b in m.blocks:
        b.ffn = _Ffn(*b.ffn)
    return quant_checkpoints.quantize_model(m, "TensorWiseINT8Layout", min_numel=1)


def _first_call(model, path, x, **spec):
    p = plan(model, [AdapterSpec(path, 1.0, **spec)], mode="dynamic", tier="lossless")
    with torch.no_grad(), applied(model, p):
        wrappers = [w for mod in model.modules() for w in [attached_wrapper(mod)] if w is not None]
        y, findings = ran_guard.first_call(lambda: model(x), wrappers, model)
        y2 = model(x)   # a later call: the patch stays for the rest of the sampling
    return y, y2, findings


def test_int8_ffn_bypass_is_detected_and_applied_at_cast_time(plain, tmp_path):
    q = _int8_bypass_model(plain)
    path, pairs = _adapter(tmp_path, plain, 0.05, only="ffn.2")
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(4))
    before = _stored(q)
    with torch.no_grad():
        y_base = q(x)
    y, y2, findings = _first_call(q, path, x)
    assert {f["layer"] for f in findings} == {"blocks.0.ffn.2", "blocks.1.ffn.2"}
    assert all(f["handled"] == ran_guard.CAST for f in findings)
    assert torch.equal(y, y2)
    # reference: the host's own weight patch, W (cast to x's dtype) + dW in fp32, rounded once
    ref = copy.deepcopy(q)
    for n in ("blocks.0.ffn.2", "blocks.1.ffn.2"):
        down, up = pairs[n]
        ref.get_submodule(n).weight_function.append(
            lambda w, d=(ALPHA / R) * torch.mm(up, down): (w.float() + d).to(w.dtype))
    with torch.no_grad():
        y_ref = ref(x)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-5)  # fp32 sums in another order
    assert (y - y_base).abs().max() > 1e-2
    assert _same_bytes(before, _stored(q))
    assert all(not m.weight_function for m in quant_checkpoints.quantized_layers(q).values())  # patch removed
    # a later sampling of the same loaded model patches them up front, and reports them again
    y3, _, again = _first_call(q, path, x)
    assert again == findings and torch.equal(y3, y)


def test_without_the_guard_the_bypass_drops_the_adapter(plain, tmp_path):
    """The failure the guard exists for: the same run, without the first-call check, gives the base."""
    q = _int8_bypass_model(plain)
    path, _ = _adapter(tmp_path, plain, 0.05, only="ffn.2")
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        y_base = q(x)
    y, _ = _run(q, path, x)
    assert torch.equal(y, y_base)


def test_a_layer_that_does_not_run_is_reported_not_patched(plain, tmp_path):
    q = quant_checkpoints.quantize_model(plain, "TensorWiseINT8Layout", min_numel=1)
    q.blocks[1].cross_attn.forward = None  # never called below
    path, _ = _adapter(tmp_path, plain, 0.05, only=("self_attn.q", "cross_attn.q"))
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(5))
    p = plan(q, [AdapterSpec(path, 1.0)], mode="dynamic")
    with torch.no_grad(), applied(q, p):
        wrappers = [w for mod in q.modules() for w in [attached_wrapper(mod)] if w is not None]
        _, findings = ran_guard.first_call(lambda: q.blocks[0].self_attn.q(x), wrappers, q)
        assert not any(w.cast_patched for w in wrappers)
    assert sorted(f["layer"] for f in findings) == ["blocks.0.cross_attn.q", "blocks.1.cross_attn.q",
                                                    "blocks.1.self_attn.q"]
    assert all(f["handled"] == ran_guard.NOT_RUN for f in findings)


def test_a_per_branch_adapter_on_a_bypassed_layer_stops_the_run_naming_it(plain, tmp_path):
    q = _int8_bypass_model(plain)
    path, _ = _adapter(tmp_path, plain, 0.05, only="ffn.2")
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(6))
    p = plan(q, [AdapterSpec(path, 1.0, branch=Branch.POSITIVE)], mode="dynamic")
    with torch.no_grad(), applied(q, p):
        wrappers = [w for mod in q.modules() for w in [attached_wrapper(mod)] if w is not None]
        from comfyui_lora_runtime.lora_runtime.layer.schedule import (SamplingSchedules, model_call_context,
                                                                       sampling_schedules)
        sched = SamplingSchedules({p.adapters[0].name: (None, Branch.POSITIVE)}, torch.tensor([1.0, 0.0]), None)
        with sampling_schedules(sched), model_call_context(x, torch.tensor([1.0, 1.0]), [0, 1]):
            with pytest.raises(LoraRuntimeError, match="blocks.0.ffn.2"):
                ran_guard.first_call(lambda: q(x), wrappers, q)
