"""Switching adapter A -> B: our restore + merge vs a ComfyUI-style re-patch, side by side.

    python bench/bench_switch.py --quick        # 6 Wan-1.3B-shaped blocks, 5 rounds (~2 min, <= 5 min on 2 cores)
    python bench/bench_switch.py --blocks 30    # the whole 1.3B DiT
    python bench/bench_switch.py --smoke        # tiny dims, 1 round (CI: the script runs, prints its lines)
    python bench/bench_switch.py --device cuda  # the same on a GPU (the device check runs it)

Model: Wan-2.1 blocks (real dims, synthetic bf16 weights), two rank-32 adapters A and
B on every q/k/v/o and FFN linear, alpha 16, strength 0.8. Three copies of the model,
one per arm; every round times each arm once (order rotated), ratios within a round:

- ``swap``: ``LoraInjector.apply(plan of the other adapter, mode=merge)`` with the
  current one merged: bit-exact restore (recompute + patch the recorded misses +
  fingerprint check), then merge. Default tier (lossless): scale x strength is one product
  folded into B, as the re-patch applies ``strength * alpha / rank`` once.
- ``swap (copy)``: the same with restore memory ``copy`` (the merge keeps a full copy of
  each weight, like ComfyUI's backup): restore is a copy, then merge.
- ``re-patch``: what ComfyUI's model patcher does per weight, written from its
  documented behaviour: put the backup back, keep a full backup copy of the weight (on
  a GPU: on the offload device, the CPU),
  work in fp32 (``W.to(float32) + strength * alpha / rank * (up @ down)``, all fp32),
  cast back with ``.to(bf16)`` (ComfyUI's rounding for bf16 is a plain cast), set it.
- ``dynamic``: ``LoraInjector.apply(plan of the other adapter, mode=dynamic)`` with the
  current one dynamic (slot swap + the overflow check).
- ``restore`` / ``merge``: the swap timed in two parts (``unmerge_all``, then ``apply``).

Times are CPU seconds of this process (``time.process_time``, robust to other jobs on a
shared machine) at ``--threads`` (default 1); on CUDA, wall seconds with the device
synchronised around each arm. After the rounds every weight of our copy
is checked bit for bit against the untouched original (both restore memories). The last
line is ``swap / re-patch: <median of per-round ratios>`` for the default (lean) restore
memory; the line before it gives the ``copy`` one.
"""
from __future__ import annotations

import argparse
import copy
import gc
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from comfyui_lora_runtime.standalone.host.wan21 import WanConfig, WanModel
from comfyui_lora_runtime.lora_runtime.apply import LoraInjector, plan
from comfyui_lora_runtime.lora_runtime.intent import AdapterSpec

from _timing import load_string

TARGETS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
           "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")
ALPHA, STRENGTH = 16.0, 0.8


def make_model(cfg: WanConfig, seed: int = 0, device: str = "cpu") -> WanModel:
    with torch.device("meta"):
        m = WanModel(cfg)
    m = m.to_empty(device=device).to(torch.bfloat16).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            fan_in = p.shape[-1] if p.dim() >= 2 else 1
            p.copy_(torch.randn(p.shape, generator=g).mul_(1 / math.sqrt(fan_in)))
    return m


def write_adapter(model, names, rank: int, seed: int, path: Path) -> dict:
    """A kohya-style file (lora_down / lora_up / alpha) and its (down, up) per module."""
    g = torch.Generator().manual_seed(seed)
    sd, factors = {}, {}
    for name in names:
        out_f, in_f = model.get_submodule(name).weight.shape
        down = (torch.randn(rank, in_f, generator=g) / in_f ** 0.5).to(torch.bfloat16)
        up = (torch.randn(out_f, rank, generator=g) / rank ** 0.5 * 0.05).to(torch.bfloat16)
        sd[f"diffusion_model.{name}.lora_down.weight"] = down
        sd[f"diffusion_model.{name}.lora_up.weight"] = up
        sd[f"diffusion_model.{name}.alpha"] = torch.tensor(ALPHA)
        factors[name] = (down, up)
    save_file(sd, str(path))
    return factors


