"""ComfyUI 0.33-style quantized bases in the bundled host (`standalone/host/quant_ops.py`): comfy-kitchen
QuantizedTensor weights in non-nn.Linear layers, ComfyUI's checkpoint format, and Wan's FFN
folding GELU into an int8 down-projection (ffn.2's forward bypassed), on the tiny Wan checkpoint.

- fp8 / mxfp8 / nvfp4: the quantized model's output is bit for bit the output of a plain model
  holding the dequantized weights (every layer computes F.linear with exactly those values).
- int8: the same except in each block's ffn.2, where comfy-kitchen's int8 kernel quantizes its
  input activation per row to int8 (a rounding of at most row-max / 254 per element), so the
  output matches within that; with the kernel path switched off (an identity weight_function)
  it is bit for bit again.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

ck = pytest.importorskip("comfy_kitchen")
from comfy_kitchen.tensor import QuantizedTensor  # noqa: E402

from comfyui_lora_runtime.standalone.host import quant_checkpoints, quant_formats  # noqa: E402
from comfyui_lora_runtime.standalone.host.quant_checkpoints import (dequantized_model, quantize_model,  # noqa: E402
                                                                 quantized_layers, save_quantized)
from comfyui_lora_runtime.standalone.host.quant_ops import QuantLinear, linear_input_act  # noqa: E402
from comfyui_lora_runtime.standalone.host.wan21 import WanFeedForward, load_wan_checkpoint  # noqa: E402
from testkit.random_wan import write_random_wan  # noqa: E402

LAYOUTS = ["TensorCoreFP8Layout", "TensorWiseINT8Layout", "TensorCoreMXFP8Layout", "TensorCoreNVFP4Layout"]
# layout -> (checkpoint format, the layout ComfyUI's loader gives it, storage dtype, scale keys)
EXPECTED = {
    "TensorCoreFP8Layout": ("float8_e4m3fn", "TensorCoreFP8E4M3Layout", torch.float8_e4m3fn, {"weight_scale"}),
    "TensorWiseINT8Layout": ("int8_tensorwise", "TensorWiseINT8Layout", torch.int8, {"weight_scale"}),
    "TensorCoreMXFP8Layout": ("mxfp8", "TensorCoreMXFP8Layout", torch.float8_e4m3fn, {"weight_scale"}),
    "TensorCoreNVFP4Layout": ("nvfp4", "TensorCoreNVFP4Layout", torch.uint8, {"weight_scale", "weight_scale_2"}),
}
N_LINEARS = 26   # tiny Wan: 2 blocks x 10 + text 2 + time 2 + time_projection 1 + head 1 (all >= 1024 weights)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a plain tensor (torch.equal is not defined for every fp8 dtype)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same_qt(a, b) -> bool:
    if a._layout_cls != b._layout_cls and {a._layout_cls, b._layout_cls} != {"TensorCoreFP8Layout",
                                                                             "TensorCoreFP8E4M3Layout"}:
        return False
    pa, pb = a._params, b._params
    fields = ["scale"] + (["block_scale"] if hasattr(pa, "block_scale") else [])
    return (torch.equal(_bits(a._qdata), _bits(b._qdata)) and a._qdata.dtype == b._qdata.dtype
            and all(torch.equal(_bits(getattr(pa, f)), _bits(getattr(pb, f))) for f in fields)
            and pa.orig_shape == pb.orig_shape and pa.orig_dtype == pb.orig_dtype)


@pytest.fixture(scope="module")
def quantized(tiny_wan):
    """layout -> quantize_model(tiny_wan, layout) (never mutated by a test: copy first)."""
    return {layout: quantize_model(tiny_wan, layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def call(load_ref):
    ref = load_ref("model_first_call")

    @torch.no_grad()
    def run(model):
        return model(ref["x"], ref["timestep"], ref["context"])
    return run


def _ffn_input(seed=0, d=128, s=7):
    return torch.randn(2, s, d, generator=torch.Generator().manual_seed(seed))


# -- the layer ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_model_layers(tiny_wan, quantized, layout):
    q = quantized[layout]
    layers = quantized_layers(q)
    assert len(layers) == N_LINEARS
    assert not any(type(m) is nn.Linear for m in q.modules())
    plain = dict(tiny_wan.named_modules())
    for name, m in layers.items():
        assert not isinstance(m, nn.Linear) and m.comfy_cast_weights is True
        assert m.weight_function == [] and m.bias_function == []
        w = m.weight
        assert isinstance(w, QuantizedTensor) and isinstance(w, nn.Parameter) and not w.requires_grad
        assert w._layout_cls == m.layout_type == layout
        assert m.quant_format == EXPECTED[layout][0]
        assert w.shape == plain[name].weight.shape == (m.out_features, m.in_features) and w.dtype == torch.float32
        assert type(m.bias) is nn.Parameter and torch.equal(m.bias, plain[name].bias)
        # forward = F.linear with the dequantized weight, bit for bit
        x = torch.randn(3, 5, m.in_features, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(m(x), F.linear(x, w.dequantize(), m.bias))
        assert torch.equal(m.convert_weight(), w.dequantize())
        # the cast hands back the QuantizedTensor itself (same dtype, no function) ...
        cw, cb = m.cast_weight_bias(torch.float32)
        assert isinstance(cw, QuantizedTensor) and cw._qdata is w._qdata and torch.equal(cb, m.bias)
        # ... and a dequantized tensor for another dtype
        cw16, cb16 = m.cast_weight_bias(torch.bfloat16)
        assert type(cw16) is torch.Tensor and cw16.dtype == cb16.dtype == torch.bfloat16
    # the original stays plain
    assert all(type(m) is nn.Linear for m in tiny_wan.modules() if isinstance(m, nn.Linear))


def test_quantize_model_keeps_refused_and_small_layers_plain():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    q = quantize_model(model, "TensorCoreNVFP4Layout", min_numel=1024)
    assert isinstance(q[0], QuantLinear) and type(q[1]) is nn.Linear   # 512 weights < min_numel
    # a layout that refuses a shape (comfy-kitchen's ValueError) leaves that layer plain
    conv_like = nn.Sequential(nn.Linear(64, 64))
    with torch.no_grad():
        conv_like[0].weight = nn.Parameter(torch.randn(64, 4, 16))   # 3-D: nvfp4 / mxfp8 refuse it
    q = quantize_model(conv_like, "TensorCoreNVFP4Layout")
    assert type(q[0]) is nn.Linear
    with pytest.raises(KeyError):
        quantize_model(model, "NoSuchLayout")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deepcopy_to_and_set_weight(quantized, layout):
    q = copy.deepcopy(quantized[layout])
    m = q.blocks[0].ffn[0]
    orig = quantized[layout].blocks[0].ffn[0]
    assert m.weight._qdata.data_ptr() != orig.weight._qdata.data_ptr() and _same_qt(m.weight, orig.weight)
    q.to(torch.float32)
    assert isinstance(m.weight, QuantizedTensor) and m.weight.dtype == torch.float32
    # set_weight: re-quantized with the layer's own layout settings, reported in the layer's dtype
    new = m.convert_weight() * 1.5
    m.set_weight(new, seed=1234)
    assert isinstance(m.weight, QuantizedTensor) and m.weight._layout_cls == layout
    assert m.weight.dtype == torch.float32 and m.layout_type == layout
    err = (m.convert_weight() - new).abs().max() / new.abs().max()
    assert err < 0.2   # nvfp4's 4-bit grid is the coarsest
    assert m.set_weight(new, return_weight=True) is not None and m.weight.dtype == torch.float32


def test_fp8_set_weight_stochastic_rounding_like_comfyui():
    """ComfyUI's fp8 layouts (loaded as "TensorCoreFP8E4M3Layout") round stochastically with the
    patcher's seed; seed None / 0 rounds to nearest."""
    lin = nn.Linear(64, 32)
    q = quantize_model(nn.Sequential(lin), "TensorCoreFP8E4M3Layout", min_numel=1, scale="recalculate")[0]
    w = lin.weight.detach() * 0.9
    a = q.set_weight(w, seed=7, return_weight=True)
    b = q.set_weight(w, seed=7, return_weight=True)
    c = q.set_weight(w, seed=None, return_weight=True)
    assert torch.equal(_bits(a._qdata), _bits(b._qdata)) and not torch.equal(_bits(a._qdata), _bits(c._qdata))
    nearest = QuantizedTensor.from_float(w, "TensorCoreFP8Layout")
    assert torch.equal(_bits(c._qdata), _bits(nearest._qdata))


