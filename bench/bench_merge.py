"""Merge / restore memory and rounding loss on a Wan-1.3B-sized weight (a script, not a test).

    python bench/bench_merge.py

For a bf16 [1536, 1536] weight and a rank-32 delta at several |dW|/|W|: the share of
elements a restore must keep (where round(W' - dW) misses W), the bytes kept vs a
full backup copy, the rounding-loss share `auto` measures, and merge/restore times.
"""
from __future__ import annotations

import time

import torch

from comfyui_lora_runtime.lora_runtime import AdaptedLayer, measure_share_lost
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter


def wrapped(rel: float, n: int = 1536, r: int = 32, dtype=torch.bfloat16, seed: int = 0) -> AdaptedLayer:
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(n, n).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, n, generator=g) / n ** 0.5)
    down, up = torch.randn(r, n, generator=g), torch.randn(n, r, generator=g)
    k = (rel * lin.weight.float().norm() / (up @ down).norm()).sqrt()
    w = AdaptedLayer(lin, f"rel={rel}")
    w.add_adapter("a", LayerAdapter("x", down=(down * k).to(dtype), up=(up * k).to(dtype)), 1.0)
    return w


def main() -> None:
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; bf16 weight 1536x1536, rank 32")
    print(f"{'|dW|/|W|':>9} {'share lost':>10} {'kept elems':>10} {'kept bytes':>11} {'full copy':>10} "
          f"{'ratio':>6} {'merge ms':>8} {'restore ms':>10} {'exact':>5}")
    for rel in (1e-5, 1e-4, 1e-3, 1e-2, 3e-2, 0.11):
        w = wrapped(rel)
        before = w.weight.detach().clone()
        share = measure_share_lost([w])
        t0 = time.perf_counter()
        w.merge()
        t1 = time.perf_counter()
        rec = w.merge_state.restore
        kept = rec.exceptions / w.weight.numel() if rec.kind == "sparse" else 1.0
        w.unmerge()
        t2 = time.perf_counter()
        full = w.weight.numel() * w.weight.element_size()
        print(f"{rel:>9.0e} {share:>10.1%} {kept:>10.2%} {rec.nbytes:>11,} {full:>10,} {rec.nbytes / full:>6.3f} "
              f"{(t1 - t0) * 1e3:>8.1f} {(t2 - t1) * 1e3:>10.1f} {str(torch.equal(w.weight, before)):>5}")


if __name__ == "__main__":
    main()