class RePatch:
    """ComfyUI-style weight patching of `names` on `model`: full backup, fp32 patch, cast back."""

    def __init__(self, model, names, factors: dict, rank: int):
        self.layers = {n: model.get_submodule(n) for n in names}
        self.factors, self.scale = factors, STRENGTH * ALPHA / rank
        self.backup: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def patch(self, which: str) -> None:
        for n, layer in self.layers.items():
            w = layer.weight
            if n not in self.backup:   # the backup: a full copy of the weight, on the offload device
                self.backup[n] = w.detach().to("cpu", copy=True)
            work = w.detach().to(torch.float32, copy=True)   # patches are computed in fp32
            down, up = self.factors[which][n]
            diff = torch.mm(up.to(w.device, torch.float32), down.to(w.device, torch.float32)).reshape(work.shape)
            work += (self.scale * diff).to(work.dtype)
            layer.weight = torch.nn.Parameter(work.to(w.dtype), requires_grad=False)  # plain cast for bf16

    def unpatch(self) -> None:
        for n, layer in self.layers.items():
            layer.weight = torch.nn.Parameter(self.backup[n].to(layer.weight.device), requires_grad=False)
        self.backup.clear()


def arm_seconds(fn) -> float:
    """CPU seconds of this process for fn(); on CUDA (`CLOCK` "cuda"), wall seconds, synchronised."""
    gc.collect()
    if CLOCK == "cuda":
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


