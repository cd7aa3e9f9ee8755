"""Adapters on GGUF-style packed bases (the bundled host's `gguf_like`), in every mode, tier and
update type.

- Q8_0 (quantized): auto and dynamic give bit for bit the output of the same adapters, dynamic,
  on a plain fp32 model holding the dequantized weights (the same maths: the packed layer
  computes with exactly those fp32 values); merge is refused with an error that names the
  adapter, the layer and the type, and its advice ('dynamic') works.
- F16 / BF16: plain float weights. Dynamic: bit for bit the plain fp32 model of their values.
  Merge (and auto's decision): bit for bit what a merge into a plain fp16 / bf16 copy of the
  weights writes, read back through the packed layer.
- Every output differs from the base model's, and the packed bytes are bit-identical after.
"""
from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from comfyui_lora_runtime.standalone.host.gguf_like import (PackedLinear, PackedTensor, QuantType, dequantize,
                                                         dequantize_q8_0, pack, pack_model, quantize_q8_0,
                                                         unpacked_model)
from comfyui_lora_runtime.lora_runtime import AdapterSpec, applied, plan
from comfyui_lora_runtime.lora_runtime.errors import MergeRefusedError
from comfyui_lora_runtime.lora_runtime.layer.base_weight import base_weight, float_view, packed_reason
from comfyui_lora_runtime.lora_runtime.layer.wrapper import attached_wrapper

from testkit.fixtures import TinyWanLike, assert_no_runtime_left

KINDS = ["lora", "loha", "lokr", "dora_out", "dora_in", "full"]
MODES = ["auto", "dynamic", "merge"]
TIERS = ["exact", "lossless", "high"]
STRENGTH = 0.8
R = 4


