"""Every adapter variant end to end: file -> load -> match -> apply -> the layer's output.

Per variant x {dynamic, merge} x {exact, lossless}: the layer output equals an fp64
reference computed here from the variant's published maths (not from `variants`),
and is far from the wrong answers (adapter off; the variant misread as plain LoRA).
`exact` is also compared bit for bit with the eager reference path, merges restore
bit for bit, and `auto` decides on the variant's real delta.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from comfyui_lora_runtime.lora_runtime import AdapterSpec, applied, plan
from comfyui_lora_runtime.lora_runtime.layer.runtime_context import runtime_context
from comfyui_lora_runtime.lora_runtime.layer.wrapper import attached_wrapper

from testkit.fixtures import TinyWanLike, assert_no_runtime_left

LAYER = "blocks.0.ffn.0"          # Linear 32 -> 64
OUT, IN = 64, 32
EPS32 = torch.finfo(torch.float32).eps
STRENGTH = 0.8


def rnd(*shape, seed, scale=0.3):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# --- the variants' maths, written out in fp64 (ComfyUI weight_adapter / LyCORIS / PEFT) ------------
def _lora(p):
    return p["up"] @ p["down"] * (p["alpha"] / p["down"].shape[0])


def _loha(p):
    f1 = p["hada_w1_a"] @ p["hada_w1_b"]
    f2 = p["hada_w2_a"] @ p["hada_w2_b"]
    return f1 * f2 * (p["alpha"] / p["hada_w1_b"].shape[0])


def _loha_cp(p):
    f1 = p["hada_w1_a"].T @ p["hada_t1"] @ p["hada_w1_b"]
    f2 = p["hada_w2_a"].T @ p["hada_t2"] @ p["hada_w2_b"]
    return f1 * f2 * (p["alpha"] / p["hada_w1_b"].shape[0])


def _lokr(p):
    return torch.kron(p["lokr_w1"], p["lokr_w2_a"] @ p["lokr_w2_b"]) * (p["alpha"] / p["lokr_w2_b"].shape[0])


def _lokr_tucker(p):
    w2 = p["lokr_w2_a"].T @ p["lokr_t2"] @ p["lokr_w2_b"]
    return torch.kron(p["lokr_w1"], w2) * (p["alpha"] / p["lokr_w2_b"].shape[0])


def _dora(axis):
    def delta(p, w):
        wc = w + _lora(p)
        m = p["dora_scale"].reshape(-1)
        if axis == "out":
            wd = wc * (m / (wc.norm(dim=1) + EPS32)).unsqueeze(1)
        else:
            wd = wc * (m / (wc.norm(dim=0) + EPS32)).unsqueeze(0)
        return wd - w
    return delta


def _full(p):
    return p["diff"]


def parts_of(kind, seed=5):
    r = 4
    if kind in ("lora", "dora_out", "dora_in"):
        p = {"down": rnd(r, IN, seed=seed), "up": rnd(OUT, r, seed=seed + 1), "alpha": 2.0}
        if kind == "dora_out":
            p["dora_scale"] = rnd(OUT, 1, seed=seed + 2).abs() + 1.0
        if kind == "dora_in":
            p["dora_scale"] = rnd(1, IN, seed=seed + 2).abs() + 1.0
        return p
    if kind == "loha":
        return {"hada_w1_a": rnd(OUT, r, seed=seed), "hada_w1_b": rnd(r, IN, seed=seed + 1),
                "hada_w2_a": rnd(OUT, r, seed=seed + 2), "hada_w2_b": rnd(r, IN, seed=seed + 3), "alpha": 2.0}
    if kind == "loha_cp":
        return {"hada_w1_a": rnd(r, OUT, seed=seed), "hada_t1": rnd(r, r, seed=seed + 4),
                "hada_w1_b": rnd(r, IN, seed=seed + 1), "hada_w2_a": rnd(r, OUT, seed=seed + 2),
                "hada_t2": rnd(r, r, seed=seed + 5), "hada_w2_b": rnd(r, IN, seed=seed + 3), "alpha": 2.0}
    if kind == "lokr":  # kron([4, 2], [16, 16]) = [64, 32]
        return {"lokr_w1": rnd(4, 2, seed=seed), "lokr_w2_a": rnd(16, 2, seed=seed + 1),
                "lokr_w2_b": rnd(2, 16, seed=seed + 2), "alpha": 1.0}
    if kind == "lokr_tucker":
        return {"lokr_w1": rnd(4, 2, seed=seed), "lokr_w2_a": rnd(3, 16, seed=seed + 1),
                "lokr_t2": rnd(3, 2, seed=seed + 3), "lokr_w2_b": rnd(2, 16, seed=seed + 2), "alpha": 1.0}
    if kind == "full":
        return {"diff": rnd(OUT, IN, seed=seed, scale=0.05)}
    raise KeyError(kind)


TRUTH = {"lora": _lora, "loha": _loha, "loha_cp": _loha_cp, "lokr": _lokr, "lokr_tucker": _lokr_tucker,
         "full": _full}
# the wrong answer of reading the file as plain LoRA (or ignoring the part that makes the variant)
MISREAD = {
    "loha": lambda p, w: p["hada_w1_a"] @ p["hada_w1_b"] * (p["alpha"] / p["hada_w1_b"].shape[0]),
    "loha_cp": lambda p, w: p["hada_w1_a"].T @ p["hada_t1"] @ p["hada_w1_b"],
    "lokr": lambda p, w: (p["lokr_w2_a"] @ p["lokr_w2_b"]).repeat(4, 2) * (p["alpha"] / 2),  # kron(ones, w2)
    "lokr_tucker": lambda p, w: (p["lokr_w2_a"].T @ p["lokr_t2"] @ p["lokr_w2_b"]).repeat(4, 2),
    "dora_out": lambda p, w: _lora(p),
    "dora_in": lambda p, w: _lora(p),
}
KINDS = ["lora", "loha", "loha_cp", "lokr", "lokr_tucker", "dora_out", "dora_in", "full"]


def truth_delta(kind, p, w):
    p64 = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in p.items()}
    if kind.startswith("dora"):
        return _dora(kind.split("_")[1])(p64, w.double())
    return TRUTH[kind](p64)


def write(path, kind, p, layer=LAYER):
    t = {}
    for k, v in p.items():
        if k == "alpha":
            t[f"diffusion_model.{layer}.alpha"] = torch.tensor(float(v))
        elif k in ("down", "up"):
            t[f"diffusion_model.{layer}.lora_{k}.weight"] = v.contiguous()
        else:
            t[f"diffusion_model.{layer}.{k}"] = v.contiguous()
    save_file(t, str(path))
    return str(path)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["dynamic", "merge"])
@pytest.mark.parametrize("tier", ["exact", "lossless"])
def test_variant_output_against_fp64_and_wrong_answers(tmp_path, kind, mode, tier):
    model = TinyWanLike()
    layer = model.get_submodule(LAYER)
    w0, b0 = layer.weight.detach().clone(), layer.bias.detach().clone()
    p = parts_of(kind)
    path = write(tmp_path / f"{kind}.safetensors", kind, p)
    x = rnd(3, 7, IN, seed=42, scale=1.0)
    d64 = truth_delta(kind, p, w0)
    truth = x.double() @ (w0.double() + STRENGTH * d64).T + b0.double()
    pl = plan(model, [AdapterSpec(path, STRENGTH)], mode, tier)
    with applied(model, pl, fusion_backend=None) as rep:
        with torch.no_grad():
            y = layer(x)
        w = attached_wrapper(layer)
        slot = next(iter(w.slots.values()))
        assert slot.update.kind == {"full": "diff"}.get(kind, kind.split("_")[0]), slot.update
        assert rep.decision.chosen == mode
        assert w.merged == (mode == "merge")
        if tier == "exact":  # bit for bit against the eager reference path, written out here
            v = slot.update
            with torch.no_grad():
                if mode == "merge":
                    wm = (w0.float() + v.delta("cpu", torch.float32, weight=w0).mul_(STRENGTH)).to(w0.dtype)
                    ref = F.linear(x, wm, b0)
                elif kind == "lora":  # ((x A^T) B^T), then alpha/rank, then strength
                    d = F.linear(F.linear(x, p["down"]), p["up"]) * (p["alpha"] / 4) * STRENGTH
                    ref = F.linear(x, w0, b0) + d
                else:
                    ref = F.linear(x, w0, b0) + v.forward(x, 1.0, weight=w0, include_bias=False) * STRENGTH
            assert torch.equal(y, ref), f"{kind} {mode}: exact is not the reference path"
    # fp32 end to end against fp64 maths: rounding of a few fp32 GEMMs
    assert rel(y, truth) < 2e-6, (kind, mode, tier, rel(y, truth))
    off = x.double() @ w0.double().T + b0.double()
    assert rel(off, truth) > 1e-2, "the adapter must change the layer visibly for this test to mean anything"
    if kind in MISREAD:
        wrong = x.double() @ (w0.double() + STRENGTH * MISREAD[kind](
            {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in p.items()}, w0.double())).T + b0.double()
        assert rel(wrong, truth) > 1e-2 and rel(y, wrong) > 1e-2
    # restored bit for bit, nothing left attached
    assert torch.equal(layer.weight, w0) and torch.equal(layer.bias, b0)
    assert_no_runtime_left(model)


@pytest.mark.parametrize("kind", ["loha", "lokr", "dora_out"])
def test_auto_decides_on_the_variants_real_delta(tmp_path, kind):
    """bf16 weights: a sub-ulp update of the variant stays dynamic, a large one merges."""
    decided = {}
    for size, scale in (("tiny", 1e-3), ("large", 1.0)):
        model = TinyWanLike(dtype=torch.bfloat16)
        p = parts_of(kind)
        if kind == "dora_out":  # magnitude = the weight's own row norms x (1 + size): the update is that size
            w = model.get_submodule(LAYER).weight.double()
            wc = w + _lora({k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in p.items()}) * 0
            p["up"] = p["up"] * 0
            p["dora_scale"] = (wc.norm(dim=1, keepdim=True) * (1 + (1e-5 if size == "tiny" else 0.3))).float()
        else:
            key = next(k for k in p if k.endswith(("w1_a", "lokr_w1")))
            p[key] = p[key] * scale * (1e-2 if size == "tiny" else 1.0)
        path = write(tmp_path / f"{kind}-{size}.safetensors", kind, p)
        with applied(model, plan(model, [AdapterSpec(path, 1.0)], "auto", "lossless"), fusion_backend=None) as rep:
            a = rep.decision.adapters[0]
            decided[size] = (a.chosen, a.share_lost)
    assert decided["tiny"][0] == "dynamic" and decided["tiny"][1] > 0.5, decided
    assert decided["large"][0] == "merge" and decided["large"][1] < 0.5, decided


# --- conv (LoCon) on a patch embedding ---------------------------------------------------------------
class PatchEmbedModel(nn.Module):
    """Wan's patch_embedding: Conv3d(in=4, out=16, kernel=stride=(1, 2, 2)), plus a modulation
    parameter and a norm, as the distillation adapters touch them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.patch_embedding = nn.Conv3d(4, 16, (1, 2, 2), stride=(1, 2, 2))
        self.blocks = nn.ModuleList([nn.Module()])
        self.blocks[0].modulation = nn.Parameter(torch.randn(1, 6, 16) / 4)
        self.blocks[0].norm3 = nn.LayerNorm(16)
        self.blocks[0].ffn = nn.Sequential(nn.Linear(16, 16))

    def forward(self, x):
        h = self.patch_embedding(x).flatten(2).transpose(1, 2)        # [B, L, 16]
        mod = self.blocks[0].modulation
        h = self.blocks[0].norm3(h) * (1 + mod[:, 1]) + mod[:, 0]
        return self.blocks[0].ffn(h)


