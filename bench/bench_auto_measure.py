"""What `auto`'s first measurement costs next to a full merge of the same adapters (a script).

    python bench/bench_auto_measure.py                 # one Wan-1.3B block's linears, rank 32, every form
    python bench/bench_auto_measure.py --forms fp8 --adapters 1
    python bench/bench_auto_measure.py --smoke         # tiny dims (CI)
    python bench/bench_auto_measure.py --forms int8 --adapters 4 --auto-only 15   # the measurement alone

Forms: bf16, and the host-quantized layouts ComfyUI loads (comfy-kitchen ``QuantizedTensor``, merged
as ComfyUI merges them: re-quantized with the scale recalculated and stochastic rounding seeded per
layer): fp8 (float8_e4m3fn per tensor), int8 (per tensor), mxfp8, nvfp4. Side by side in one run
(best of --repeats, 1 thread): `decide(auto)` with a fresh decision cache (its content keys included)
vs merging every adapter into every layer (the restore timed apart). Prints one line per form and
adapter count (the decision and the share each adapter would lose), then
``auto measurement / merge: <ratio>``, the largest ratio (target <= 0.25).
"""
from __future__ import annotations

import argparse
import time

import torch

from comfyui_lora_runtime.lora_runtime import AdaptedLayer
from comfyui_lora_runtime.lora_runtime.decision.policy import DecisionCache, decide
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
from comfyui_lora_runtime.lora_runtime.settings import MergeMode

LAYOUTS = {"fp8": "TensorCoreFP8E4M3Layout", "int8": "TensorWiseINT8Layout", "mxfp8": "TensorCoreMXFP8Layout",
           "nvfp4": "TensorCoreNVFP4Layout"}


def layers(dim: int, ffn: int, rank: int, form: str, adapters: int, size: float) -> list[AdaptedLayer]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (o, n) in enumerate([(dim, dim)] * 8 + [(ffn, dim), (dim, ffn)]):
        lin = torch.nn.Linear(n, o)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(o, n, generator=g) / n ** 0.5)
        if form == "bf16":
            layer = lin.to(torch.bfloat16)
        else:
            from comfyui_lora_runtime.standalone.host import quant_checkpoints
            layer = quant_checkpoints.quantize_model(torch.nn.Sequential(lin), LAYOUTS[form], min_numel=1)[0]
        w = AdaptedLayer(layer, f"blocks.0.l{i}")
        w.requant_seed = 0 if form == "bf16" else 1 + i  # ComfyUI seeds each layer's stochastic rounding
        for a in range(adapters):
            down, up = torch.randn(rank, n, generator=g) * size, torch.randn(o, rank, generator=g) * size
            w.add_adapter(f"a{a}", LayerAdapter(f"l{i}", down=down.to(torch.bfloat16), up=up.to(torch.bfloat16)),
                          1.0, content_hash=f"bench{a}")
        out.append(w)
    return out


def best(fn, repeats: int) -> float:
    t = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def measure(ws: list[AdaptedLayer], repeats: int) -> tuple[float, float, float, object]:
    t_auto = best(lambda: decide(MergeMode.AUTO, ws, DecisionCache()), repeats)
    t_merge = t_restore = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in ws:
            w.merge()
        t1 = time.perf_counter()
        for w in ws:
            w.unmerge()
        t_merge, t_restore = min(t_merge, t1 - t0), min(t_restore, time.perf_counter() - t1)
    return t_auto, t_merge, t_restore, decide(MergeMode.AUTO, ws, DecisionCache())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="1536,8960")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--forms", default="bf16,fp8,int8,mxfp8,nvfp4")
    ap.add_argument("--adapters", default="1,4", help="adapter counts, each measured apart")
    ap.add_argument("--size", type=float, default=0.02, help="std of the random LoRA factors")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--auto-only", type=int, default=0, metavar="N",
                    help="time only the measurement, best and median of N (two code versions compare here: the merge's "
                         "own time swings between runs)")
    a = ap.parse_args()
    if a.smoke:
        a.dims, a.rank, a.repeats, a.adapters = "64,128", 4, 1, "1,2"
    torch.set_num_threads(1)
    dim, ffn = (int(v) for v in a.dims.split(","))
    forms = [f for f in a.forms.split(",") if f]
    if any(f != "bf16" for f in forms):
        try:
            import comfy_kitchen  # noqa: F401
        except ImportError:
            print("# comfy-kitchen is not installed: bf16 only")
            forms = [f for f in forms if f == "bf16"]
    print(f"# dims {dim}/{ffn}, rank {a.rank}, factor std {a.size}, 10 linears, 1 thread; best of {a.repeats}")
    worst = 0.0
    for form in forms:
        for k in (int(v) for v in a.adapters.split(",")):
            ws = layers(dim, ffn, a.rank, form, k, a.size)
            if a.auto_only:
                ts = sorted(best(lambda: decide(MergeMode.AUTO, ws, DecisionCache()), 1) for _ in range(a.auto_only))
                print(f"{form} x{k}: auto measurement best {ts[0] * 1e3:.1f} ms, median {ts[len(ts) // 2] * 1e3:.1f} ms")
                continue
            t_auto, t_merge, t_restore, d = measure(ws, a.repeats)
            chosen = ", ".join(f"{x.chosen} {x.share_lost:.0%}" for x in d.adapters)
            print(f"{form} x{k}: auto measurement {t_auto * 1e3:.1f} ms, merge {t_merge * 1e3:.1f} ms, "
                  f"restore {t_restore * 1e3:.1f} ms, ratio {t_auto / t_merge:.3f} ({chosen})")
            worst = max(worst, t_auto / t_merge)
    if not a.auto_only:
        print(f"auto measurement / merge: {worst:.3f}")


if __name__ == "__main__":
    main()