CLOCK = "cpu"
UNIT = {"cpu": "CPU seconds", "cuda": "wall seconds"}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="5 rounds on 6 blocks (the re-patch arm alone varies by up to 1.5x between rounds here: the median wants five)")
    ap.add_argument("--smoke", action="store_true", help="tiny dims, 1 round: checks the script, times nothing real")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    a = ap.parse_args(argv)
    global CLOCK
    CLOCK = a.device
    if a.quick:
        a.blocks, a.rounds = 6, 5
    cfg = WanConfig(num_layers=a.blocks)
    if a.smoke:
        a.blocks, a.rounds, a.rank = 1, 1, 4
        cfg = WanConfig(dim=64, ffn_dim=128, num_layers=1, num_heads=2, text_dim=32, freq_dim=32)
    torch.set_num_threads(a.threads)
    model = make_model(cfg, device=a.device)
    names = [f"blocks.{i}.{t}" for i in range(cfg.num_layers) for t in TARGETS]
    wbytes = sum(model.get_submodule(n).weight.numel() * 2 for n in names)
    where = torch.cuda.get_device_name() if a.device == "cuda" else f"CPU, threads {torch.get_num_threads()}"
    print(f"# torch {torch.__version__}, {where}, {load_string()}")
    print(f"# {cfg.num_layers} blocks (dim {cfg.dim}, ffn {cfg.ffn_dim}), {len(names)} adapted bf16 linears "
          f"({wbytes / 2**20:.0f} MiB), rank {a.rank}, {a.rounds} rounds; {UNIT[CLOCK]} per switch", flush=True)
    original = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    m_comfy, m_dyn, m_copy = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    with tempfile.TemporaryDirectory() as tmp:
        factors, plans = {}, {}
        for which, seed in (("A", 1), ("B", 2)):
            path = Path(tmp) / f"{which}.safetensors"
            factors[which] = write_adapter(model, names, a.rank, seed, path)
            spec = [AdapterSpec(str(path), STRENGTH, name=which)]
            for mode in ("merge", "dynamic"):
                plans[which, mode] = plan(model, spec, mode=mode)
            plans[which, "copy"] = plan(model, spec, mode="merge", restore="copy")
        ours, dyn, comfy = LoraInjector(model), LoraInjector(m_dyn), RePatch(m_comfy, names, factors, a.rank)
        ours_copy = LoraInjector(m_copy)
        first = {"merge": arm_seconds(lambda: ours.apply(plans["A", "merge"])),
                 "merge (copy)": arm_seconds(lambda: ours_copy.apply(plans["A", "copy"])),
                 "dynamic": arm_seconds(lambda: dyn.apply(plans["A", "dynamic"])),
                 "re-patch": arm_seconds(lambda: comfy.patch("A"))}
        print("# first apply of A: " + ", ".join(f"{k} {v:.2f}s" for k, v in first.items()), flush=True)
        cur = {"swap": "A", "swap (copy)": "A", "re-patch": "A", "dynamic": "A", "split": "A"}

        def flip(arm: str) -> str:
            cur[arm] = "B" if cur[arm] == "A" else "A"
            return cur[arm]

        def split() -> tuple[float, float]:  # restore alone, then merge alone (same copy as swap)
            r = arm_seconds(ours.unmerge_all)
            which = flip("swap")
            return r, arm_seconds(lambda: ours.apply(plans[which, "merge"]))

        def repatch():
            comfy.unpatch()
            comfy.patch(flip("re-patch"))

        arms = {"swap": lambda: ours.apply(plans[flip("swap"), "merge"]),
                "swap (copy)": lambda: ours_copy.apply(plans[flip("swap (copy)"), "copy"]),
                "re-patch": repatch,
                "dynamic": lambda: dyn.apply(plans[flip("dynamic"), "dynamic"])}
        t = {k: [] for k in (*arms, "restore", "merge")}
        order = [*arms, "split"]
        for r in range(a.rounds):
            for k in order[r % len(order):] + order[:r % len(order)]:
                if k == "split":
                    rs, mg = split()
                    t["restore"].append(rs)
                    t["merge"].append(mg)
                else:
                    t[k].append(arm_seconds(arms[k]))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in t.items()), flush=True)
        ours.clear()
        ours_copy.clear()
        dyn.clear()
        exact = all(torch.equal(m.get_submodule(n).weight, original[n]) for n in names for m in (model, m_copy))
    med = statistics.median
    ratio = {k: [x / y for x, y in zip(t[k], t[ref])] for k, ref in
             (("swap", "re-patch"), ("swap (copy)", "re-patch"), ("dynamic", "merge"), ("restore", "re-patch"), ("merge", "re-patch"))}
    print(f"\n| arm | {UNIT[CLOCK]} (median of {a.rounds}) | ratio (median of per-round) |")
    print("|---|---|---|")
    print(f"| re-patch (ComfyUI-style) | {med(t['re-patch']):.3f} | 1 |")
    print(f"| swap (restore + merge) | {med(t['swap']):.3f} | {med(ratio['swap']):.3f} x re-patch |")
    print(f"| swap, restore memory copy | {med(t['swap (copy)']):.3f} | {med(ratio['swap (copy)']):.3f} x re-patch |")
    print(f"| restore alone | {med(t['restore']):.3f} | {med(ratio['restore']):.3f} x re-patch |")
    print(f"| merge alone | {med(t['merge']):.3f} | {med(ratio['merge']):.3f} x re-patch |")
    print(f"| dynamic apply | {med(t['dynamic']):.4f} | {med(ratio['dynamic']):.4f} x merge alone |")
    print(f"# restore bit-exact over every weight after {2 * a.rounds + 1} merges: {exact}; {load_string()}")
    if not exact:
        raise SystemExit("restore was not bit-exact")
    print(f"dynamic / merge: {med(ratio['dynamic']):.4f}")
    print(f"swap (restore memory copy) / re-patch: {med(ratio['swap (copy)']):.3f}")
    print(f"swap / re-patch: {med(ratio['swap']):.3f}")


if __name__ == "__main__":
    main()
