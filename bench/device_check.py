"""The GPU check: one command that runs everything a lent GPU has to prove, in one go.

    python bench/device_check.py --out DIR [--budget-s 480] [--dry-run] [--parts a,b,...]

Parts, in this order (each one reported; a failing or timed-out part is recorded and
the next one still runs; a part whose share of the budget is gone is "skipped: budget"):

  env      GPU, driver, CUDA, torch, Triton versions
  tests    the CUDA tests: pytest tests/kernels tests/lora_runtime/fusion on the GPU (kernels vs
           their torch references at bf16/fp16/fp32, odd shapes, several adapters,
           scale 1 and not, every launch-config candidate, the fusion guards)
  tune     the launch-config table for the benchmark's shape buckets (ops x FFN
           shapes x M buckets), written to DIR/tuned_<family>.json and installed in
           kernels/tuned/ for the parts after it
  kernels  kernel rows, bf16: Wan-1.3B, Wan-14B and Flux FFN up-projections (+GELU),
           M = 512 / 4096 / 32760. Base arms: eager F.linear+GELU, the cuBLASLt bias+GELU
           epilogue (backend "cublaslt", where its on-device tanh check passes), the Triton
           fused kernel. LoRA arms for ranks 16/32/64/128 x 1 adapter and 32 x 3: the
           PEFT-shaped eager chain, the shipped wrapper (AdaptedLayer lossless + GELU), and the
           backends Triton, K-concat with [W | B] cached / rebuilt per call, delta first;
           each x the best base arm of its round, and the lossless rule vs fp64 per arm
  swap     bench/bench_switch.py --device cuda: adapter swap A -> B (restore + merge, lean
           and copy restore memory) vs a ComfyUI-style re-patch (backup on the CPU), 6 blocks
  quantized  bench/bench_quantized.py --device cuda: fp8 and nvfp4 QuantizedTensor bases
           (weight-only cast) alone vs our dynamic adapters (1 and 4) and a cast-time patch
  dit      bench/bench_dit_step.py on CUDA (bf16), in this order: Wan-2.1-1.3B dims at 1530
           tokens x 30 blocks (launch-bound on a big GPU) and 32760 tokens (480p, 81 frames)
           x 8 blocks; Wan-14B dims at 32760 tokens x 2 blocks (these three with --cfg: batch
           1 and 2); 1530 tokens x 30 blocks, batch 1, with every block compiled in mode
           reduce-overhead (CUDA graphs)
  compile  torch.compile of the eager chains (default mode for every kernel row's
           shape, rank 32 x 1 adapter for the LoRA chain; max-autotune-no-cudagraphs
           at M = 4096 while the budget lasts), filled into the kernel rows

Opt-in parts (run only when named in --parts):

  comfy_dynamic  bench/comfy_dynamic/device_run.py: real ComfyUI 0.33 with dynamic VRAM on (its source
           and the wheels the GPU machine lacks carried in bench/.carry/comfy_dynamic, built here by
           bench/comfy_dynamic/build_carry.py): ours (auto / merge / dynamic x lossless / exact) vs
           ComfyUI's own LoRA on a Wan-1.3B-dims model through UNETLoader, bf16 / fp8 / nvfp4; its
           dry run is that script's --dry-run (the bundled host, CPU) plus build_carry.py --plan

Outputs in DIR: device_check.json (everything), device_check.md (the tables),
pytest.log, dit<i>.log/json, tuned_<family>.json.

Targets read against: best fused linear+GELU >= 1.10x faster than eager at M >= 4096;
LoRA-aware <= 1.05x the best base arm at M >= 4096, ranks <= 64; end to end dynamic
<= 1.04x merged per step at 32760 tokens (<= 1.03x with 14B dims, <= 1.15x at 1530 tokens);
swap <= 1.0x re-patch.

--dry-run (CPU, in CI): every part is planned and its inputs are built on the meta
device, every kernel arm runs once on a tiny CPU row with its numerics, the pytest
run is a --collect-only, the DiT bench runs its own --dry-run, the swap bench its --smoke
(tiny dims, on the CPU); nothing touches CUDA.
It keeps this script from rotting between GPU sessions.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PACKAGE = "comfyui_lora_runtime"


def ensure_package() -> dict:
    """Make `comfyui_lora_runtime` importable (an editable install, or a link to this
    checkout on sys.path and PYTHONPATH for the subprocesses); return the env to pass."""
    env = dict(os.environ)
    try:
        import comfyui_lora_runtime  # noqa: F401
        return env
    except ImportError:
        pass
    link_dir = Path(tempfile.mkdtemp(prefix="lora_runtime_pkg_"))
    (link_dir / PACKAGE).symlink_to(ROOT, target_is_directory=True)
    sys.path.insert(0, str(link_dir))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(link_dir), env.get("PYTHONPATH", "")) if p)
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    return env


ENV = ensure_package()
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from comfyui_lora_runtime.kernels import launch_configs as lc  # noqa: E402
from comfyui_lora_runtime.kernels import registry  # noqa: E402
from comfyui_lora_runtime.kernels.linear_gelu_tanh import linear_gelu_tanh  # noqa: E402
from comfyui_lora_runtime.kernels.lora_linear import lora_linear  # noqa: E402

from _timing import interleaved_rounds  # noqa: E402

# name -> (K, N) of the FFN up-projection followed by GELU(tanh)
SHAPES = {"wan-1.3b": (1536, 8960), "wan-14b": (5120, 13824), "flux": (3072, 12288)}
TOKENS = (512, 4096, 32760)
# (rank, adapters) of the LoRA arms: one adapter at each rank, and three rank-32 adapters stacked
LORA_SETS = ((16, 1), (32, 1), (64, 1), (128, 1), (32, 3))
NUMERICS_SET = (32, 3)
BASE_ARMS = ("eager", "cublaslt", "triton")
# peft: the PEFT-shaped eager chain; shipped: the pack's AdaptedLayer (lossless) + GELU, what an
# unfused site runs; then each registered LoRA-aware backend of the pack
LORA_ARMS = ("peft", "shipped", "triton", "kconcat_cached", "kconcat_rebuilt", "delta_first")
STRENGTHS = (0.8, -0.5, 1.3)
TUNE_M = (512, 2048, 4096, 32768)   # 2048/4096: the DiT bench's 1530 / 3060 tokens
TUNE_RANK = 32
DTYPE = torch.bfloat16
# Share of the budget each part may use at most (the rest carries over).
CARRY = ROOT / "bench" / ".carry" / "comfy_dynamic"   # built by bench/comfy_dynamic/build_carry.py
PART_CAPS = {"env": 20, "tests": 160, "tune": 70, "kernels": 110, "swap": 40, "quantized": 40, "dit": 300,
             "compile": 10 ** 6, "comfy_dynamic": 420}
OPT_IN = ("comfy_dynamic",)   # run only when named in --parts
ALL_PARTS = tuple(PART_CAPS)
PARTS = tuple(p for p in ALL_PARTS if p not in OPT_IN)
TARGETS = dict(lora_x_best_base=1.05, base_fused_x_eager=1 / 1.10, dit_dynamic_x_merged=1.04,
               dit_dynamic_x_merged_14b=1.03, dit_dynamic_x_merged_small=1.15, swap_x_repatch=1.0)


class Budget:
    def __init__(self, total_s: float):
        self.t0, self.total = time.monotonic(), total_s

    def left(self) -> float:
        return self.total - (time.monotonic() - self.t0)

    def for_part(self, name: str) -> float:
        return max(0.0, min(PART_CAPS[name], self.left()))


class OutOfTime(Exception):
    pass


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- env

def part_env(ctx) -> dict:
    import triton
    info = dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, host=platform.node(), dry_run=ctx.dry)
    if not ctx.dry:
        info.update(device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                    sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
            info["nvidia_smi"] = smi.stdout.strip()
            info["driver"] = smi.stdout.split(",")[1].strip() if smi.returncode == 0 else None
        except (OSError, subprocess.SubprocessError) as exc:
            info["nvidia_smi"] = f"unavailable: {exc!r}"
        info["family"] = lc.family_names(info["device"], tuple(info["capability"]))[0]
    else:
        info.update(device="(dry run)", family="dry-run")
    return info


# ---------------------------------------------------------------- tests

def part_tests(ctx) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
           "tests/kernels", "tests/lora_runtime/fusion"]
    if ctx.dry:
        cmd.append("--collect-only")
    else:
        try:  # compiling the kernels' variants dominates: spread it over processes where xdist is there
            import xdist  # noqa: F401
            cmd += ["-n", str(min(8, os.cpu_count() or 1))]
        except ImportError:
            pass
    log("running " + " ".join(cmd[2:]))
    env = dict(ENV)
    if not ctx.dry:
        env.pop("TRITON_INTERPRET", None)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=max(10, ctx.budget.for_part("tests")))
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        (ctx.out / "pytest.log").write_text(out)
        raise OutOfTime(f"pytest ran past {exc.timeout:.0f}s") from None
    (ctx.out / "pytest.log").write_text(out)
    counts = re.compile(r"\b\d+ (passed|failed|errors?|tests? collected)\b")
    summary = [ln.strip("= ") for ln in out.splitlines() if counts.search(ln)][-1:] or [""]
    failed = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    res = dict(command=" ".join(cmd[2:]), returncode=rc, summary=summary[0], failed=failed[:40])
    if rc != 0:
        res["status"] = "failed"
    return res


# ---------------------------------------------------------------- inputs

def make_inputs(m: int, k: int, n: int, ranks: tuple[int, ...], device, seed: int = 0):
    """x [m,k], W [n,k], b [n], stacked A [R,k], B [n,R], per-adapter factors, in bf16.
    Deltas about 5 % of the base output, as trained adapters are."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, std=1.0):
        if device == "meta":
            return torch.empty(*shape, device="meta", dtype=DTYPE)
        return (torch.randn(*shape, generator=g) * std).to(device, DTYPE)

    x, w, b = rnd(m, k), rnd(n, k, std=k ** -0.5), rnd(n, std=0.1)
    r = sum(ranks)
    a = rnd(r, k, std=k ** -0.5)
    bb = rnd(n, r, std=0.05 * max(r, 1) ** -0.5)
    strengths = STRENGTHS[:len(ranks)]
    if len(ranks) == 1:
        scale = strengths[0]
    else:
        scale = torch.cat([torch.full((rk,), s) for rk, s in zip(ranks, strengths)])
        scale = scale.to("cpu" if device == "meta" else device)
    return x, w, b, a, bb, ranks, scale


