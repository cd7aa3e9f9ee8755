"""Time per denoising step of a Wan-2.1-shaped DiT carrying a LoRA, arms side by side.

One step = one model forward (batch 1; `--cfg` adds batch 2, the cond+uncond pair
of classifier-free guidance). The model has the real Wan 2.1 1.3B dims (dim 1536,
ffn 8960, 12 heads, text_dim 4096, freq_dim 256, in/out 16, patch 1x2x2; `--dims 14b`:
dim 5120, ffn 13824, 40 heads) and random weights, but only `--blocks` blocks (2 on the
CPU, 30 on CUDA).
Input: the latent of a 480x272, 9-frame video, 16 x 3 x 34 x 60 -> 1530 tokens;
text context 512 tokens.

The adapter: rank 32 (alpha 16, strength 0.8) on every FFN linear (ffn.0, ffn.2)
and every attention projection (self_attn and cross_attn q, k, v, o) of every block,
written as a kohya-format safetensors file (diffusion_model.<module>.lora_down/
lora_up/alpha) into a temp dir and applied with the engine (`plan` + `applied`).

Arms, each on its own copy of the model, timed once per round in rotated order
(medians of the per-round ratios):
  none      no adapter
  merged    applied(mode="merge"): the adapter folded into the weights
  dynamic   applied(mode="dynamic"), tier lossless: stacked GEMM pair, addmm_ in place, the
            q/k/v of each attention sharing one shrink GEMM (layer/shared_shrink.py)
  unshared  the same as dynamic with every projection its own shrink GEMM (side by side)
  exact     the same wrapped model under runtime_context(tier="exact") (reference path)
  peft      every adapted Linear replaced by base(x) + (x A^T) B^T * s, out of place
Fusions: with `--fusion-backend auto` (default) the engine mounts its fused kernels
where they run (CUDA/Triton; nothing on the CPU) on none/merged/dynamic alike; peft
stays eager (as PEFT runs).
`--compile MODE` (default, reduce-overhead = CUDA graphs, max-autotune-no-cudagraphs):
every block of the none/merged/dynamic/peft copies is compiled (`nn.Module.compile`, one
graph per block kind, reused over the blocks); the dynamic copy runs its traced call plans.
`unshared` and `exact` are not timed then (a compiled call has no shared shrink and no
exact path); the outputs are still checked against the uncompiled exact reference.
Targets: dynamic vs merged <= 1.05x on the CPU; on CUDA <= 1.04x at video sizes (32760 tokens;
<= 1.03x with 14B dims) and <= 1.15x at small ones (1530 tokens).

Times: wall clock, except on the CPU at one thread (`--threads 1`): CPU seconds of this process
(robust to other jobs on a shared machine).

Memory: five copies of the model (none, merged, dynamic/exact, unshared, peft).

    python bench/bench_dit_step.py [--device cpu|cuda] [--quick] [--dtype fp32|bf16] [--dims 1.3b|14b]
        [--blocks N] [--cfg] [--rank R] [--repeats N] [--threads N] [--fusion-backend auto|none]
        [--compile MODE]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from comfyui_lora_runtime.standalone.host.wan21 import WanConfig, WanModel
from comfyui_lora_runtime.lora_runtime.apply import LoraInjector, applied, plan
from comfyui_lora_runtime.lora_runtime.intent import AdapterSpec
from comfyui_lora_runtime.lora_runtime.fusion.fusion_sites import mount_fusions
from comfyui_lora_runtime.lora_runtime.layer.runtime_context import runtime_context

from _timing import dtype_name, header, interleaved_rounds, load_string, parse_dtype, resolve_device

LATENT = (16, 3, 34, 60)      # C, T, H, W of a 480x272 9-frame video (T = 1 + (9-1)/4)
TEXT_TOKENS = 512
TARGETS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
           "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")
ALPHA, STRENGTH = 16.0, 0.8
TARGET = {"cpu": 1.05, "cuda": 1.04, "cuda_14b": 1.03, "cuda_small": 1.15}  # dynamic / merged per step
SMALL_TOKENS = 4096  # at or below: launch- and Python-bound on CUDA (1530 tokens), the looser target
# Wan 2.1 model sizes: (dim, ffn_dim, heads); the rest of WanConfig is shared
DIMS = {"1.3b": (1536, 8960, 12), "14b": (5120, 13824, 40)}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


def target_for(device: str, tokens: int, dims: str = "1.3b") -> float:
    """CPU 1.05; CUDA 1.04 at video sizes (32760 tokens; 1.03 with 14B dims), 1.15 at <= SMALL_TOKENS
    (1530 tokens)."""
    if device == "cuda" and tokens <= SMALL_TOKENS:
        return TARGET["cuda_small"]
    if device == "cuda" and dims == "14b":
        return TARGET["cuda_14b"]
    return TARGET[device]


def wan_config(dims: str, blocks: int) -> WanConfig:
    dim, ffn, heads = DIMS[dims]
    return WanConfig(dim=dim, ffn_dim=ffn, num_heads=heads, num_layers=blocks)


def arm_names(compiled: bool) -> list[str]:
    """The timed arms; a compiled run has no unshared (no shared shrink in traced calls) or exact arm."""
    return ["none", "merged", "dynamic", "peft"] if compiled else ["none", "merged", "dynamic", "unshared", "exact",
                                                                    "peft"]


class PeftShapedLinear(nn.Module):
    """PEFT's LoRA forward: y = base(x) + lora_B(lora_A(x)) * scaling, out of place."""

    def __init__(self, base: nn.Linear, down: torch.Tensor, up: torch.Tensor, scaling: float):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Parameter(down, requires_grad=False)
        self.lora_B = nn.Parameter(up, requires_grad=False)
        self.scaling = scaling

    def forward(self, x):
        return self.base_layer(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling


def adapter_tensors(model: WanModel, rank: int, seed: int = 1) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name -> (down [r, in], up [out, r]) in bf16 (the usual file dtype)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(len(model.blocks)):
        for t in TARGETS:
            name = f"blocks.{i}.{t}"
            lin = model.get_submodule(name)
            n, k = lin.weight.shape
            down = torch.randn(rank, k, generator=g) / k ** 0.5
            up = torch.randn(n, rank, generator=g) / rank ** 0.5 * 0.05
            out[name] = (down.to(torch.bfloat16), up.to(torch.bfloat16))
    return out


def write_kohya(path: Path, tensors) -> None:
    sd = {}
    for name, (down, up) in tensors.items():
        sd[f"diffusion_model.{name}.lora_down.weight"] = down.contiguous()
        sd[f"diffusion_model.{name}.lora_up.weight"] = up.contiguous()
        sd[f"diffusion_model.{name}.alpha"] = torch.tensor(ALPHA)
    save_file(sd, str(path))


def to_peft(model: nn.Module, tensors, rank: int) -> int:
    p = next(model.parameters())
    for name, (down, up) in tensors.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, child)
        setattr(parent, child, PeftShapedLinear(base, down.to(p.device, p.dtype), up.to(p.device, p.dtype),
                                                ALPHA / rank * STRENGTH))
    return len(tensors)


