"""Layers whose weight the host stages itself (ComfyUI's dynamic VRAM), at the engine level.

The stand-in layer here does what ComfyUI 0.33's cast path does for such a layer, as far as the engine
can see it: the stored weight stays as loaded, the layer carries a virtual-VRAM range (``_v``) and may
carry ComfyUI's own LoRA as a ``weight_lowvram_function`` (a callable W -> W + dW applied before the
``weight_function`` list at every cast). The real ComfyUI path runs in
tests/integration/test_dynamic_vram_real.py.

Checked: every read of the base weight (DoRA norms, the merge decision) goes through the host's
lowvram patch, then its weight functions; a streamed layer is a merge refusal kept dynamic and named
per layer, the other layers still merge (each checked against the wrong answer: the previous set-wide
refusal, or a read of the stored weight alone); a parameter delta on a streamed module rides at cast time
and never writes the stored tensor; a cast-time patch never appends to a list the layer's class shares.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from comfyui_lora_runtime.lora_runtime import AdapterSpec, MergeRefusedError, applied, plan
from comfyui_lora_runtime.lora_runtime.apply import layer_outcomes, refusal_label
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
from comfyui_lora_runtime.lora_runtime.files.param_deltas import ParamDelta
from comfyui_lora_runtime.lora_runtime.layer import base_weight as bw
from comfyui_lora_runtime.lora_runtime.layer.wrapper import AdaptedLayer
from comfyui_lora_runtime.lora_runtime.layer.weight_merge import mergeable
from comfyui_lora_runtime.lora_runtime.param_patch import ParamPatch

from testkit.fixtures import TinyWanLike, lora_pair, make_adapter_tensors, write_kohya


class HostPatch:
    """ComfyUI's LowVramPatch as the engine sees it: called with the cast weight, returns W + dW
    summed in the weight's dtype (calculate_weight with intermediate_dtype = weight.dtype)."""

    def __init__(self, dw: torch.Tensor):
        self.dw, self.calls = dw, 0

    def __call__(self, weight):
        self.calls += 1
        return weight + self.dw.to(weight.device, weight.dtype)


class StagedLinear(nn.Linear):
    """A Linear as ComfyUI's dynamic VRAM runs it: ``_v`` set, the weight cast per call through
    ``weight_lowvram_function`` and then ``weight_function`` (the stored tensor is never changed)."""

    weight_function: list = []   # declared on the class, as comfy.ops does
    bias_function: list = []

    def __init__(self, *a, host_patch=None, **k):
        super().__init__(*a, **k)
        self._v = ("vbar", 0, self.weight.numel() * self.weight.element_size())
        self.weight_lowvram_function = host_patch
        self.bias_lowvram_function = None

    def forward(self, x):
        w = self.weight.to(x.dtype)
        if self.weight_lowvram_function is not None:
            w = self.weight_lowvram_function(w)
        for f in self.weight_function:
            w = f(w)
        b = self.bias
        for f in self.bias_function:
            b = f(b)
        return F.linear(x, w, b)


def _staged(out_f=48, in_f=40, seed=0, host_dw=None):
    torch.manual_seed(seed)
    lin = StagedLinear(in_f, out_f, host_patch=HostPatch(host_dw) if host_dw is not None else None)
    return lin


def test_base_weight_reads_through_the_hosts_lowvram_patch_then_its_weight_functions():
    g = torch.Generator().manual_seed(1)
    dw = torch.randn(48, 40, generator=g) * 0.05
    lin = _staged(host_dw=dw)
    scale = 1.25
    lin.weight_function = [lambda t: t * scale]   # an instance list, as the dynamic loader sets one
    read = bw.base_weight(lin)
    assert not read.writable and read.reason == bw.STREAMED
    # the host's order: lowvram patch first, then the weight functions ((W + dW) * 1.25, not W * 1.25 + dW)
    assert torch.equal(read.tensor, (lin.weight.float() + dw) * scale)
    wrong = lin.weight.float() * scale + dw
    assert (read.tensor - wrong).abs().max() > 1e-3
    # without a host patch the stored weight is what the layer multiplies with: a view, not a copy
    plain = _staged()
    assert bw.base_weight(plain).tensor.data_ptr() == plain.weight.data_ptr()
    # the key of a dequantized read names the host patch: a DoRA norm cached for it is not reused without it
    assert getattr(read.tensor, bw.KEY_ATTR) != getattr(bw.base_weight(_staged(host_dw=dw * 2)).tensor, bw.KEY_ATTR)