def _rnd(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def _layer_parts(kind: str, out_f: int, in_f: int, g: torch.Generator, w: torch.Tensor) -> dict:
    """One layer's tensors of `kind`, sized so the update is ~30 % of the weight (visible, finite)."""
    s = 0.3 / in_f ** 0.5
    if kind in ("lora", "dora_out", "dora_in"):
        p = {"lora_down.weight": _rnd(g, R, in_f, scale=in_f ** -0.5), "lora_up.weight": _rnd(g, out_f, R, scale=0.3),
             "alpha": torch.tensor(float(R))}
        if kind != "lora":
            wc = w.float() + p["lora_up.weight"] @ p["lora_down.weight"]
            n = wc.norm(dim=1, keepdim=True) if kind == "dora_out" else wc.norm(dim=0, keepdim=True)
            p["dora_scale"] = n * (1.0 + 0.2 * _rnd(g, *n.shape)).clamp(min=0.5)
        return p
    if kind == "loha":
        return {"hada_w1_a": _rnd(g, out_f, R, scale=s ** 0.5), "hada_w1_b": _rnd(g, R, in_f, scale=s ** 0.5 / 2),
                "hada_w2_a": _rnd(g, out_f, R), "hada_w2_b": _rnd(g, R, in_f, scale=0.5), "alpha": torch.tensor(2.0)}
    if kind == "lokr":  # kron([2, 2], [out/2, in/2])
        return {"lokr_w1": _rnd(g, 2, 2), "lokr_w2_a": _rnd(g, out_f // 2, R, scale=s),
                "lokr_w2_b": _rnd(g, R, in_f // 2), "alpha": torch.tensor(float(R))}
    if kind == "full":
        return {"diff": _rnd(g, out_f, in_f, scale=s)}  # (a diff_b rides at run time in every mode)
    raise KeyError(kind)


def write_adapter(path, kind: str, model: nn.Module, *, seed: int = 3, only: tuple[str, ...] = ()) -> str:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or (only and not name.startswith(only)):
            continue
        w = base_weight(m).tensor
        for k, v in _layer_parts(kind, m.out_features, m.in_features, g, w).items():
            sd[f"diffusion_model.{name}.{k}"] = v.contiguous()
    save_file(sd, str(path))
    return str(path)


def _x():
    return torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(11))


def _raw(model) -> dict:
    return {n: p.as_subclass(torch.Tensor).clone() for n, p in model.named_parameters()}


def _run(model, path, mode, tier, fusion_backend="auto"):
    with applied(model, plan(model, [AdapterSpec(path, STRENGTH)], mode, tier),
                 fusion_backend=fusion_backend) as rep, torch.no_grad():
        y = model(_x())
        merged = {n: float_view(attached_wrapper(m).get_base_layer().weight).clone()
                  for n, m in model.named_modules() if attached_wrapper(m) is not None and attached_wrapper(m).merged}
    return y, rep, merged


@pytest.fixture(scope="module")
def base():
    return TinyWanLike(seed=0)


# --- the packed format itself ------------------------------------------------------------------------
def test_q8_0_bytes_follow_the_format():
    x = torch.linspace(-1.0, 0.5, 64).reshape(2, 32)
    b = quantize_q8_0(x)
    assert b.dtype == torch.uint8 and tuple(b.shape) == (2, 34)
    d = b[:, :2].contiguous().view(torch.float16).float().squeeze(1)
    assert torch.equal(d, (x.abs().amax(dim=1) / 127).half().float())     # scale: fp16 of max|x| / 127
    q = b[:, 2:].contiguous().view(torch.int8)
    assert int(q[0, 0]) == -127 and int(q[1].abs().max()) == 127
    y = dequantize_q8_0(b, (2, 32))
    assert torch.equal(y, d[:, None] * q.float())
    assert (y - x).abs().max() <= d.max() / 2 * 1.01 + 1e-7                # round to nearest quant step
    t = pack(x, "Q8_0")
    assert isinstance(t, PackedTensor) and t.shape == (2, 32) and torch.Tensor.size(t) == (2, 34)
    assert torch.equal(dequantize(t), y)
    bf = pack(x, "BF16")
    assert bf.dtype == torch.uint8 and torch.equal(dequantize(bf), x.bfloat16().float())


def test_packed_weights_read_through_their_layer(base):
    q8 = pack_model(base, "Q8_0").blocks[0].ffn[0]
    assert isinstance(q8, PackedLinear) and q8.weight.dtype == torch.uint8
    assert packed_reason(q8.weight) == "weight is GGUF Q8_0 (quantized/packed)" and float_view(q8.weight) is None
    bw = base_weight(q8)
    assert not bw.writable and torch.equal(bw.tensor, q8.get_weight(q8.weight, torch.float32))
    for q, dt in (("F16", torch.float16), ("BF16", torch.bfloat16)):
        lin = pack_model(base, q).blocks[0].ffn[0]
        v = float_view(lin.weight)
        assert packed_reason(lin.weight) == "" and v.dtype == dt and tuple(v.shape) == (64, 32)
        assert v.data_ptr() == lin.weight.data_ptr(), "a view: a merge writes into the layer's own bytes"
        assert base_weight(lin).writable


# --- Q8_0: every mode, tier and update type ----------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("mode", ["auto", "dynamic"])
def test_q8_0_equals_the_dequantized_model(tmp_path, base, kind, mode, tier):
    packed = pack_model(base, "Q8_0")
    ref_model = unpacked_model(packed)
    path = write_adapter(tmp_path / f"{kind}.safetensors", kind, packed)
    before = _raw(packed)
    with torch.no_grad():
        y_base = packed(_x())
    y, rep, merged = _run(packed, path, mode, tier)
    y_ref, _, _ = _run(ref_model, path, "dynamic", tier, fusion_backend=None)
    assert rep.decision.chosen == "dynamic" and not merged
    if mode == "auto":
        a = rep.decision.adapters[0]
        assert a.reason.startswith(f"{a.layers} of its {a.layers} layers cannot take a merge") and "GGUF Q8_0" in a.reason
    assert all(not f.get("fusions") for f in rep.fusions), "a packed weight never reaches a fused GEMM"
    # same maths on the same fp32 values: bit for bit
    assert torch.equal(y, y_ref), (kind, mode, tier, (y - y_ref).abs().max().item())
    assert (y - y_base).abs().mean() > 1e-2, "the adapter must change the output for this test to mean anything"
    assert all(torch.equal(before[n], t) for n, t in _raw(packed).items())
    assert_no_runtime_left(packed)


@pytest.mark.parametrize("kind", ["lora", "dora_out"])
def test_q8_0_merge_is_refused_and_its_advice_works(tmp_path, base, kind):
    packed = pack_model(base, "Q8_0")
    path = write_adapter(tmp_path / "a.safetensors", kind, packed)
    before = _raw(packed)
    with pytest.raises(MergeRefusedError) as e:
        _run(packed, path, "merge", "lossless")
    msg = str(e.value)
    assert "weight is GGUF Q8_0 (quantized/packed)" in msg
    assert "merge mode 'merge' cannot fold adapter" in msg and "'blocks.0." in msg and "(21 of its 21 layers)" in msg
    assert "Use merge mode 'dynamic'" in msg
    assert all(torch.equal(before[n], t) for n, t in _raw(packed).items())
    assert_no_runtime_left(packed)
    y, rep, _ = _run(packed, path, "dynamic", "lossless")   # what the error advises runs
    assert rep.decision.chosen == "dynamic" and torch.isfinite(y).all()


# --- F16 / BF16: plain weights ------------------------------------------------------------------------
def _merged_reference(packed, path, mode, tier, dtype):
    """The output a merge into a plain `dtype` copy of the packed weights gives: merge there (the
    same adapters, mode and tier), then compute in fp32 with those merged values."""
    ref16 = unpacked_model(packed)
    for m in ref16.modules():
        if isinstance(m, nn.Linear) and m.weight.numel() >= 1024:
            m.weight.data = m.weight.data.to(dtype)
    with applied(ref16, plan(ref16, [AdapterSpec(path, STRENGTH)], mode, tier), fusion_backend=None) as rep:
        values = {n: p.detach().float().clone() for n, p in ref16.named_parameters()}
    out = unpacked_model(packed)
    with torch.no_grad():
        for n, p in out.named_parameters():
            p.copy_(values[n])
        y = out(_x())
    return y, rep


# every tier on F16; BF16 differs only in how its bytes are viewed (raw bytes -> bfloat16): exact tier
F16_BF16 = [(q, t) for q in ("F16", "BF16") for t in TIERS if q == "F16" or t == "exact"]


@pytest.mark.parametrize("qtype,tier", F16_BF16)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_f16_bf16_are_plain_weights(tmp_path, base, qtype, kind, mode, tier):
    dtype = {"F16": torch.float16, "BF16": torch.bfloat16}[qtype]
    packed = pack_model(base, qtype)
    path = write_adapter(tmp_path / f"{kind}.safetensors", kind, packed)
    before = _raw(packed)
    with torch.no_grad():
        y_base = packed(_x())
    y, rep, merged = _run(packed, path, mode, tier, fusion_backend=None)
    y_merge_ref, rep_ref = _merged_reference(packed, path, mode, tier, dtype)
    assert rep.decision.chosen == rep_ref.decision.chosen, (rep.decision.reason, rep_ref.decision.reason)
    assert rep.decision.share_lost == rep_ref.decision.share_lost
    if mode == "merge":
        assert rep.decision.chosen == "merge" and len(merged) == 21
    if rep.decision.chosen == "merge":
        assert torch.equal(y, y_merge_ref), (kind, mode, tier, (y - y_merge_ref).abs().max().item())
    else:
        y_ref, _, _ = _run(unpacked_model(packed), path, "dynamic", tier, fusion_backend=None)
        assert torch.equal(y, y_ref), (kind, mode, tier, (y - y_ref).abs().max().item())
    assert (y - y_base).abs().mean() > 1e-2
    assert all(torch.equal(before[n], t) for n, t in _raw(packed).items()), "restored bit for bit"
    assert_no_runtime_left(packed)


# --- several adapters: each reason quotes its own layers -------------------------------------------
def test_two_adapters_each_quote_their_own_layer_count(tmp_path, base):
    packed = pack_model(base, "Q8_0")
    a = write_adapter(tmp_path / "a.safetensors", "lora", packed, only=("blocks.0.",))          # 10 layers
    b = write_adapter(tmp_path / "b.safetensors", "lora", packed, seed=4, only=("blocks.1.ffn",))  # 2 layers
    specs = [AdapterSpec(a, 1.0, name="a"), AdapterSpec(b, 1.0, name="b")]
    with applied(packed, plan(packed, specs, "auto", "lossless"), fusion_backend=None) as rep:
        reasons = {d.name: d.reason for d in rep.decision.adapters}
    assert reasons["a"].startswith("10 of its 10 layers cannot take a merge"), reasons
    assert reasons["b"].startswith("2 of its 2 layers cannot take a merge"), reasons
    assert "12" not in reasons["a"] + reasons["b"]
    with pytest.raises(MergeRefusedError, match=r"adapter 'a' into layer 'blocks\.0\.[^']+': weight is GGUF Q8_0 "
                                                r"\(quantized/packed\) \(10 of its 10 layers\)"):
        with applied(packed, plan(packed, specs, "merge", "lossless"), fusion_backend=None):
            pass
    assert_no_runtime_left(packed)


def test_dora_norm_is_cached_across_calls_on_a_packed_weight(tmp_path, base):
    """The dequantized copy is fresh per call; its key is the packed storage's, so the DoRA norm
    is computed once, not per call (and recomputed after the packed bytes change)."""
    packed = pack_model(base, "Q8_0")
    path = write_adapter(tmp_path / "d.safetensors", "dora_out", packed, only=("blocks.0.ffn.0",))
    layer = packed.get_submodule("blocks.0.ffn.0")
    with applied(packed, plan(packed, [AdapterSpec(path, 1.0)], "dynamic", "lossless"), fusion_backend=None):
        upd = next(iter(attached_wrapper(layer).slots.values())).update
        with torch.no_grad():
            for _ in range(3):
                packed(_x())
        norms = [k for k in upd._cache if k[0] == "norm"]
        assert len(norms) == 1, norms
        with torch.no_grad():
            layer.weight.as_subclass(torch.Tensor)[0, 2] += 1   # a quant of row 0 changes in place
            packed(_x())
        assert len([k for k in upd._cache if k[0] == "norm"]) == 2


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_a_merge_never_writes_into_the_files_read_only_map(tmp_path, base, qtype):
    """ComfyUI-GGUF keeps CPU weights as views of a read-only memory map of the .gguf file (a
    write there kills the process). Here a layer's F16 / BF16 bytes are such a map: the merge
    writes into a private copy; the map keeps the file's bytes; outputs as on an in-memory base."""
    import warnings

    import numpy as np

    packed = pack_model(base, qtype)
    layer = packed.get_submodule("blocks.0.ffn.0")
    raw = layer.weight.as_subclass(torch.Tensor)
    f = tmp_path / "weight.bin"
    raw.contiguous().view(torch.uint8).numpy().tofile(f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "The given NumPy array is not writable": as ComfyUI-GGUF's loader
        mapped = torch.from_numpy(np.memmap(f, mode="r", dtype=np.uint8)).view(raw.dtype).reshape(raw.shape)
    layer.weight = nn.Parameter(PackedTensor(mapped, layer.weight.tensor_type, layer.weight.tensor_shape),
                                requires_grad=False)
    file_bytes = mapped.clone()
    path = write_adapter(tmp_path / "a.safetensors", "lora", packed)
    y, rep, merged = _run(packed, path, "merge", "exact", fusion_backend=None)
    assert "blocks.0.ffn.0" in merged and not torch.equal(merged["blocks.0.ffn.0"], float_view(layer.weight))
    assert torch.equal(mapped, file_bytes), "the map still holds the file's bytes"
    assert layer.weight.data_ptr() != mapped.data_ptr(), "the layer computes from its own copy now"
    assert torch.equal(layer.weight.as_subclass(torch.Tensor), file_bytes), "restored bit for bit"
    in_memory = pack_model(base, qtype)
    y_ref, _, _ = _run(in_memory, path, "merge", "exact", fusion_backend=None)
    assert torch.equal(y, y_ref)
