"""Side-by-side cost of one LoRA-carrying Linear: PEFT shape, our wrapper (both tiers), merged.

Every row is timed in pairs with the base F.linear of its shape and dtype (base call,
then the row's call, each round; arm order rotated round by round) and reported as
the median of the per-round ratios ("x base"). The "base" row times base against
itself: its distance from 1.00 is the noise of this run.

Rows (per shape, dtype, rank, adapter count):
  peft      y = F.linear(x, W, b); y = y + F.linear(F.linear(x, A_i), B_i) * s_i  per adapter
            (PEFT's forward: out of place, one GEMM pair and one multiply per adapter)
  dynamic   AdaptedLayer under runtime_context(tier="lossless"): the stacked GEMM pair,
            delta accumulated into y in place by addmm_ with the scale as alpha
  exact     AdaptedLayer under runtime_context(tier="exact"): the reference path, per
            adapter ((x A^T) B^T), each non-unit factor multiplied in order, y = y + delta
  merged    F.linear(x, W + sum_i s_i B_i A_i, b) (base cost on a merged weight; the
            same cost at every rank and adapter count, so it is a second noise row)
Adapters: alpha = rank/2; one adapter at strength 0.8 (uniform factor 0.4), or three
stacked at strengths 0.8 / 0.5 / 1.2 (per-adapter factors differ: the dynamic path
multiplies the small [T, 3r] tensor by a per-rank vector first).
"flops" = extra FLOPs of the low-rank pair over the base GEMM: R (in+out) / (in out),
R = rank x adapters.

Shapes: Wan2.1-1.3B FFN (1536 -> 8960) and Flux (3072 -> 12288); ranks 16/64/128;
tokens 1024 / 512 on the CPU, 4096 / 4096 on CUDA.
Target: dynamic <= 1.10x base at ranks 16-64 on the CPU.

    python bench/bench_lora_linear.py [--device cpu|cuda] [--quick] [--dtype bf16|fp32|both]
        [--repeats N] [--tokens N] [--threads N]
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
from comfyui_lora_runtime.lora_runtime.layer.runtime_context import runtime_context
from comfyui_lora_runtime.lora_runtime.layer.wrapper import AdaptedLayer

from _timing import dtype_name, header, load_string, paired_rounds, parse_dtype, resolve_device

SHAPES = {"wan-1.3b-ffn": (1536, 8960), "flux": (3072, 12288)}
CPU_TOKENS = {"wan-1.3b-ffn": 1024, "flux": 512}
CUDA_TOKENS = {"wan-1.3b-ffn": 4096, "flux": 4096}
RANKS = (16, 64, 128)
STRENGTHS = {1: (0.8,), 3: (0.8, 0.5, 1.2)}
TARGET_RANKS, TARGET = (16, 64), 1.10


def make_case(k, n, tokens, rank, n_adapters, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g).to(device, dtype)
    base = nn.Linear(k, n, device="cpu")
    with torch.no_grad():
        base.weight.copy_(torch.randn(n, k, generator=g) / k ** 0.5)
        base.bias.copy_(torch.randn(n, generator=g) * 0.1)
    base = base.to(device, dtype).requires_grad_(False)
    w, b = base.weight, base.bias
    wrapped = AdaptedLayer(base, "bench")
    peft, delta = [], torch.zeros(n, k)
    for i, strength in enumerate(STRENGTHS[n_adapters]):
        down = torch.randn(rank, k, generator=g) / k ** 0.5
        up = torch.randn(n, rank, generator=g) / rank ** 0.5 * 0.05
        alpha = rank / 2
        la = LayerAdapter(f"bench.{i}", down=down.to(dtype), up=up.to(dtype), alpha=alpha)
        wrapped.add_adapter(f"a{i}", la, strength)
        s = alpha / rank * strength
        peft.append((down.to(device, dtype), up.to(device, dtype), s))
        delta += s * (la.update.up.float() @ la.update.down.float())
    merged = (w.float().cpu() + delta).to(device, dtype)
    return x, w, b, wrapped, peft, merged


def run_case(name, tokens, rank, n_adapters, dtype, device, args):
    k, n = SHAPES[name]
    x, w, b, wrapped, peft, merged = make_case(k, n, tokens, rank, n_adapters, dtype, device, seed=rank + n_adapters)

    def base():
        return F.linear(x, w, b)

    def peft_fwd():
        y = F.linear(x, w, b)
        for a, bb, s in peft:
            y = y + F.linear(F.linear(x, a), bb) * s
        return y

    def dynamic():
        with runtime_context(tier="lossless"):
            return wrapped(x)

    def exact():
        with runtime_context(tier="exact"):
            return wrapped(x)

    def merged_fwd():
        return F.linear(x, merged, b)

    with torch.inference_mode():
        # the arms must compute the same thing, or the timing compares nothing
        ref = exact().float()
        d_norm = (ref - base().float()).norm()
        for arm, fn in (("peft", peft_fwd), ("dynamic", dynamic), ("merged", merged_fwd)):
            err = (fn().float() - ref).norm() / d_norm
            tol = 0.05 if dtype == torch.float32 else 0.5  # merged bf16 rounds the delta away partly
            if not err < tol:
                print(f"!! {name} r{rank} x{n_adapters} {dtype_name(dtype)}: {arm} differs from exact by "
                      f"{err:.3f} of the delta", file=sys.stderr)
        arms = {"peft": peft_fwd, "dynamic": dynamic, "exact": exact, "merged": merged_fwd}
        stats = paired_rounds(arms, base, device, warmup=args.warmup, repeats=args.repeats, inner=args.inner)
    return stats


def run_base_row(name, tokens, dtype, device, args):
    k, n = SHAPES[name]
    x, w, b, *_ = make_case(k, n, tokens, 1, 1, dtype, device)
    with torch.inference_mode():
        return paired_rounds({"base": lambda: F.linear(x, w, b)}, lambda: F.linear(x, w, b), device,
                             warmup=args.warmup, repeats=args.repeats, inner=args.inner)["base"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available, else cpu")
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument("--dtype", default="both", choices=["both", "bf16", "fp32"], help="default: both")
    p.add_argument("--repeats", type=int, default=None, help="rounds per row (default 3 quick / 7 full on CPU)")
    p.add_argument("--tokens", type=int, default=None, help="override the token count of every shape")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if device == "cpu":
        args.warmup, args.inner = 1, 1
        args.repeats = args.repeats or (3 if args.quick else 7)
        tokens = dict(CPU_TOKENS)
    else:
        args.warmup, args.inner = 3, (5 if args.quick else 10)
        args.repeats = args.repeats or (5 if args.quick else 9)
        tokens = dict(CUDA_TOKENS)
    if args.tokens:
        tokens = {k: args.tokens for k in tokens}
    dtypes = [torch.bfloat16, torch.float32] if args.dtype == "both" else [parse_dtype(args.dtype)]

    print(header(device, f"median of {args.repeats} rounds x {args.inner} calls after {args.warmup} warm-up; "
                         f"ratio = row / base timed just before it; [min-max] of the per-round ratios"))
    print(f"| {'dtype':5} | {'shape':12} | {'tokens':>6} | {'rank':>4} | {'n':>1} | {'flops':>6} | {'path':8} | "
          f"{'ms':>8} | {'x base':>6} | {'min-max':>11} |")
    print(f"|{'-' * 7}|{'-' * 14}|{'-' * 8}|{'-' * 6}|{'-' * 3}|{'-' * 8}|{'-' * 10}|{'-' * 10}|{'-' * 8}|{'-' * 13}|")
    summary = []
    for dtype in dtypes:
        for name in SHAPES:
            k, n = SHAPES[name]
            t = tokens[name]
            st = run_base_row(name, t, dtype, device, args)
            lo, hi = st.spread("base")
            print(f"| {dtype_name(dtype):5} | {name:12} | {t:>6} | {'-':>4} | {'-':>1} | {'-':>6} | {'base':8} | "
                  f"{st.median_ms:8.2f} | {st.ratio('base'):6.3f} | {lo:5.2f}-{hi:5.2f} |", flush=True)
            for rank in RANKS:
                for n_adapters in STRENGTHS:
                    flops = rank * n_adapters * (k + n) / (k * n)
                    stats = run_case(name, t, rank, n_adapters, dtype, device, args)
                    for path, s in stats.items():
                        lo, hi = s.spread("base")
                        print(f"| {dtype_name(dtype):5} | {name:12} | {t:>6} | {rank:>4} | {n_adapters:>1} | "
                              f"{flops:6.1%} | {path:8} | {s.median_ms:8.2f} | {s.ratio('base'):6.3f} | "
                              f"{lo:5.2f}-{hi:5.2f} |", flush=True)
                        if path == "dynamic" and rank in TARGET_RANKS:
                            summary.append((dtype_name(dtype), name, rank, n_adapters, s.ratio("base"),
                                            stats["peft"].ratio("base")))
    print(f"\n# {load_string()} (end)")
    print(f"# target: dynamic <= {TARGET:.2f}x base at ranks {TARGET_RANKS[0]}-{TARGET_RANKS[-1]}"
          f"{' (CPU target)' if device == 'cpu' else ''}")
    for dt, name, rank, n_adapters, r, rp in summary:
        print(f"#   {dt:4} {name:12} r{rank:<3} x{n_adapters}: dynamic {r:.3f}x (peft {rp:.3f}x) "
              f"{'met' if r <= TARGET else 'NOT met'}")
    met = sum(r <= TARGET for *_, r, _ in summary)
    print(f"# {met}/{len(summary)} rows meet the target")


if __name__ == "__main__":
    main()