@pytest.mark.parametrize("mode", ["dynamic", "merge"])
@pytest.mark.parametrize("form", ["locon", "diff"])
def test_conv_update_on_patch_embedding(tmp_path, mode, form):
    m = PatchEmbedModel()
    conv = m.patch_embedding
    w0, b0 = conv.weight.detach().clone(), conv.bias.detach().clone()
    r = 3
    down, up = rnd(r, 4, 1, 2, 2, seed=1), rnd(16, r, 1, 1, 1, seed=2)
    if form == "locon":
        t = {"diffusion_model.patch_embedding.lora_down.weight": down,
             "diffusion_model.patch_embedding.lora_up.weight": up,
             "diffusion_model.patch_embedding.alpha": torch.tensor(1.5),
             "diffusion_model.blocks.0.ffn.0.lora_down.weight": rnd(2, 16, seed=3),
             "diffusion_model.blocks.0.ffn.0.lora_up.weight": rnd(16, 2, seed=4)}
        dw = (up.double().flatten(1) @ down.double().flatten(1)).reshape(w0.shape) * (1.5 / r)
    else:
        dw = rnd(16, 4, 1, 2, 2, seed=5, scale=0.1).double()
        t = {"diffusion_model.patch_embedding.diff": dw.float(), "diffusion_model.patch_embedding.diff_b": rnd(16, seed=6),
             "diffusion_model.blocks.0.ffn.0.lora_down.weight": rnd(2, 16, seed=3),
             "diffusion_model.blocks.0.ffn.0.lora_up.weight": rnd(16, 2, seed=4)}
    save_file(t, str(tmp_path / "c.safetensors"))
    x = rnd(2, 4, 3, 8, 8, seed=7, scale=1.0)
    db = t["diffusion_model.patch_embedding.diff_b"].double() if form == "diff" else 0
    truth = F.conv3d(x.double(), w0.double() + 0.7 * dw, b0.double() + 0.7 * db, stride=(1, 2, 2))
    with applied(m, plan(m, [AdapterSpec(str(tmp_path / "c.safetensors"), 0.7)], mode, "lossless"),
                 fusion_backend=None) as rep:
        with torch.no_grad():
            y = conv(x)
        assert rep.coverage[0].kinds.get("lora" if form == "locon" else "diff") >= 1
        assert attached_wrapper(conv).merged == (mode == "merge")
    assert rel(y, truth) < 2e-6
    assert rel(F.conv3d(x, w0, b0, stride=(1, 2, 2)), truth) > 1e-2
    assert torch.equal(conv.weight, w0) and torch.equal(conv.bias, b0)
    assert_no_runtime_left(m)