def peft_eager_gelu(x, w, b, a, bb, ranks, scale):
    """PEFT's shape for several adapters: base + sum_i B_i(A_i x) * s_i, then GELU, in bf16."""
    y = F.linear(x, w, b)
    start = 0
    for i, rk in enumerate(ranks):
        s = STRENGTHS[i]
        y = y + F.linear(F.linear(x, a[start:start + rk]), bb[:, start:start + rk]) * s
        start += rk
    return F.gelu(y, approximate="tanh")


def eager_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def cublaslt_gelu(x, w, b):
    return torch._addmm_activation(b, x, w.t(), use_gelu=True)


# ---------------------------------------------------------------- tune

def tune_plan() -> list[lc.BucketKey]:
    keys = []
    for name, (k, n) in SHAPES.items():
        for m in TUNE_M:
            keys.append(lc.BucketKey("linear_gelu_tanh", lc.dtype_key(DTYPE), n, k, m))
            keys.append(lc.BucketKey("lora_linear_gelu", lc.dtype_key(DTYPE), n, k, m))
    return keys


def part_tune(ctx) -> dict:
    keys = tune_plan()
    entries, deadline = [], time.monotonic() + ctx.budget.for_part("tune")
    for key in keys:
        if time.monotonic() > deadline:
            raise OutOfTime(f"tuned {len(entries)}/{len(keys)} buckets")
        dev = "meta" if ctx.dry else ctx.device
        x, w, b, a, bb, _, scale = make_inputs(key.M_bucket, key.K, key.N, (TUNE_RANK,), dev)
        if ctx.dry:
            registry.validate("lora_linear", x, w, b, a, bb, scale)
            entries.append(dict(key.as_dict(), config=lc.CANDIDATES[0].meta(), planned=True))
            continue
        if key.op == "linear_gelu_tanh":
            def run():
                linear_gelu_tanh(x, w, b, backend="triton")
        else:
            def run():
                lora_linear(x, w, b, a, bb, scale, gelu=True, backend="triton")

        def launch(cfg, _run=run):
            with lc.pinned(cfg):
                _run()

        t0 = time.perf_counter()
        best, timings = lc.tune_bucket(launch)
        entries.append(dict(key.as_dict(), config=best.meta(), ms=timings[best.label()],
                            candidates_ms={k_: (None if v == float("inf") else round(v, 5))
                                           for k_, v in timings.items()}))
        log(f"tuned {key.op} N={key.N} K={key.K} M<={key.M_bucket}: {best.label()} "
            f"{timings[best.label()]:.3f} ms ({time.perf_counter() - t0:.1f}s)")
        del x, w, b, a, bb
    meta = {k_: ctx.env.get(k_) for k_ in ("device", "capability", "driver", "torch", "triton", "cuda")}
    meta["tuned_on"] = time.strftime("%Y-%m-%d")
    meta["note"] = "written by bench/device_check.py (part tune); keys: op, dtype, N, K, M_bucket"
    fam = ctx.env.get("family", "dry-run")
    out_path = ctx.out / f"tuned_{fam}.json"
    lc.write_table(out_path, entries, meta)
    res = dict(buckets=len(entries), table=out_path.name)
    if not ctx.dry:
        lc.write_table(lc.TABLE_DIR / f"{fam}.json", entries, meta)  # the parts after this one read it
        lc.forget()
        res["installed"] = str(lc.TABLE_DIR / f"{fam}.json")
    return res


