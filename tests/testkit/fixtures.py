"""Small models and adapter files in every dialect, for the engine tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn


class Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))


class Block(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.self_attn = Attn(d)
        self.cross_attn = Attn(d)
        self.ffn = nn.Sequential(nn.Linear(d, f), nn.GELU(approximate="tanh"), nn.Linear(f, d))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        a = self.self_attn
        x = x + a.o(torch.tanh(a.q(x)) * a.k(x) + a.v(x))
        c = self.cross_attn
        x = x + c.o(c.q(x) + c.k(x) * 0.5 + c.v(x))
        return x + self.ffn(self.norm(x))


class TinyWanLike(nn.Module):
    """Wan 2.1 module names (blocks.N.self_attn.q, ffn.0, ...), tiny dims."""

    def __init__(self, d=32, f=64, n=2, dtype=torch.float32, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.blocks = nn.ModuleList(Block(d, f) for _ in range(n))
        self.head = nn.Module()
        self.head.head = nn.Linear(d, d)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 10))
        self.to(dtype)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head.head(x)


def lora_pair(out_f, in_f, r, seed, scale=0.1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    down = torch.randn(r, in_f, generator=g) * scale
    up = torch.randn(out_f, r, generator=g) * scale
    return down.to(dtype), up.to(dtype)


def wrapped_lora_linear(out_f=256, in_f=192, r=16, rel=0.01, dtype=torch.bfloat16, seed=0):
    """A AdaptedLayer over a seeded Linear with one adapter "a" whose update is |dW|/|W| ~= rel."""
    from comfyui_lora_runtime.lora_runtime import AdaptedLayer
    from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter

    torch.manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f).to(dtype)
    down, up = lora_pair(out_f, in_f, r, seed + 5, 1.0)
    # scale the update to |dW|/|W| ~= rel
    dw = up @ down
    k = (rel * lin.weight.float().norm() / dw.norm()).sqrt()
    w = AdaptedLayer(lin, "layer")
    w.add_adapter("a", LayerAdapter("layer", down=(down * k).to(dtype), up=(up * k).to(dtype)), 1.0)
    return w


def linear_names(model):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def make_adapter_tensors(model, r=4, seed=1, scale=0.1, only=None, dtype=torch.float32):
    """{module_name: (down, up)} for every Linear (or those containing `only`)."""
    out = {}
    for i, name in enumerate(linear_names(model)):
        if only and not any(o in name for o in only):
            continue
        m = model.get_submodule(name)
        out[name] = lora_pair(m.out_features, m.in_features, r, seed * 1000 + i, scale, dtype)
    return out


def write_kohya(path, pairs, alpha=None, prefix="lora_unet_"):
    sd = {}
    for name, (down, up) in pairs.items():
        stem = prefix + name.replace(".", "_") if prefix else "diffusion_model." + name
        sd[f"{stem}.lora_down.weight"] = down.contiguous()
        sd[f"{stem}.lora_up.weight"] = up.contiguous()
        if alpha is not None:
            sd[f"{stem}.alpha"] = torch.tensor(float(alpha))
    save_file(sd, str(path))
    return Path(path)


def write_peft(path, pairs, alpha=None, prefix="base_model.model.", slot=None, name_map=None):
    sd = {}
    for name, (down, up) in pairs.items():
        n = name_map(name) if name_map else name
        mid = f".{slot}" if slot else ""
        sd[f"{prefix}{n}.lora_A{mid}.weight"] = down.contiguous()
        sd[f"{prefix}{n}.lora_B{mid}.weight"] = up.contiguous()
    meta = {"format": "pt"}
    if alpha is not None:
        r = next(iter(pairs.values()))[0].shape[0]
        meta["lora_adapter_metadata"] = json.dumps({"lora_alpha": alpha, "r": r})
    save_file(sd, str(path), metadata=meta)
    return Path(path)


def wan_native_to_diffusers(name: str) -> str:
    rep = [(".self_attn.q", ".attn1.to_q"), (".self_attn.k", ".attn1.to_k"), (".self_attn.v", ".attn1.to_v"),
           (".self_attn.o", ".attn1.to_out.0"), (".cross_attn.q", ".attn2.to_q"), (".cross_attn.k", ".attn2.to_k"),
           (".cross_attn.v", ".attn2.to_v"), (".cross_attn.o", ".attn2.to_out.0"), (".ffn.0", ".ffn.net.0.proj"),
           (".ffn.2", ".ffn.net.2")]
    for a, b in rep:
        if name.endswith(a):
            return name[: -len(a)] + b
    if name == "head.head":
        return "proj_out"
    return name


def reference_forward(x, w, b, slots, runtime_scale=1.0):
    """The eager reference path, written out by hand: per slot ((x A^T) B^T) * a/r * s * rs."""
    y = torch.nn.functional.linear(x, w, b)
    if runtime_scale == 0.0:
        return y
    for down, up, scale, strength in slots:
        if strength == 0.0:
            continue
        d = torch.nn.functional.linear(torch.nn.functional.linear(x, down), up)
        for f in (scale, strength, runtime_scale):
            if f != 1.0:
                d = d * f
        y = y + d
    return y


def truth_fp64(x, w, b, slots, runtime_scale=1.0):
    x, w = x.double(), w.double()
    y = x @ w.T + (b.double() if b is not None else 0)
    for down, up, aor, s in slots:
        y = y + (x @ down.double().T) @ up.double().T * (aor * s * runtime_scale)
    return y


def assert_lossless(out, ref, truth, what=""):
    """contracts.md s.1: vs fp64 truth, RMS and max error <= 1.5x the reference path's,
    mean error <= 0.25x the reference RMS; special values agree."""
    eo, er = out.double() - truth, ref.double() - truth
    rms_o, rms_r = eo.pow(2).mean().sqrt().item(), er.pow(2).mean().sqrt().item()
    max_o, max_r = eo.abs().max().item(), er.abs().max().item()
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), what
    assert rms_o <= 1.5 * rms_r + 1e-12, f"{what}: rms {rms_o:.3e} > 1.5 x reference {rms_r:.3e}"
    assert max_o <= 1.5 * max_r + 1e-12, f"{what}: max {max_o:.3e} > 1.5 x reference {max_r:.3e}"
    assert abs(eo.mean().item()) <= 0.25 * rms_r + 1e-12, f"{what}: mean error {eo.mean().item():.3e} biased"


def assert_no_runtime_left(model) -> None:
    from comfyui_lora_runtime.lora_runtime.layer.wrapper import runtime_leftovers
    assert runtime_leftovers(model) == []