# -- whole model ----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_model_output_vs_dequantized_model(quantized, call, layout):
    q = quantized[layout]
    d = dequantized_model(q)
    assert not quantized_layers(d) and sum(type(m) is nn.Linear for m in d.modules()) == N_LINEARS
    out, ideal = call(q), call(d)
    assert out.shape == (1, 16, 1, 8, 8) and torch.isfinite(out).all()
    if layout != "TensorWiseINT8Layout":
        assert torch.equal(out, ideal)   # the same fp32 weights through the same F.linear calls
        return
    # int8: ffn.2 runs comfy-kitchen's kernel, which rounds its input per row to int8
    diff = out - ideal
    assert 0 < diff.abs().max() < 0.05 and diff.norm() / ideal.norm() < 1e-2
    # with the kernel switched off (a weight_function makes the cast dequantize) it is bit for bit
    q2 = copy.deepcopy(q)
    for block in q2.blocks:
        block.ffn[2].weight_function.append(lambda w: w)
    assert torch.equal(call(q2), ideal)


def test_plain_wan_ffn_bit_identical_to_sequential(tiny_wan, call, load_ref):
    """WanFeedForward on plain Linears computes exactly what nn.Sequential did."""
    for block in tiny_wan.blocks:
        assert type(block.ffn) is WanFeedForward and isinstance(block.ffn, nn.Sequential)
        assert [type(c) for c in block.ffn] == [nn.Linear, nn.GELU, nn.Linear]
    assert {k for k in tiny_wan.state_dict() if ".ffn." in k} == {
        f"blocks.{i}.ffn.{j}.{p}" for i in range(2) for j in (0, 2) for p in ("weight", "bias")}
    new = call(tiny_wan)
    old_model = copy.deepcopy(tiny_wan)
    for block in old_model.blocks:   # the previous path: the Sequential's own forward
        block.ffn.forward = types.MethodType(nn.Sequential.forward, block.ffn)
    assert torch.equal(new, call(old_model))
    x = _ffn_input()
    ffn = tiny_wan.blocks[0].ffn
    with torch.no_grad():
        assert torch.equal(ffn(x), nn.Sequential.forward(ffn, x))
    torch.testing.assert_close(new, load_ref("model_first_call")["model_output"], atol=1e-5, rtol=0)