# ---------------------------------------------------------------- kernels

def kernel_row_plan() -> list[tuple[str, int]]:
    return [(name, m) for m in TOKENS for name in SHAPES]


def _max_rel_err(y, ref) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def lossless_stats(y, ref, truth) -> dict:
    """contracts.md s.1 vs an fp64 truth: RMS and max error as x the reference path's
    (<= 1.5 each), the mean error as x the reference RMS (<= 0.25)."""
    eo, er = y.double() - truth, ref.double() - truth
    rms_r, max_r = float(er.pow(2).mean().sqrt()), float(er.abs().max())
    st = dict(rms_x=float(eo.pow(2).mean().sqrt()) / rms_r, max_x=float(eo.abs().max()) / max_r,
              mean_x_rms=abs(float(eo.mean())) / rms_r)
    st["ok"] = st["rms_x"] <= 1.5 and st["max_x"] <= 1.5 and st["mean_x_rms"] <= 0.25
    return st


def shipped_layer(w, b, a, bb, ranks):
    """The pack's AdaptedLayer over (w, b) with the stacked adapters split back per adapter
    (alpha = rank, so each factor is its strength, as make_inputs' scale)."""
    from torch import nn

    from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
    from comfyui_lora_runtime.lora_runtime.layer.wrapper import AdaptedLayer
    lin = nn.Linear(w.shape[1], w.shape[0], device="meta")
    lin.weight, lin.bias = nn.Parameter(w, requires_grad=False), nn.Parameter(b, requires_grad=False)
    wr = AdaptedLayer(lin, "row")
    start = 0
    for i, rk in enumerate(ranks):
        wr.add_adapter(f"a{i}", LayerAdapter(f"row.{i}", down=a[start:start + rk], up=bb[:, start:start + rk],
                                             alpha=float(rk)), STRENGTHS[i])
        start += rk
    return wr


