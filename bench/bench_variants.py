"""Dynamic cost of LoHa / LoKr / DoRA against plain LoRA of the same parameter count, per Linear.

Each row is one wrapped Linear (base GEMM + the adapter's dynamic delta, `lossless` tier)
timed in the same rounds as the plain-LoRA row (interleaved, order rotated round by
round); "x lora" is the median of the per-round ratios. The "base" row is the bare
Linear and "lora#2" a second plain-LoRA arm: its distance from 1.00 is this run's noise.

Same parameter count per linear (Wan2.1-1.3B FFN shapes, 1536 -> 8960 and 8960 -> 1536):
  lora      rank 16:                        16 (in + out) parameters
  loha      hada ranks 8 x 8:                2 x 8 (in + out)      -> a rank-64 Khatri-Rao pair
  lokr      w1 full [8, 8] (x) w2 = w2_a [out/8, r] w2_b [r, in/8], r chosen to match the count
  lokr/16   the same with w1 [16, 16]. A Kronecker update costs in*out/b flops per token (b = w1's
            columns) whatever its parameter count: 12.5 % of the base GEMM at b = 8, 6.25 % at 16
  dora      rank-16 LoRA + a magnitude per output row (PEFT layout: per-row norm path)
Target (issue 13): LoHa / LoKr dynamic <= 1.15x plain LoRA on the CPU.

    python bench/bench_variants.py [--tokens 1024] [--repeats 15] [--dtype fp32|bf16]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _timing import header, interleaved_rounds, parse_dtype  # noqa: E402

try:
    from comfyui_lora_runtime.lora_runtime import updates
    from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
    from comfyui_lora_runtime.lora_runtime.layer.runtime_context import runtime_context
    from comfyui_lora_runtime.lora_runtime.layer.wrapper import AdaptedLayer
except ImportError as e:  # pragma: no cover
    raise SystemExit(f"install the pack first (pip install -e .): {e}")


def _rnd(*shape, seed, scale=0.02):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def make_variants(out_f: int, in_f: int, seed: int = 0) -> dict[str, updates.Update]:
    r = 16
    n_params = r * (in_f + out_f)
    k = 8
    c, d = out_f // 8, in_f // 8
    r_kr = max(1, round((n_params - 64) / (c + d)))
    lora = updates.LoRA(_rnd(r, in_f, seed=seed), _rnd(out_f, r, seed=seed + 1), alpha=8.0)
    return {
        "lora": lora,
        "lora#2": updates.LoRA(_rnd(r, in_f, seed=seed + 2), _rnd(out_f, r, seed=seed + 3), alpha=8.0),
        "loha": updates.LoHa(_rnd(out_f, k, seed=seed + 4), _rnd(k, in_f, seed=seed + 5),
                              _rnd(out_f, k, seed=seed + 6), _rnd(k, in_f, seed=seed + 7), alpha=4.0),
        "lokr": updates.LoKr(w1=_rnd(8, 8, seed=seed + 8, scale=1.0), w2_a=_rnd(c, r_kr, seed=seed + 9),
                              w2_b=_rnd(r_kr, d, seed=seed + 10), alpha=float(r_kr)),
        "lokr/16": updates.LoKr(w1=_rnd(16, 16, seed=seed + 14, scale=1.0),
                                 w2_a=_rnd(out_f // 16, r16 := max(1, round((n_params - 256) / (out_f // 16 + in_f // 16))),
                                           seed=seed + 15),
                                 w2_b=_rnd(r16, in_f // 16, seed=seed + 16), alpha=float(r16)),
        "dora": updates.DoRA(updates.LoRA(_rnd(r, in_f, seed=seed + 11), _rnd(out_f, r, seed=seed + 12), alpha=8.0),
                              _rnd(out_f, 1, seed=seed + 13).abs() + 1.0),
    }


def params_of(v: updates.Update) -> int:
    return sum(t.numel() for k, t in v.tensors().items() if k not in ("dora_scale", "diff_b"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default="fp32")
    args = ap.parse_args()
    dtype = parse_dtype(args.dtype)
    print(header("cpu", f"tokens={args.tokens}, dtype={dtype}, tier=lossless, strength 0.8"))
    for in_f, out_f in ((1536, 8960), (8960, 1536)):
        base = nn.Linear(in_f, out_f).to(dtype)
        x = torch.randn(args.tokens, in_f).to(dtype)
        arms = {"base": lambda: base(x)}
        vs = make_variants(out_f, in_f)
        wrappers = {}
        for name, v in vs.items():
            lin = nn.Linear(in_f, out_f).to(dtype)
            lin.load_state_dict(base.state_dict())
            w = AdaptedLayer(lin, name)
            w.attach()
            w.add_adapter(name, LayerAdapter(name, update=v), 0.8)
            wrappers[name] = (lin, w)
            arms[name] = (lambda m=lin: m(x))

        def timed(arms=arms):
            with torch.no_grad(), runtime_context(tier="lossless"):
                return interleaved_rounds(arms, "cpu", refs=("lora",), warmup=2, repeats=args.repeats)

        stats = timed()
        print(f"\n## Linear {in_f} -> {out_f}")
        print(f"{'arm':8} {'params':>9} {'ms':>8} {'x lora':>7}  spread")
        for name in arms:
            st = stats[name]
            lo, hi = st.spread("lora")
            p = params_of(vs[name]) if name in vs else 0
            print(f"{name:8} {p:9d} {st.median_ms:8.2f} {st.ratio('lora'):7.3f}  [{lo:.3f}, {hi:.3f}]")
        for lin, w in wrappers.values():
            w.detach()


if __name__ == "__main__":
    with torch.no_grad():
        main()