# -- int8: the FFN bypass -------------------------------------------------------------------------

def _count_calls(module):
    """Count forward-hook calls and instance-forward calls of `module`."""
    counts = {"hook": 0, "forward": 0}
    handle = module.register_forward_hook(lambda *a: counts.__setitem__("hook", counts["hook"] + 1))
    inner = module.forward

    def forward(*args, **kwargs):
        counts["forward"] += 1
        return inner(*args, **kwargs)
    module.forward = forward
    return counts, handle


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ffn2_forward_bypassed_only_for_int8(quantized, call, layout):
    q = copy.deepcopy(quantized[layout])
    seen = []
    for block in q.blocks:
        seen.append((_count_calls(block.ffn[0])[0], _count_calls(block.ffn[2])[0]))
    call(q)
    for up, down in seen:
        assert up == {"hook": 1, "forward": 1}
        expected = 0 if layout == "TensorWiseINT8Layout" else 1
        assert down == {"hook": expected, "forward": expected}


def test_int8_ffn_is_the_int8_kernel(quantized):
    ffn = copy.deepcopy(quantized["TensorWiseINT8Layout"].blocks[1].ffn)
    down = ffn[2]
    counts, _ = _count_calls(down)
    x = _ffn_input(seed=3)
    with torch.no_grad():
        h = ffn[0](x)
        out = ffn(x)
        kernel = ck.int8_linear(h, down.weight._qdata, down.weight._params.scale, down.bias, torch.float32,
                                input_act="gelu_tanh")
        direct = linear_input_act(down, h, "gelu_tanh")
        eager = F.linear(F.gelu(h, approximate="tanh"), down.weight.dequantize(), down.bias)
    assert counts == {"hook": 0, "forward": 0}
    assert torch.equal(out, kernel) and torch.equal(direct, kernel)
    # the kernel rounds gelu(h) per row to int8 (a step of row-max / 127): close to, but not, the
    # dequantized-weight result (about 1 % relative on this heavy-tailed random input)
    assert not torch.equal(out, eager) and (out - eager).norm() / eager.norm() < 3e-2