def flop_share(model: WanModel, tokens: int, rank: int) -> tuple[float, float]:
    """(adapter FLOPs / FLOPs of the adapted linears, adapter FLOPs / all linear FLOPs) per step."""
    lin_all = lin_adapted = extra = 0
    adapted = {f"blocks.{i}.{t}" for i in range(len(model.blocks)) for t in TARGETS}
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        n, k = m.weight.shape
        rows = TEXT_TOKENS if (name.startswith("text_embedding") or name.endswith(("cross_attn.k", "cross_attn.v"))) \
            else 1 if name.startswith(("time_", "head.modulation")) else tokens
        f = rows * n * k
        lin_all += f
        if name in adapted:
            lin_adapted += f
            extra += rows * rank * (n + k)
    return extra / lin_adapted, extra / lin_all


def rel(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / scale)


def dry_run(args) -> dict:
    """The plan without the work: model dims, token count, FLOP shares, arms."""
    blocks = args.blocks or 30
    cfg = wan_config(args.dims, blocks)
    with torch.device("meta"):
        model = WanModel(cfg)
    _, t, h, w = LATENT
    pt, ph, pw = cfg.patch_size
    tokens = (t // pt) * (-(-h // ph)) * (-(-w // pw))
    share_adapted, share_all = flop_share(model, tokens, args.rank)
    n_adapted = sum(1 for i in range(blocks) for t_ in TARGETS if model.get_submodule(f"blocks.{i}.{t_}"))
    plan_ = dict(dry_run=True, blocks=blocks, tokens=tokens, text_tokens=TEXT_TOKENS, rank=args.rank,
                 adapted_linears=n_adapted, adapter_flop_share_adapted=share_adapted,
                 adapter_flop_share_all=share_all, batches=[1, 2] if args.cfg else [1], dims=args.dims,
                 dim=cfg.dim, ffn_dim=cfg.ffn_dim, compile=args.compile, arms=arm_names(args.compile is not None),
                 target=target_for("cuda", tokens, args.dims))
    print(f"# dry run: {plan_}")
    if args.json:
        args.json.write_text(json.dumps(plan_, indent=1) + "\n")
    return plan_


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available, else cpu")
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                   help="model dtype (default: fp32 on the CPU as ComfyUI computes there, bf16 on CUDA)")
    p.add_argument("--blocks", type=int, default=None, help="transformer blocks (default 2 on the CPU, 30 on CUDA)")
    p.add_argument("--dims", choices=sorted(DIMS), default="1.3b", help="Wan 2.1 model dims (default 1.3b)")
    p.add_argument("--compile", choices=COMPILE_MODES, default=None,
                   help="torch.compile every block of the timed copies in this mode (default: eager)")
    p.add_argument("--cfg", action="store_true", help="also time batch 2 (cond + uncond in one forward)")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--repeats", type=int, default=None, help="rounds (default CPU 3 quick / 6; CUDA 5 / 10)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--fusion-backend", default="auto", choices=["auto", "none", "torch", "triton"],
                   help="fusions the engine mounts (auto: Triton on CUDA, none on the CPU)")
    p.add_argument("--latent", default=None,
                   help="C,T,H,W of the latent (default 16,3,34,60: 1530 tokens; 16,21,60,104 is Wan's "
                        "480p 81 frames: 32760 tokens)")
    p.add_argument("--inner", type=int, default=None, help="steps per timed measurement (default 1 CPU, 3 CUDA)")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument("--dry-run", action="store_true",
                   help="build the model on the meta device, print the plan and stop (no timing)")
    args = p.parse_args(argv)
    global LATENT
    if args.latent:
        LATENT = tuple(int(v) for v in args.latent.split(","))
        if len(LATENT) != 4:
            raise SystemExit(f"--latent takes C,T,H,W, got {args.latent!r}")
    if args.dry_run:
        return dry_run(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype) if args.dtype else (torch.float32 if device == "cpu" else torch.bfloat16)
    blocks = args.blocks or (2 if device == "cpu" else 30)
    if device == "cpu":
        warmup, inner, repeats = 1, 1, args.repeats or (3 if args.quick else 6)
    else:
        warmup, inner, repeats = 3, 3, args.repeats or (5 if args.quick else 10)
    inner = args.inner or inner
    fusion_backend = None if args.fusion_backend == "none" else args.fusion_backend
    batches = (1, 2) if args.cfg else (1,)

    def log(msg: str) -> None:
        print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    cfg = wan_config(args.dims, blocks)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):
        base = WanModel(cfg)
    base = base.to(dtype).eval().requires_grad_(False)
    tensors = adapter_tensors(base, args.rank)
    models = {"none": base, "merged": copy.deepcopy(base), "dynamic": copy.deepcopy(base),
              "unshared": copy.deepcopy(base), "peft": copy.deepcopy(base)}
    log(f"built 5 copies of a {blocks}-block model in {time.perf_counter() - t0:.1f}s")
    _, _, t, h, w = (1, *LATENT)
    pt, ph, pw = cfg.patch_size
    tokens = (t // pt) * (-(-h // ph)) * (-(-w // pw))
    share_adapted, share_all = flop_share(base, tokens, args.rank)

    print(header(device, f"Wan2.1-{args.dims.upper()} dims, {blocks} blocks, {dtype_name(dtype)}, latent {LATENT} -> {tokens} "
                         f"tokens, text {TEXT_TOKENS} tokens; rank-{args.rank} adapter (alpha {ALPHA:g}, strength "
                         f"{STRENGTH}) on {len(tensors)} linears (q,k,v,o self+cross, ffn.0, ffn.2 per block)\n"
                         f"# adapter FLOPs: {share_adapted:.2%} of the adapted linears, {share_all:.2%} of all "
                         f"linear FLOPs; median of {repeats} rounds x {inner} steps after {warmup} warm-up, arms "
                         f"in rotated order; fusion backend {args.fusion_backend}"
                         + (f"; every block compiled (mode {args.compile})" if args.compile else "")))

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        path = Path(tmp) / f"bench_wan_r{args.rank}.safetensors"
        write_kohya(path, tensors)
        spec = [AdapterSpec(str(path), STRENGTH)]
        t0 = time.perf_counter()
        rep_m = stack.enter_context(applied(models["merged"], plan(models["merged"], spec, mode="merge"),
                                            fusion_backend=fusion_backend))
        inj_d = LoraInjector(models["dynamic"])
        rep_d = stack.enter_context(applied(models["dynamic"], plan(models["dynamic"], spec, mode="dynamic"),
                                            fusion_backend=fusion_backend, injector=inj_d))
        inj_u = LoraInjector(models["unshared"])
        inj_u.share_shrink = False
        stack.enter_context(applied(models["unshared"], plan(models["unshared"], spec, mode="dynamic"),
                                    fusion_backend=fusion_backend, injector=inj_u))
        if fusion_backend is not None:
            mounted = mount_fusions(models["none"], "lossless", fusion_backend)
            stack.callback(mounted.unmount)
            n_fused = len(mounted.sites)
        else:
            n_fused = 0
        n_peft = to_peft(models["peft"], tensors, args.rank)
        compiled = args.compile is not None
        if compiled:  # in place, per block: one graph per block kind, reused over the blocks
            # the four arms are four versions of the one block function (and one more set per batch
            # size): keep them all compiled rather than let the default limit (8) fall back to eager
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
            for n in arm_names(True):
                for blk in models[n].blocks:
                    blk.compile(mode=args.compile, dynamic=False)
        log(f"applied (merge {rep_m.patch_seconds:.1f}s, dynamic {rep_d.patch_seconds:.2f}s) in "
            f"{time.perf_counter() - t0:.1f}s")
        print(f"# merged: {rep_m.layers_wrapped} layers, decision {rep_m.decision.chosen}; dynamic: "
              f"{rep_d.layers_wrapped} layers, decision {rep_d.decision.chosen}; peft: {n_peft} layers; "
              f"fusion sites mounted: none {n_fused}, merged "
              f"{sum(1 for f in rep_m.fusions if f.get('fusions'))}, dynamic "
              f"{sum(1 for f in rep_d.fusions if f.get('fusions'))}; dynamic's sibling groups (one shrink GEMM "
              f"each): {len(inj_d.sibling_groups)}")

        g = torch.Generator().manual_seed(2)
        results = {}
        for b in batches:
            x = torch.randn(b, *LATENT, generator=g).to(device, dtype)
            ctx = torch.randn(b, TEXT_TOKENS, cfg.text_dim, generator=g).to(device, dtype)
            ts = torch.full((b,), 500.0, device=device)

            def arm(model, tier):
                def step():
                    with runtime_context(tier=tier):
                        return model(x, ts, ctx)
                return step

            arms = {"none": arm(models["none"], "lossless"), "merged": arm(models["merged"], "lossless"),
                    "dynamic": arm(models["dynamic"], "lossless"), "unshared": arm(models["unshared"], "lossless"),
                    "exact": arm(models["dynamic"], "exact"), "peft": arm(models["peft"], "lossless")}
            with torch.inference_mode():
                with torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext():
                    ref = {n: arms[n]() for n in ("exact", "none")}   # compiled blocks run eagerly here
                effect = (ref["exact"].float() - ref["none"].float()).norm()
                if not effect > 0:
                    raise SystemExit("the adapter changes nothing: the benchmark would compare nothing")
                arms = {n: arms[n] for n in arm_names(compiled)}
                t0 = time.perf_counter()
                outs = {n: f() for n, f in arms.items()}  # compiled: the first call compiles
                if compiled:
                    log(f"batch {b}: compiled {len(arms)} arms in {time.perf_counter() - t0:.0f}s")
                check = {n: rel(outs[n], ref["exact"], effect) for n in arms if n not in ("none", "exact")}
                del outs, ref
                log(f"batch {b}: outputs checked; timing {len(arms)} arms x {warmup + repeats} rounds")
                clock = "cpu_process" if device == "cpu" and torch.get_num_threads() == 1 else device
                stats = interleaved_rounds(arms, clock, refs=("none", "merged", "unshared")[:3 - compiled],
                                           warmup=warmup, repeats=repeats, inner=inner, progress=log)
            results[b] = (stats, check)

        print(f"# difference from exact, as a share of the adapter's effect ||exact - none||: " + "; ".join(
            f"batch {b}: " + ", ".join(f"{n} {v:.2e}" for n, v in results[b][1].items()) for b in batches))
        print("# ms/step and x none / x merged: medians over rounds of the arm's time and of its per-round "
              "ratios; min-max: of the per-round ratios to merged; best: fastest step of each arm, and its "
              "ratio to merged's fastest (least disturbed by other load)")
        print(f"| {'batch':>5} | {'arm':8} | {'ms/step':>9} | {'x none':>6} | {'x merged':>8} | "
              f"{'min-max x merged':>16} | {'best ms':>9} | {'best x merged':>13} |")
        print(f"|{'-' * 7}|{'-' * 10}|{'-' * 11}|{'-' * 8}|{'-' * 10}|{'-' * 18}|{'-' * 11}|{'-' * 15}|")
        for b in batches:
            stats = results[b][0]
            for n, s in stats.items():
                lo, hi = s.spread("merged")
                print(f"| {b:>5} | {n:8} | {s.median_ms:9.1f} | {s.ratio('none'):6.3f} | {s.ratio('merged'):8.3f} | "
                      f"{lo:7.3f}-{hi:7.3f} | {s.min_ms:9.1f} | {s.min_ms / stats['merged'].min_ms:13.3f} |")
    print(f"\n# {load_string()} (end)")
    tgt = target_for(device, tokens, args.dims)
    summary = dict(device=device, device_name=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                   torch=torch.__version__, dtype=dtype_name(dtype), blocks=blocks, tokens=tokens, rank=args.rank,
                   dims=args.dims, compile=args.compile,
                   adapter_flop_share_adapted=share_adapted, adapter_flop_share_all=share_all,
                   fusion_backend=args.fusion_backend, repeats=repeats, inner=inner, target=tgt,
                   fused_sites={"none": n_fused, "merged": sum(1 for f in rep_m.fusions if f.get("fusions")),
                                "dynamic": sum(1 for f in rep_d.fusions if f.get("fusions"))},
                   batches={})
    for b in batches:
        r = results[b][0]["dynamic"].ratio("merged")
        st = results[b][0]
        best = st["dynamic"].min_ms / st["merged"].min_ms
        besides = [f"peft {st['peft'].ratio('merged'):.3f}x"]
        if "exact" in st:
            besides.append(f"exact {st['exact'].ratio('merged'):.3f}x; shared shrink: dynamic / unshared "
                           f"{st['dynamic'].ratio('unshared'):.3f}x")
        print(f"# target (batch {b}): dynamic <= {tgt:.2f}x merged on {device}"
              + (f", compiled ({args.compile})" if compiled else "") + f": median {r:.3f}x, best {best:.3f}x "
              f"-> {'met' if r <= tgt else 'NOT met'} ({'; '.join(besides)})")
        summary["batches"][b] = dict(
            diff_from_exact=results[b][1],
            arms={n: dict(ms=s_.median_ms, best_ms=s_.min_ms, x_none=s_.ratio("none"), x_merged=s_.ratio("merged"),
                          x_merged_spread=s_.spread("merged")) for n, s_ in st.items()},
            dynamic_x_merged=r, met=r <= tgt)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