@pytest.mark.parametrize("mode", ["dynamic", "merge", "auto"])
def test_norm_and_bare_parameter_deltas_are_merged_and_restored(tmp_path, mode):
    """lightx2v-style files: diff on modulation (bare parameter), w_norm/b_norm and
    diff/diff_b on a norm. Merged in every mode (no forward of their own), listed on the
    report with the share rounded away, restored bit for bit."""
    m = PatchEmbedModel().to(torch.bfloat16)
    snap = {k: v.detach().clone() for k, v in m.state_dict().items()}
    dm, dn, dnb = rnd(1, 6, 16, seed=8, scale=0.05), rnd(16, seed=9, scale=0.05), rnd(16, seed=10, scale=0.05)
    t = {"diffusion_model.blocks.0.modulation.diff_m": dm,
         "diffusion_model.blocks.0.norm3.w_norm": dn, "diffusion_model.blocks.0.norm3.b_norm": dnb,
         "diffusion_model.blocks.0.ffn.0.lora_down.weight": rnd(2, 16, seed=3),
         "diffusion_model.blocks.0.ffn.0.lora_up.weight": rnd(16, 2, seed=4)}
    save_file(t, str(tmp_path / "d.safetensors"))
    with applied(m, plan(m, [AdapterSpec(str(tmp_path / "d.safetensors"), 1.0)], mode, "lossless"),
                 fusion_backend=None) as rep:
        got_m = m.blocks[0].modulation.detach().clone()
        got_w = m.blocks[0].norm3.weight.detach().clone()
        got_b = m.blocks[0].norm3.bias.detach().clone()
        params = {p["param"] for p in rep.params}
        assert params == {"blocks.0.modulation", "blocks.0.norm3.weight", "blocks.0.norm3.bias"}
        assert rep.coverage[0].keys_applied == rep.coverage[0].keys_total == 5
    assert torch.equal(got_m, (snap["blocks.0.modulation"].float() + dm).bfloat16())
    assert torch.equal(got_w, (snap["blocks.0.norm3.weight"].float() + dn).bfloat16())
    assert torch.equal(got_b, (snap["blocks.0.norm3.bias"].float() + dnb).bfloat16())
    assert not torch.equal(got_m, snap["blocks.0.modulation"])  # the wrong answer: left out
    for k, v in m.state_dict().items():
        assert torch.equal(v, snap[k]), k
    assert_no_runtime_left(m)