def test_int8_weight_function_makes_linear_input_act_use_the_patched_weight(quantized):
    ffn = copy.deepcopy(quantized["TensorWiseINT8Layout"].blocks[0].ffn)
    down = ffn[2]
    delta = torch.randn(down.out_features, down.in_features, generator=torch.Generator().manual_seed(5)) * 0.01
    bias_delta = torch.full((down.out_features,), 0.25)
    got = []

    def wf(w):
        got.append((type(w), w.dtype))
        return w + delta
    down.weight_function.append(wf)
    down.bias_function.append(lambda b: b + bias_delta)
    counts, _ = _count_calls(down)
    x = _ffn_input(seed=4)
    with torch.no_grad():
        h = ffn[0](x)
        out = ffn(x)
        expected = F.linear(F.gelu(h, approximate="tanh"), down.weight.dequantize() + delta, down.bias + bias_delta)
    assert got == [(torch.Tensor, torch.float32)]   # a dequantized float weight, not the QuantizedTensor
    assert torch.equal(out, expected) and counts == {"hook": 0, "forward": 0}
    # the stored weight is untouched
    assert _same_qt(down.weight, quantized["TensorWiseINT8Layout"].blocks[0].ffn[2].weight)


def test_linear_input_act_plain_and_swiglu():
    lin = nn.Linear(16, 8)
    x = _ffn_input(d=32)
    gate, up = x.chunk(2, dim=-1)
    with torch.no_grad():
        expected = lin(F.silu(gate) * up)
        counts, _ = _count_calls(lin)
        assert torch.equal(linear_input_act(lin, x, "swiglu"), expected)
    assert counts == {"hook": 1, "forward": 1}   # a plain layer is called
    lin2 = nn.Linear(32, 8)
    with torch.no_grad():
        assert torch.equal(linear_input_act(lin2, x, "gelu_tanh"), lin2(nn.GELU(approximate="tanh")(x)))
    with pytest.raises(ValueError, match="relu"):
        linear_input_act(lin2, x, "relu")


# -- checkpoint files -----------------------------------------------------------------------------

def _assert_saved_layers(f, q, scale_keys, storage, comfy_quant):
    """Every quantized layer of `q` in the open file `f`: its keys (weight, bias, comfy_quant and the
    layout's scales), the stored dtype, and comfy_quant as uint8 JSON equal to `comfy_quant`."""
    keys = set(f.keys())
    for name in quantized_layers(q):
        assert {k[len(name) + 1:] for k in keys if k.rsplit(".", 1)[0] == name} == \
            {"weight", "bias", "comfy_quant"} | scale_keys
        assert f.get_tensor(f"{name}.weight").dtype == storage
        assert f.get_tensor(f"{name}.comfy_quant").dtype == torch.uint8
        assert json.loads(f.get_tensor(f"{name}.comfy_quant").numpy().tobytes()) == comfy_quant


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_load_round_trip(quantized, call, tmp_path, layout):
    q = quantized[layout]
    fmt, loaded_layout, storage, scale_keys = EXPECTED[layout]
    path = save_quantized(tmp_path / "q.safetensors", q)
    with safe_open(path, "pt") as f:
        _assert_saved_layers(f, q, scale_keys, storage, {"format": fmt})
        if fmt == "nvfp4":
            assert f.get_tensor("blocks.0.ffn.0.weight_scale").dtype == torch.float8_e4m3fn
            assert f.get_tensor("blocks.0.ffn.0.weight_scale_2").dtype == torch.float32
        if fmt == "mxfp8":
            assert f.get_tensor("blocks.0.ffn.0.weight_scale").dtype == torch.float8_e8m0fnu
    loaded = load_wan_checkpoint(path)
    lq, qq = quantized_layers(loaded), quantized_layers(q)
    assert lq.keys() == qq.keys()
    for name, m in lq.items():
        assert m.layout_type == m.weight._layout_cls == loaded_layout and m.quant_format == fmt
        assert _same_qt(m.weight, qq[name].weight) and torch.equal(m.bias, qq[name].bias)
        assert not m.weight.requires_grad
    assert torch.equal(call(loaded), call(q))
    # the loaded model's state_dict is the file again
    resaved = save_quantized(tmp_path / "again.safetensors", loaded)
    with safe_open(path, "pt") as a, safe_open(resaved, "pt") as b:
        assert set(a.keys()) == set(b.keys())
        assert all(torch.equal(_bits(a.get_tensor(k)), _bits(b.get_tensor(k))) for k in a.keys())


# the 4-bit layouts that rotate groups of 256 input columns: their model is a d256 random Wan.
# layout -> (checkpoint format, storage dtype, scale keys, what comfy_quant carries besides the format:
# what ComfyUI 0.33's own state_dict writes for the layout)
WIDE = {
    "TensorCoreConvRotW4A4Layout": ("convrot_w4a4", torch.int8, {"weight_scale"}, {"convrot_groupsize": 256}),
    "AsymW4A8Int8Layout": ("asym_w4a8_int8", torch.int8, {"weight_s_rel", "weight_s_channel", "weight_codebook"},
                           {"group_size": 16, "convrot_groupsize": 256}),
}