def test_a_streamed_layer_takes_no_merge_no_fused_read_and_no_output_subtraction():
    lin = _staged()
    w = AdaptedLayer(lin, "l")
    ok, why = mergeable(w)
    assert not ok and why == bw.STREAMED and refusal_label(why) == "streamed (dynamic VRAM)"
    assert "dynamic VRAM" in bw.fused_read_reason(lin)
    assert w.base_bias_to_subtract() == (True, lin.bias)   # no host patch: x W^T is the output minus b
    lin.weight_lowvram_function = HostPatch(torch.zeros(48, 40))
    assert w.base_bias_to_subtract() == (False, None)       # the host adds its patch per call
    # the wrong answer: a plain Linear of the same weight merges
    assert mergeable(AdaptedLayer(nn.Linear(40, 48), "p")) == (True, "")


def test_dora_norms_include_the_hosts_patch_on_the_same_weight():
    """Per-row DoRA over a weight ComfyUI also patches: the layer computes with W + dWc, so the norm
    is ||W + dWc + s dW||; read off the stored W alone it is the wrong norm."""
    g = torch.Generator().manual_seed(3)
    out_f, in_f, r = 48, 40, 4
    dwc = torch.randn(out_f, in_f, generator=g) * 0.3
    lin = _staged(out_f, in_f, host_dw=dwc).double()
    lin.weight_lowvram_function.dw = dwc.double()
    down, up = lora_pair(out_f, in_f, r, seed=4, scale=0.3, dtype=torch.float64)
    mag = torch.rand(out_f, 1, generator=g, dtype=torch.float64) + 0.5
    w = AdaptedLayer(lin, "l")
    w.attach()
    w.add_adapter("dora", LayerAdapter("l", down=down, up=up, alpha=2.0, dora_scale=mag), 0.8)
    x = torch.randn(3, in_f, generator=g, dtype=torch.float64)
    with torch.no_grad():
        y = lin(x)
    s = 2.0 / r

    def dora_out(w_base):
        v = w_base + s * (up @ down)
        wp = mag * v / (v.norm(dim=1, keepdim=True) + torch.finfo(torch.float32).eps)
        w_final = w_base + 0.8 * (wp - w_base)
        return F.linear(x, w_final, lin.bias)

    w_eff = lin.weight.detach() + dwc.double()
    ref = dora_out(w_eff)
    # the wrong answer: norms of the stored weight only, the host's patch then added on top
    wrong = dora_out(lin.weight.detach()) + F.linear(x, dwc.double())
    err, miss = (y - ref).abs().max().item(), (wrong - ref).abs().max().item()
    # the engine reads base weights and computes DoRA norms in fp32 (the layer is fp64): fp32 rounding
    assert err < 2e-6, err
    assert miss > 1e-3, miss
    assert lin.weight_lowvram_function.calls >= 2   # the host cast and our read both went through it
    w.detach()