def test_sliced_updates_on_a_fused_weight(tmp_path):
    """Three LoRAs on the q, k, v thirds of one fused qkv Linear (as diffusers-named Flux
    files are): dynamic and merged equal the fp64 block-stacked delta."""
    from comfyui_lora_runtime.lora_runtime import updates
    from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
    from comfyui_lora_runtime.lora_runtime.layer.wrapper import AdaptedLayer

    d = 16
    lin = nn.Linear(d, 3 * d)
    w0 = lin.weight.detach().clone()
    loras = [updates.LoRA(rnd(2, d, seed=i), rnd(d, 2, seed=10 + i), alpha=1.0 + i, stem=f"to_{'qkv'[i]}")
             for i in range(3)]
    sliced = updates.Sliced([(i * d, (i + 1) * d, v) for i, v in enumerate(loras)], 3 * d, stem="qkv")
    full = torch.cat([v.up.double() @ v.down.double() * v.scale for v in loras], 0)
    x = rnd(5, d, seed=3, scale=1.0)
    truth = x.double() @ (w0.double() + 0.5 * full).T + lin.bias.double()
    w = AdaptedLayer(lin, "qkv")
    w.attach()
    w.add_adapter("a", LayerAdapter("qkv", update=sliced), 0.5)
    for tier in ("exact", "lossless"):
        with torch.no_grad(), runtime_context(tier=tier):
            y_dyn = lin(x)
    w.merge()
    with torch.no_grad():
        y_merged = lin(x)
    w.unmerge()
    w.detach()
    assert torch.equal(lin.weight, w0)
    for y in (y_dyn, y_merged):
        assert rel(y, truth) < 2e-6
    # the wrong answer: every slice's update on the whole weight's first rows (slices ignored)
    wrong = x.double() @ (w0.double() + 0.5 * torch.cat([full[:d], torch.zeros(2 * d, d, dtype=torch.float64)])).T
    assert rel(y_dyn, wrong + lin.bias.double()) > 1e-2
    assert sliced.stack() is None