def kernel_arms(x, w, b, lora_inputs: dict) -> tuple[dict, dict]:
    """{arm: thunk} for one row, and {arm: why not} for the arms that cannot run here."""
    from comfyui_lora_runtime.lora_runtime.layer.runtime_context import runtime_context
    arms, missing = {"eager": lambda: eager_gelu(x, w, b)}, {}
    for be in ("cublaslt", "triton"):
        why = registry.get("linear_gelu_tanh", be).why_not(x.device, x.dtype)
        if why:
            missing[be] = why
        else:
            arms[be] = (lambda be=be: linear_gelu_tanh(x, w, b, backend=be))
    for (r, count), li in lora_inputs.items():
        tag = f"_r{r}x{count}"
        a, bb, ranks, scale = li[3], li[4], li[5], li[6]
        arms["peft" + tag] = (lambda li=li: peft_eager_gelu(*li))
        wr = shipped_layer(w, b, a, bb, ranks)

        def shipped(wr=wr):
            with runtime_context(tier="lossless"):
                return F.gelu(wr(x), approximate="tanh")
        arms["shipped" + tag] = shipped
        for be in LORA_ARMS[2:]:
            why = registry.get("lora_linear", be).why_not(x.device, x.dtype)
            if why:
                missing[be + tag] = why
                continue
            state = {}
            arms[be + tag] = (lambda be=be, a=a, bb=bb, scale=scale, state=state:
                              lora_linear(x, w, b, a, bb, scale, gelu=True, backend=be, state=state))
    return arms, missing


def row_numerics(arms, x, w, b, lora_inputs) -> dict:
    """Each base arm vs eager and each LoRA arm of NUMERICS_SET vs the PEFT-shaped chain,
    under the lossless rule against an fp64 truth; and each LoRA arm's distance from the
    base output (the wrong answer) as a share of the adapter's effect."""
    out = {}
    base64 = F.linear(x.double(), w.double(), b.double())
    truth = F.gelu(base64, approximate="tanh")
    ref = arms["eager"]()
    for be in BASE_ARMS[1:]:
        if be in arms:
            out[be] = lossless_stats(arms[be](), ref, truth)
    del truth
    r, count = NUMERICS_SET
    li = lora_inputs[NUMERICS_SET]
    a, bb, scale = li[3], li[4], li[6]
    s = scale.double()[:, None] if isinstance(scale, torch.Tensor) else scale
    truth = F.gelu(base64 + x.double() @ (a.double().t() @ (s * bb.double().t())), approximate="tanh")
    base_only = F.gelu(base64, approximate="tanh")
    effect = float((truth - base_only).abs().mean())
    tag = f"_r{r}x{count}"
    ref = arms["peft" + tag]()
    for arm in LORA_ARMS[1:]:
        if arm + tag in arms:
            y = arms[arm + tag]()
            st = lossless_stats(y, ref, truth)
            st["vs_base_x_effect"] = float((y.double() - base_only).abs().mean()) / effect  # ~1, never ~0
            out[arm + tag] = st
    return out


def part_kernels(ctx) -> dict:
    """Per row (shape, M): base arms (eager, cuBLASLt epilogue, Triton fused) and, per LoRA
    set, the PEFT-shaped chain, the shipped wrapper and every LoRA-aware backend; ms and
    x the best base arm of the same round, plus each arm's numerics. The dry run builds
    every row's inputs on the meta device and runs every arm once on a tiny CPU row."""
    rows, deadline = [], time.monotonic() + ctx.budget.for_part("kernels")
    dev = "meta" if ctx.dry else ctx.device
    if ctx.dry:
        ctx.results["kernels_smoke"] = kernel_smoke()
    for name, m in kernel_row_plan():
        if time.monotonic() > deadline:
            ctx.results["kernels_rows"] = rows
            raise OutOfTime(f"measured {len(rows)} of {len(kernel_row_plan())} shape rows")
        k, n = SHAPES[name]
        x, w, b, *_ = make_inputs(m, k, n, (1,), dev)
        lora_inputs = {}
        for r, count in LORA_SETS:
            li = make_inputs(m, k, n, (r,) * count, dev, seed=r + count)
            lora_inputs[(r, count)] = (x, w, b) + li[3:]
        row = dict(shape=name, M=m, K=k, N=n, dtype="bf16")
        if ctx.dry:
            for li in lora_inputs.values():
                registry.validate("lora_linear", *li[:5], li[6])
            row["arms"] = {a_: None for a_ in list(BASE_ARMS) + [f"{arm}_r{r}x{c}" for r, c in LORA_SETS
                                                                 for arm in LORA_ARMS]}
            rows.append(row)
            continue
        arms, missing = kernel_arms(x, w, b, lora_inputs)
        with torch.inference_mode():
            row["numerics"] = row_numerics(arms, x, w, b, lora_inputs)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            arms["eager"]()
            torch.cuda.synchronize()
            one = max(time.perf_counter() - t0, 1e-5)
            inner = max(1, min(50, int(1e-3 / one)))
            stats = interleaved_rounds(arms, ctx.device, refs=("eager",), warmup=2, repeats=ctx.repeats,
                                       inner=inner)
        bases = [a_ for a_ in BASE_ARMS if a_ in stats]
        best = [min(stats[a_].ms[i] for a_ in bases) for i in range(len(stats["eager"].ms))]
        row["inner"], row["missing"] = inner, missing
        row["arms"] = {a_: dict(ms=s_.median_ms, x_eager=s_.ratio("eager"),
                                x_best_base=statistics.median(v / bb_ for v, bb_ in zip(s_.ms, best)))
                       for a_, s_ in stats.items()}
        row["best_base"] = min(bases, key=lambda a_: stats[a_].median_ms)
        rows.append(row)
        lo = {arm: row["arms"].get(f"{arm}_r32x1", {}).get("x_best_base") for arm in LORA_ARMS}
        log(f"kernels {name} M={m}: best base {row['best_base']} {row['arms'][row['best_base']]['ms']:.3f} ms; "
            "r32x1 x best base: " + ", ".join(f"{k_} {fmt(v)}" for k_, v in lo.items()))
        del arms, lora_inputs, stats, x, w, b
        torch.cuda.empty_cache()
    ctx.results["kernels_rows"] = rows
    return dict(rows=len(rows))


