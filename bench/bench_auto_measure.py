"""What `auto`'s first measurement costs next to a full merge of the same adapter (a script).

    python bench/bench_auto_measure.py            # one Wan-1.3B block's linears (bf16), rank 32
    python bench/bench_auto_measure.py --smoke    # tiny dims (CI)

Side by side in one run (best of --repeats, 1 thread): `decide(auto)` with a fresh decision
cache (its content keys included) vs merging every layer (the restore timed apart).
Prints ``auto measurement / merge: <ratio>`` last (target <= 0.25).
"""
from __future__ import annotations

import argparse
import time

import torch

from comfyui_lora_runtime.lora_runtime import LoraLinear
from comfyui_lora_runtime.lora_runtime.decision.policy import DecisionCache, decide
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
from comfyui_lora_runtime.lora_runtime.settings import MergeMode


def layers(dim: int, ffn: int, rank: int) -> list[LoraLinear]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (o, n) in enumerate([(dim, dim)] * 8 + [(ffn, dim), (dim, ffn)]):
        lin = torch.nn.Linear(n, o).to(torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(o, n, generator=g) / n ** 0.5)
        w = LoraLinear(lin, f"blocks.0.l{i}")
        down, up = torch.randn(rank, n, generator=g) * 0.01, torch.randn(o, rank, generator=g) * 0.01
        w.add_adapter("a", LayerAdapter(f"l{i}", down=down.to(torch.bfloat16), up=up.to(torch.bfloat16)), 1.0,
                      content_hash="bench")
        out.append(w)
    return out


def best(fn, repeats: int) -> float:
    t = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="1536,8960")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        a.dims, a.rank, a.repeats = "64,128", 4, 1
    torch.set_num_threads(1)
    dim, ffn = (int(v) for v in a.dims.split(","))
    ws = layers(dim, ffn, a.rank)
    t_auto = best(lambda: decide(MergeMode.AUTO, ws, DecisionCache()), a.repeats)
    t_merge = t_restore = float("inf")
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        for w in ws:
            w.merge()
        t1 = time.perf_counter()
        for w in ws:
            w.unmerge()
        t_merge, t_restore = min(t_merge, t1 - t0), min(t_restore, time.perf_counter() - t1)
    print(f"# dims {dim}/{ffn}, rank {a.rank}, 10 linears, bf16, 1 thread; best of {a.repeats}")
    print(f"auto measurement {t_auto * 1e3:.1f} ms, merge {t_merge * 1e3:.1f} ms, restore {t_restore * 1e3:.1f} ms")
    print(f"auto measurement / merge: {t_auto / t_merge:.3f}")


if __name__ == "__main__":
    main()