@pytest.fixture(scope="module")
def wide_wan(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide-wan") / "wan_d256.safetensors"
    write_random_wan(path, 256, 1024, 2)
    return load_wan_checkpoint(path)


def _stored(qt) -> tuple[dict, dict]:
    """A QuantizedTensor's stored data and every tensor field of its params (dtype, raw bytes), and
    its other params."""
    tensors, other = {"qdata": qt._qdata}, {}
    for f in dataclasses.fields(qt._params):
        v = getattr(qt._params, f.name)
        (tensors if isinstance(v, torch.Tensor) else other)[f.name] = v
    return {k: (v.dtype, _bits(v)) for k, v in tensors.items()}, other


def _same_stored(a, b) -> bool:
    (ta, oa), (tb, ob) = _stored(a), _stored(b)
    return oa == ob and ta.keys() == tb.keys() and all(
        ta[k][0] == tb[k][0] and torch.equal(ta[k][1], tb[k][1]) for k in ta)


@pytest.mark.parametrize("layout", WIDE)
def test_save_load_round_trip_4bit_rotated_layouts(wide_wan, call, tmp_path, layout):
    """A convrot_w4a4 / asym_w4a8_int8 file in ComfyUI 0.33's keys (the layout's own state_dict
    names; comfy_quant with the group sizes) loads back as the same quantized weights (data, every
    scale, the group sizes), and the loaded model computes bit for bit what the saved one did."""
    fmt, storage, scale_keys, conf_extra = WIDE[layout]
    q = quantize_model(wide_wan, layout)
    assert len(quantized_layers(q)) == N_LINEARS
    path = save_quantized(tmp_path / "q.safetensors", q)
    with safe_open(path, "pt") as f:
        _assert_saved_layers(f, q, scale_keys, storage, {"format": fmt, **conf_extra})
        if fmt == "asym_w4a8_int8":
            assert f.get_tensor("blocks.0.ffn.2.weight_s_rel").dtype == torch.float8_e4m3fn
    loaded = load_wan_checkpoint(path)
    assert loaded.config == wide_wan.config   # the config read through the packed int4 columns
    lq, qq = quantized_layers(loaded), quantized_layers(q)
    assert lq.keys() == qq.keys()
    for name, m in lq.items():
        assert m.layout_type == m.weight._layout_cls == layout and m.quant_format == fmt
        assert _same_stored(m.weight, qq[name].weight), name
        assert torch.equal(m.bias, qq[name].bias) and not m.weight.requires_grad
    assert torch.equal(call(loaded), call(q))
    # wrong answer: the plain model (the 4-bit grid moves the output)
    assert not torch.equal(call(loaded), call(wide_wan))
    resaved = save_quantized(tmp_path / "again.safetensors", loaded)
    with safe_open(path, "pt") as a, safe_open(resaved, "pt") as b:
        assert set(a.keys()) == set(b.keys())
        assert all(torch.equal(_bits(a.get_tensor(k)), _bits(b.get_tensor(k))) for k in a.keys())


def test_load_with_comfy_prefix_and_metadata_form(quantized, call, tmp_path):
    q = quantized["TensorWiseINT8Layout"]
    sd = q.state_dict()
    prefixed = {"model.diffusion_model." + k: v for k, v in sd.items()}
    save_file({k: v.contiguous() for k, v in prefixed.items()}, str(tmp_path / "p.safetensors"))
    assert torch.equal(call(load_wan_checkpoint(tmp_path / "p.safetensors")), call(q))
    # the per-layer JSON in the file's _quantization_metadata instead of comfy_quant keys
    layers = {k[: -len(".comfy_quant")]: json.loads(v.numpy().tobytes()) for k, v in prefixed.items()
              if k.endswith(".comfy_quant")}
    plain = {k: v.contiguous() for k, v in prefixed.items() if not k.endswith(".comfy_quant")}
    save_file(plain, str(tmp_path / "m.safetensors"),
              metadata={"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})})
    assert torch.equal(call(load_wan_checkpoint(tmp_path / "m.safetensors")), call(q))


def test_legacy_scaled_fp8(quantized, call, tmp_path):
    """ComfyUI's older scaled-fp8 files (a `scaled_fp8` marker, per-layer `scale_weight`) load as
    float8_e4m3fn layers, as ComfyUI converts them."""
    q = quantized["TensorCoreFP8Layout"]
    v1 = save_quantized(tmp_path / "v1.safetensors", q)
    legacy = {}
    for k, v in q.state_dict().items():
        if k.endswith(".comfy_quant"):
            continue
        if k.endswith(".weight_scale"):
            legacy[k[: -len("weight_scale")] + "scale_weight"] = v
            legacy[k[: -len("weight_scale")] + "scale_input"] = torch.ones(())   # 1.0: dropped
        else:
            legacy[k] = v
    legacy = {"model.diffusion_model." + k: v.contiguous() for k, v in legacy.items()}
    legacy["model.diffusion_model.scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(legacy, str(tmp_path / "legacy.safetensors"))
    a, b = load_wan_checkpoint(v1), load_wan_checkpoint(tmp_path / "legacy.safetensors")
    for name, m in quantized_layers(b).items():
        assert m.quant_format == "float8_e4m3fn" and m.layout_type == "TensorCoreFP8E4M3Layout"
        assert _same_qt(m.weight, quantized_layers(a)[name].weight)
        assert m.quant_conf == {} and getattr(m, "input_scale", None) is None
    assert torch.equal(call(b), call(a))
    # a 2-element marker means full_precision_matrix_mult
    conv = quant_checkpoints.convert_old_quants({"scaled_fp8": torch.zeros(2), "l.weight": torch.zeros(2, 2),
                                         "l.scale_weight": torch.ones(()), "l.scale_input": torch.full((), 2.0)})
    assert json.loads(conv["l.comfy_quant"].numpy().tobytes()) == {"format": "float8_e4m3fn",
                                                                  "full_precision_matrix_mult": True}
    assert set(conv) == {"l.weight", "l.weight_scale", "l.input_scale", "l.comfy_quant"}


def test_unet_loader_node_loads_a_quantized_file(quantized, call, tmp_path):
    from comfyui_lora_runtime.standalone.host import folder_paths
    from comfyui_lora_runtime.standalone.host.core_nodes import UNETLoader

    dm = tmp_path / "models" / "diffusion_models"
    dm.mkdir(parents=True)
    save_quantized(dm / "wan_int8.safetensors", quantized["TensorWiseINT8Layout"])
    folders = folder_paths.ModelFolders(models_dir=tmp_path / "models", output_dir=tmp_path / "out")
    with folder_paths.activated(folders):
        (patcher,) = UNETLoader().load_unet("wan_int8.safetensors", "default")
    wan = patcher.model.diffusion_model
    assert len(quantized_layers(wan)) == N_LINEARS
    assert torch.equal(call(wan), call(quantized["TensorWiseINT8Layout"]))


def test_without_comfy_kitchen(quantized, tmp_path, monkeypatch, tiny_wan, call):
    path = save_quantized(tmp_path / "wan_fp8.safetensors", quantized["TensorCoreFP8Layout"])
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)   # `import comfy_kitchen` now fails
    with pytest.raises(quant_formats.ComfyKitchenMissingError, match=r"wan_fp8\.safetensors.*pip install comfy-kitchen"):
        load_wan_checkpoint(path)
    with pytest.raises(ImportError, match="pip install comfy-kitchen"):
        quantize_model(tiny_wan, "TensorCoreFP8Layout")


def test_host_imports_and_runs_without_comfy_kitchen(ref_dir):
    """A fresh interpreter where comfy_kitchen cannot be imported: the host, wan21 and the quantized-layer
    modules import, and the plain model loads and runs."""
    code = (
        "import sys; sys.modules['comfy_kitchen'] = None\n"
        "import torch\n"
        "from comfyui_lora_runtime.standalone.host import quant_formats, quant_ops, core_nodes\n"
        "from comfyui_lora_runtime.standalone.host.wan21 import load_wan_checkpoint\n"
        f"m = load_wan_checkpoint({str(ref_dir / 'tiny_wan_d128_l2.safetensors')!r})\n"
        "out = m(torch.zeros(1, 16, 1, 4, 4), torch.tensor([500.0]), torch.zeros(1, 2, 4096))\n"
        "assert out.shape == (1, 16, 1, 4, 4) and not quant_formats.is_quantized(m.blocks[0].ffn[2].weight)\n"
        "assert 'comfy_kitchen.tensor' not in sys.modules\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