def kernel_smoke() -> dict:
    """Every kernel arm built and called once on a tiny bf16 CPU row with its numerics
    (the dry run: the arms' code cannot rot between GPU sessions). Arms whose backend
    cannot run on the CPU are listed with the reason."""
    g = torch.Generator().manual_seed(0)
    k, n, m = 32, 48, 64  # tiny: the Triton arms run in the interpreter here
    x = torch.randn(m, k, generator=g).to(DTYPE)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DTYPE)
    b = (torch.randn(n, generator=g) * 0.1).to(DTYPE)
    lora_inputs = {}
    for r, count in LORA_SETS:
        li = make_inputs(m, k, n, (r,) * count, "cpu", seed=r + count)
        lora_inputs[(r, count)] = (x, w, b) + li[3:]
    arms, missing = kernel_arms(x, w, b, lora_inputs)
    with torch.inference_mode():
        ran = {a_: tuple(fn().shape) for a_, fn in arms.items()}
        numerics = row_numerics(arms, x, w, b, lora_inputs)
    return dict(ran=sorted(ran), missing=missing, numerics=numerics)


# ---------------------------------------------------------------- dit

VIDEO = ["--latent", "16,21,60,104", "--inner", "1"]   # 480p, 81 frames: 32760 tokens
DIT_RUNS = {  # name -> arguments of bench_dit_step.py, in the order they run (--cfg: batch 1 and 2)
    "Wan-2.1-1.3B dims, 1530 tokens, 30 blocks": ["--cfg", "--blocks", "30"],
    "Wan-2.1-1.3B dims, 32760 tokens (480p, 81 frames), 8 blocks": ["--cfg", "--blocks", "8", *VIDEO],
    "Wan-2.1-14B dims, 32760 tokens (480p, 81 frames), 2 blocks": ["--cfg", "--dims", "14b", "--blocks", "2", *VIDEO],
    # batch 1 only: each batch size is one more compile of every arm
    "Wan-2.1-1.3B dims, 1530 tokens, 30 blocks, compiled (reduce-overhead: CUDA graphs), batch 1": [
        "--blocks", "30", "--compile", "reduce-overhead", "--fusion-backend", "none"],
}


def part_dit(ctx) -> dict:
    out_runs, deadline = {}, time.monotonic() + ctx.budget.for_part("dit")
    for i, (name, extra) in enumerate(DIT_RUNS.items()):
        js = ctx.out / f"dit{i}.json"
        cmd = [sys.executable, str(HERE / "bench_dit_step.py"), "--json", str(js), *extra]
        cmd += ["--dry-run"] if ctx.dry else ["--device", "cuda", "--repeats", str(max(3, ctx.repeats))]
        log("running " + " ".join(cmd[1:]))
        left = deadline - time.monotonic()
        if left < 20:
            ctx.results["parts"]["dit"] = dict(runs=out_runs)
            raise OutOfTime(f"ran {i} of {len(DIT_RUNS)} DiT benchmarks")
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=left)
            text = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            text = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            (ctx.out / f"dit{i}.log").write_text(text)
            out_runs[name] = dict(status="incomplete: budget")
            continue
        (ctx.out / f"dit{i}.log").write_text(text)
        if proc.returncode != 0:
            out_runs[name] = dict(status="failed", returncode=proc.returncode, tail=text[-3000:])
            continue
        out_runs[name] = dict(json.loads(js.read_text()), status="ok",
                              table=[ln for ln in proc.stdout.splitlines() if ln.startswith(("|", "# target"))])
    failed = [n for n, r in out_runs.items() if r["status"] != "ok"]
    return dict(runs=out_runs, **({"status": "failed", "error": f"not ok: {failed}"} if failed else {}))


# ---------------------------------------------------------------- swap

def _run_bench(ctx, part: str, script: str, args: list[str], env: dict | None = None):
    """Run bench/`script` (`--smoke` in a dry run, else `args`) within the part's budget; its log
    goes to DIR/<part>.log. Returns the finished process, or a failed part's dict."""
    cmd = [sys.executable, str(HERE / script)] + (["--smoke"] if ctx.dry else args)
    log("running " + " ".join(cmd[1:]))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env or ENV, capture_output=True, text=True,
                              timeout=max(1.0, ctx.budget.for_part(part)))
    except subprocess.TimeoutExpired as exc:
        text = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        (ctx.out / f"{part}.log").write_text(text)
        raise OutOfTime(f"{script} did not finish") from None
    text = proc.stdout + proc.stderr
    (ctx.out / f"{part}.log").write_text(text)
    if proc.returncode != 0:
        return dict(status="failed", returncode=proc.returncode, error=text[-1500:])
    return proc