@pytest.mark.parametrize("mode", ["dynamic", "merge", "auto"])
@pytest.mark.parametrize("kind", ["dora_out", "dora_in"])
def test_dora_on_inference_mode_weights(tmp_path, kind, mode):
    """ComfyUI creates its weights under torch.inference_mode: they keep no version counter.
    DoRA (whose delta depends on the weight) must still load, decide, merge and restore."""
    with torch.inference_mode():
        model = TinyWanLike()
    layer = model.get_submodule(LAYER)
    w0 = layer.weight.detach().clone()
    p = parts_of(kind)
    path = write(tmp_path / f"{kind}.safetensors", kind, p)
    x = rnd(3, 7, IN, seed=42, scale=1.0)
    truth = x.double() @ (w0.double() + STRENGTH * truth_delta(kind, p, w0)).T + layer.bias.double()
    with torch.inference_mode():
        with applied(model, plan(model, [AdapterSpec(path, STRENGTH)], mode, "lossless"), fusion_backend=None):
            y = layer(x)
        assert torch.equal(layer.weight, w0)
    assert rel(y, truth) < 2e-6


def test_row_dora_says_which_norm_it_uses(tmp_path):
    from comfyui_lora_runtime.lora_runtime import load_adapter
    out = load_adapter(write(tmp_path / "o.safetensors", "dora_out", parts_of("dora_out")))
    assert any("||W + s·ΔW||" in n and "ComfyUI" in n for n in out.notes)
    col = load_adapter(write(tmp_path / "i.safetensors", "dora_in", parts_of("dora_in")))
    assert not any("DoRA" in n for n in col.notes)  # per-column: the same in ComfyUI, PEFT and LyCORIS