class TwoStaged(nn.Module):
    """Two Linears on one input: `a` plain, `b` streamed (the host stages its weight)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 32).to(torch.bfloat16)
        self.b = StagedLinear(32, 32).to(torch.bfloat16)
        self.b._v = ("vbar", 0, 2048)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.fixture
def two_files(tmp_path):
    ref = TwoStaged()
    names = ["a", "b"]
    tensors = make_adapter_tensors(ref, r=4, seed=1, scale=0.25, only=None)
    return write_kohya(tmp_path / "style.safetensors", {k: v for k, v in tensors.items() if k in names}, alpha=4.0)


@pytest.mark.parametrize("mode", ["auto", "merge"])
def test_a_streamed_layer_stays_dynamic_the_others_merge_and_the_report_names_each(two_files, mode):
    model = TwoStaged()
    snap = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad(), applied(model, plan(model, [AdapterSpec(str(two_files))], mode, "exact")) as rep:
        y = model(x)
        merged = {n: w.merged for n, w in [("a", model.a._lora_runtime), ("b", model.b._lora_runtime)]}
    assert merged == {"a": True, "b": False}      # the wrong answer (a set-wide refusal) merged neither
    d = rep.decision
    assert d.chosen == "merge" and d.kept_dynamic == {"b": bw.STREAMED}, d
    assert "1 layers stay dynamic (streamed (dynamic VRAM)" in d.reason
    groups = {g["what"]: g["names"] for g in rep.layers}
    assert groups == {"merged": ["a"], "streamed (dynamic VRAM): dynamic": ["b"]}
    with torch.no_grad(), applied(model, plan(model, [AdapterSpec(str(two_files))], "dynamic", "exact")):
        y_dyn = model(x)
    with torch.no_grad():
        y_base = model(x)
    # merged a + dynamic b vs all dynamic: bf16 rounding of one merge apart; both far from the base
    assert (y - y_dyn).float().abs().max() < 0.05 < (y - y_base).float().abs().max()
    for k, v in model.state_dict().items():
        assert torch.equal(v, snap[k]), k


def test_layer_outcomes_group_every_layer_once():
    lin = [AdaptedLayer(nn.Linear(4, 4), f"l{i}") for i in range(4)]
    la = LayerAdapter("x", down=torch.ones(1, 4), up=torch.ones(4, 1))
    for w in lin:
        w.add_adapter("a", la, 1.0)
    lin[0].merge()
    lin[1].merge_refusal = "re-staged at every load (dynamic VRAM): copied at every load"
    lin[2].base_layer._v = ("vbar", 0, 64)
    got = {g["what"]: (g["layers"], g["names"]) for g in layer_outcomes(lin)}
    assert got == {"merged": (1, ["l0"]), "re-staged at every load (dynamic VRAM): dynamic": (1, ["l1"]),
                   "streamed (dynamic VRAM): dynamic": (1, ["l2"]), "dynamic": (1, ["l3"])}
    lin[0].unmerge()


def test_a_parameter_delta_on_a_streamed_module_rides_at_cast_time_and_never_writes_the_tensor():
    norm = nn.LayerNorm(16).to(torch.bfloat16)
    norm._v = ("vbar", 0, 64)
    # a module without cast-time lists cannot take it: refused by name, never dropped silently
    pp0 = ParamPatch("n.weight", norm.weight, cast_site=(norm, "weight"))
    pp0.add("a", ParamDelta("n", "diff", "n.weight", torch.ones(16)), 1.0)
    with pytest.raises(MergeRefusedError, match="n.weight: the host stages this module's weights itself"):
        pp0.merge()
    norm.weight_function, norm.bias_function = [], []   # what comfy.ops' cast layers carry
    stored = norm.weight.detach().clone()
    delta = torch.linspace(-0.5, 0.5, 16)
    pp = ParamPatch("n.weight", norm.weight, cast_site=(norm, "weight"))
    pp.add("a", ParamDelta("n", "diff", "n.weight", delta), 0.5)
    pp.merge()
    assert pp.merged and torch.equal(norm.weight, stored)     # the stored tensor is not written
    assert "weight_function" in norm.__dict__ and len(norm.weight_function) == 1
    cast = norm.weight_function[0](norm.weight.detach())
    assert torch.equal(cast, (stored.float() + 0.5 * delta).to(torch.bfloat16))
    assert not torch.equal(cast, stored)                      # the wrong answer: the delta dropped
    pp.restore()
    assert norm.weight_function == [] and torch.equal(norm.weight, stored) and not pp.merged


def test_a_cast_time_patch_never_lands_on_a_list_the_class_shares():
    a, b = StagedLinear(8, 8), StagedLinear(8, 8)
    del a.__dict__["weight_lowvram_function"]
    a.weight_lowvram_function = None
    lst = bw.instance_list(a, "weight_function")
    lst.append("x")
    assert a.weight_function == ["x"] and b.weight_function == [] and StagedLinear.weight_function == []
    assert bw.instance_list(nn.Linear(2, 2), "weight_function") is None