def part_swap(ctx) -> dict:
    """bench_switch.py on the GPU (6 blocks, 3 rounds); its table and ratio lines."""
    proc = _run_bench(ctx, "swap", "bench_switch.py", ["--device", "cuda", "--blocks", "6", "--rounds", "3"])
    if isinstance(proc, dict):
        return proc
    ratios = {}
    for ln in proc.stdout.splitlines():
        key, sep, val = ln.rpartition(": ")
        if sep and key in ("dynamic / merge", "swap (restore memory copy) / re-patch", "swap / re-patch"):
            ratios[key] = float(val)
    table = [ln for ln in proc.stdout.splitlines() if ln.startswith(("|", "# restore bit-exact"))]
    return dict(ratios=ratios, table=table, summary=", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))


# ---------------------------------------------------------------- quantized

def kitchen_env() -> tuple[dict, str]:
    """The env for a part that needs comfy-kitchen (the GPU image lacks it): as it is when it imports,
    else with comfy-kitchen unpacked from the dynamic-VRAM carry's site.tar.xz onto PYTHONPATH."""
    import importlib.util
    if importlib.util.find_spec("comfy_kitchen") is not None:
        return ENV, "installed"
    site = CARRY / "site.tar.xz"
    if not site.is_file():
        return ENV, f"absent (no {site.relative_to(ROOT)} to take it from: carry bench/.carry/comfy_dynamic)"
    import tarfile
    dest = Path(tempfile.mkdtemp(prefix="comfy_kitchen_"))   # not under DIR: DIR comes back from the GPU machine
    with tarfile.open(site) as tf:
        tf.extractall(dest, members=[m for m in tf.getmembers() if m.name.split("/")[0] == "comfy_kitchen"],
                      filter="data")
    env = dict(ENV, PYTHONPATH=os.pathsep.join(p for p in (ENV.get("PYTHONPATH", ""), str(dest)) if p))
    return env, f"from {site.relative_to(ROOT)}"


def part_quantized(ctx) -> dict:
    """bench_quantized.py on the GPU: quantized bases (fp8, nvfp4) alone vs our dynamic adapters."""
    env, kitchen = kitchen_env()
    log(f"comfy-kitchen: {kitchen}")
    proc = _run_bench(ctx, "quantized", "bench_quantized.py", ["--device", "cuda", "--tokens", "4096", "--repeats", "3"],
                      env)
    if isinstance(proc, dict):
        return proc
    lines = [ln for ln in proc.stdout.splitlines() if ": base " in ln]
    return dict(lines=lines, summary="; ".join(lines))


# ---------------------------------------------------------------- compile

def part_compile(ctx) -> dict:
    rows = {(r["shape"], r["M"]): r for r in ctx.results.get("kernels_rows", [])}
    plan = [(mode, name, m) for mode in ("default", "max-autotune-no-cudagraphs") for name, m in kernel_row_plan()
            if mode == "default" or m == 4096]
    done, deadline = [], time.monotonic() + ctx.budget.for_part("compile") - 5
    dev = "meta" if ctx.dry else ctx.device
    for mode, name, m in plan:
        if ctx.dry:
            done.append(dict(mode=mode, shape=name, M=m, planned=True))
            continue
        if time.monotonic() > deadline - 40:  # a compile takes tens of seconds: do not start one we cannot finish
            ctx.results["compile_rows"] = done
            raise OutOfTime(f"compiled {len(done)} of {len(plan)} (mode, shape, M) rows")
        k, n = SHAPES[name]
        x, w, b, a, bb, ranks, scale = make_inputs(m, k, n, (32,), dev, seed=33)
        torch._dynamo.reset()
        kw = {} if mode == "default" else {"mode": mode}
        c_eager = torch.compile(eager_gelu, dynamic=False, **kw)
        c_peft = torch.compile(peft_eager_gelu, dynamic=False, **kw)
        t0 = time.perf_counter()
        with torch.inference_mode():
            c_eager(x, w, b)
            c_peft(x, w, b, a, bb, ranks, scale)
            compile_s = time.perf_counter() - t0
            arms = {"fused": lambda: linear_gelu_tanh(x, w, b), "eager": lambda: eager_gelu(x, w, b),
                    "compiled_eager": lambda: c_eager(x, w, b),
                    "ours_r32x1": lambda: lora_linear(x, w, b, a, bb, scale, gelu=True),
                    "compiled_peft_r32x1": lambda: c_peft(x, w, b, a, bb, ranks, scale)}
            stats = interleaved_rounds(arms, ctx.device, refs=("fused", "eager"), warmup=2, repeats=ctx.repeats,
                                       inner=5)
        entry = dict(mode=mode, shape=name, M=m, compile_s=compile_s,
                     arms={a_: dict(ms=s.median_ms, x_fused=s.ratio("fused"), x_eager=s.ratio("eager"))
                           for a_, s in stats.items()})
        done.append(entry)
        row = rows.get((name, m))
        if row is not None:
            row.setdefault("compiled", {})[mode] = entry["arms"]
        log(f"compile[{mode}] {name} M={m}: compiled eager x{stats['compiled_eager'].ratio('fused'):.3f} fused, "
            f"compiled peft x{stats['compiled_peft_r32x1'].ratio('fused'):.3f}, ours r32 "
            f"x{stats['ours_r32x1'].ratio('fused'):.3f} ({compile_s:.0f}s to compile)")
        del x, w, b, a, bb, c_eager, c_peft, arms
    ctx.results["compile_rows"] = done
    return dict(rows=len(done))


# ---------------------------------------------------------------- comfy_dynamic



def part_comfy_dynamic(ctx) -> dict:
    """bench/comfy_dynamic/device_run.py (its --dry-run in a dry run, with build_carry.py --plan)."""
    out = ctx.out / "comfy_dynamic"
    script = HERE / "comfy_dynamic" / "device_run.py"
    res: dict = {}
    if ctx.dry:
        proc = subprocess.run([sys.executable, str(HERE / "comfy_dynamic" / "build_carry.py"), "--plan"], cwd=ROOT,
                              env=ENV, capture_output=True, text=True, timeout=120)
        (ctx.out / "comfy_dynamic_carry.log").write_text(proc.stdout + proc.stderr)
        body = proc.stdout[proc.stdout.index("{"):] if "{" in proc.stdout else "{}"
        res["carry_plan"] = json.loads(body)
        if proc.returncode != 0:
            return dict(res, status="failed", error="build_carry.py --plan: " + (proc.stdout + proc.stderr)[-1500:])
        cmd = [sys.executable, str(script), "--dry-run", "--out", str(out)]
    else:
        if not (CARRY / "manifest.json").is_file():
            return dict(status="failed", error=f"no carry folder at {CARRY}: build it with "
                                               "bench/comfy_dynamic/build_carry.py and name it in the device call's carry")
        cmd = [sys.executable, str(script), "--carry", str(CARRY), "--out", str(out)]
    log("running " + " ".join(cmd[1:]))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True,
                              timeout=max(1.0, ctx.budget.for_part("comfy_dynamic")))
    except subprocess.TimeoutExpired as exc:
        text = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        (ctx.out / "comfy_dynamic.log").write_text(text)
        raise OutOfTime("device_run.py did not finish") from None
    (ctx.out / "comfy_dynamic.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return dict(res, status="failed", returncode=proc.returncode, error=(proc.stdout + proc.stderr)[-1500:])
    run = json.loads((out / "comfy_dynamic.json").read_text())
    bad = [v["variant"] for v in run["variants"] if "error" in v]
    res.update(run=run, table=(out / "comfy_dynamic.md").read_text().splitlines(),
               summary=", ".join(f"{v['variant']}: {'skipped' if 'skipped' in v else 'error' if 'error' in v else 'ok'}"
                                 for v in run["variants"]))
    if bad:
        res.update(status="failed", error=f"variants failed: {bad}")
    return res


# ---------------------------------------------------------------- report

def markdown(results: dict) -> str:
    env = results.get("parts", {}).get("env", {})
    lines = [f"# Device check — {env.get('device')} (driver {env.get('driver')}, CUDA {env.get('cuda')}, "
             f"torch {env.get('torch')}, Triton {env.get('triton')}), {results.get('date')}", ""]
    lines.append("| part | status | seconds | summary |")
    lines.append("|---|---|---|---|")
    for name, p in results.get("parts", {}).items():
        summ = p.get("summary") or p.get("error") or ", ".join(f"{k}={v}" for k, v in p.items()
                                                               if k in ("rows", "buckets", "table"))
        lines.append(f"| {name} | {p.get('status')} | {p.get('seconds', 0):.0f} | {str(summ)[:160]} |")
    krows = results.get("kernels_rows", [])
    if krows and krows[0]["arms"] and (krows[0]["arms"].get("eager") or {}).get("ms"):
        lines += ["", "## Linear+GELU(tanh), bf16, no adapter — ms of eager, and × eager (target for the "
                      f"best fused ≤ {TARGETS['base_fused_x_eager']:.3f})", "",
                  "| shape (K→N) | M | eager ms | cuBLASLt epilogue × | Triton fused × | torch.compile × | "
                  "max-autotune × |", "|---|---|---|---|---|---|---|"]
        for r in krows:
            a = r["arms"]
            comp = r.get("compiled", {})
            c1 = comp.get("default", {}).get("compiled_eager", {}).get("x_eager")
            c2 = comp.get("max-autotune-no-cudagraphs", {}).get("compiled_eager", {}).get("x_eager")
            lines.append(f"| {r['shape']} ({r['K']}→{r['N']}) | {r['M']} | {a['eager']['ms']:.3f} | "
                         f"{fmt(a.get('cublaslt', {}).get('x_eager'))} | {fmt(a.get('triton', {}).get('x_eager'))} | "
                         f"{fmt(c1)} | {fmt(c2)} |")
        for rk, c in LORA_SETS:
            tag = f"_r{rk}x{c}"
            lines += ["", f"## LoRA r{rk}×{c}, bf16 — × the best base arm of the same round (target ≤ "
                          f"{TARGETS['lora_x_best_base']})", "",
                      "| shape | M | best base | " + " | ".join(LORA_ARMS) + " |",
                      "|---|---|---|" + "---|" * len(LORA_ARMS)]
            for r in krows:
                a = r["arms"]
                lines.append(f"| {r['shape']} | {r['M']} | {r.get('best_base')} | " + " | ".join(
                    fmt(a.get(arm + tag, {}).get("x_best_base")) for arm in LORA_ARMS) + " |")
        lines += ["", f"## Numerics (lossless rule vs fp64: RMS×, max× ≤ 1.5, mean ≤ 0.25 RMS; LoRA arms "
                      f"r{NUMERICS_SET[0]}×{NUMERICS_SET[1]} vs the PEFT-shaped chain)", "",
                  "| shape | M | arm | RMS × | max × | mean/RMS | ok |", "|---|---|---|---|---|---|---|"]
        for r in krows:
            for arm, st in (r.get("numerics") or {}).items():
                lines.append(f"| {r['shape']} | {r['M']} | {arm} | {st['rms_x']:.2f} | {st['max_x']:.2f} | "
                             f"{st['mean_x_rms']:.3f} | {st['ok']} |")
        lines.append("")
        lines.append("Medians of per-round ratios; arms missing on this device: see kernels_rows[].missing.")
    for name, run in (results.get("parts", {}).get("dit", {}).get("runs") or {}).items():
        if run.get("table"):
            lines += ["", f"## DiT step, {name} (bench_dit_step.py)", ""] + run["table"]
            fused = run.get("fused_sites")
            if fused:
                lines.append(f"\nfusion sites mounted: {fused}")
    swap = results.get("parts", {}).get("swap", {})
    if swap.get("table"):
        lines += ["", "## Adapter swap A → B vs a ComfyUI-style re-patch (bench_switch.py --device cuda)", ""]
        lines += swap["table"]
    quant = results.get("parts", {}).get("quantized", {})
    if quant.get("lines"):
        lines += ["", "## Quantized bases (bench_quantized.py --device cuda)", ""] + [f"- {ln}" for ln in quant["lines"]]
    cd = results.get("parts", {}).get("comfy_dynamic", {})
    if cd.get("table"):
        lines += ["", "## ComfyUI dynamic VRAM: ours vs ComfyUI's LoRA (bench/comfy_dynamic/device_run.py)", ""]
        lines += [ln for ln in cd["table"] if not ln.startswith("# ")]
    crow = results.get("compile_rows", [])
    if crow and not crow[0].get("planned"):
        lines += ["", "## torch.compile baselines (× ours fused, same run)", "",
                  "| mode | shape | M | compiled eager × | compiled PEFT r32 × | ours r32 × | compile s |",
                  "|---|---|---|---|---|---|---|"]
        for c in crow:
            a = c["arms"]
            lines.append(f"| {c['mode']} | {c['shape']} | {c['M']} | {a['compiled_eager']['x_fused']:.3f} | "
                         f"{a['compiled_peft_r32x1']['x_fused']:.3f} | {a['ours_r32x1']['x_fused']:.3f} | "
                         f"{c['compile_s']:.0f} |")
    return "\n".join(lines) + "\n"


def fmt(v) -> str:
    return "—" if v is None else f"{v:.3f}"


class Ctx:
    def __init__(self, out: Path, budget: Budget, dry: bool, repeats: int):
        self.out, self.budget, self.dry, self.repeats = out, budget, dry, repeats
        self.results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "parts": {}, "targets": TARGETS}
        self.env: dict = {}
        self.device = "cuda"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=480.0, help="total seconds for all parts")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated subset of {','.join(ALL_PARTS)} (default: all but {','.join(OPT_IN)})")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per arm")
    p.add_argument("--dry-run", action="store_true", help="plan every part and build its inputs; no CUDA")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("device_check: no CUDA device is visible (use --dry-run to check the plan on a CPU)")
    wanted = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(wanted) - set(ALL_PARTS))
    if unknown:
        raise SystemExit(f"device_check: unknown part(s) {unknown}; choose from {', '.join(ALL_PARTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(args.out, Budget(args.budget_s), args.dry_run, args.repeats)
    funcs = dict(env=part_env, tests=part_tests, tune=part_tune, kernels=part_kernels, dit=part_dit,
                 swap=part_swap, quantized=part_quantized, compile=part_compile, comfy_dynamic=part_comfy_dynamic)
    for name in ALL_PARTS:
        if name not in wanted and name != "env":
            continue
        if ctx.budget.for_part(name) <= 1:
            ctx.results["parts"][name] = dict(status="skipped: budget")
            continue
        log(f"part {name} (budget left {ctx.budget.left():.0f}s)")
        t0 = time.monotonic()
        try:
            res = funcs[name](ctx)
            res.setdefault("status", "ok")
        except OutOfTime as exc:
            res = dict(status="incomplete: budget", error=str(exc))
        except Exception as exc:  # a part that breaks is reported; the next part still runs
            res = dict(status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
            if not ctx.dry:
                torch.cuda.empty_cache()
        res["seconds"] = time.monotonic() - t0
        if name == "env":
            ctx.env = res
        ctx.results["parts"][name] = res
        log(f"part {name}: {res['status']} in {res['seconds']:.0f}s" +
            (f" — {res.get('error')}" if res.get("error") else ""))
        (args.out / "device_check.json").write_text(json.dumps(ctx.results, indent=1, default=str) + "\n")
        (args.out / "device_check.md").write_text(markdown(ctx.results))
    print(markdown(ctx.results))
    return ctx.results


if __name__ == "__main__":
    main()
