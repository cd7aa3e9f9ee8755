"""Quantized bases in real ComfyUI (0.33+, on the CPU): seconds per sampling step of the base alone,
with ComfyUI's own LoRA (LoraLoaderModelOnly, 1 and 4 chained) and with ours (Load LoRA Adapter ->
LoRA Merge Mode dynamic, 1 and 4 adapters; auto, 1), side by side in one process.

    python bench/bench_quantized_comfy.py --comfyui /work/comfy033/ComfyUI   # 1 block, 1024 tokens, 2 rounds
    python bench/bench_quantized_comfy.py --comfyui DIR --smoke              # tiny dims, 1 round (0.5-1.5 min)
    python bench/bench_quantized_comfy.py --comfyui DIR --rounds 5 --pack /tmp/pack-HEAD  # a committed state

What runs (the launcher needs torch + safetensors only; ComfyUI runs in its own python):

1. The launcher writes a random-weight Wan 2.1 T2V model in ComfyUI's key layout
   (``testkit.random_wan``: the reference tiny Wan's recipe at Wan-1.3B dims: dim 1536, ffn 8960, 12 heads,
   ``--blocks`` blocks, bf16) and four rank-32 LoRAs on every block linear (``diffusion_model.<layer>
   .lora_down / lora_up / alpha`` keys, ``testkit.lora_assets.write_kohya_lora``, alpha = rank).
2. ComfyUI's own python quantizes every block linear (``testkit.quantized_checkpoints``: ComfyUI's
   ``QuantizedTensor.from_float`` + ``comfy_quant`` keys, as ComfyUI 0.33 loads them), per format:
   ``float8_e4m3fn`` (scaled fp8, one fp32 scale per tensor) and ``nvfp4`` (4-bit, e4m3 block scales).
3. Per format, a worker (this file with ``--worker``, under ComfyUI's python, cwd = the checkout,
   ``args.cpu = True``) loads the file with ``comfy.sd.load_diffusion_model``, imports the pack the
   way ComfyUI does (``nodes.load_custom_node`` on a temp ``custom_nodes/comfyui-lora-runtime``
   symlink to ``--pack``, default this checkout; the LoRAs in a ``loras`` folder registered with
   ``folder_paths``), builds the arms with the node classes (ComfyUI's ``LoraLoaderModelOnly``; our
   ``LoraRuntimeLoadAdapter`` -> ``LoraRuntimeMergeMode``), all on the one loaded model, and samples
   each with ``comfy.sample.sample`` (what KSampler calls: euler / simple, seed 42, ``--cfg``
   default 1.0 = one batch-1 model call per step, a fixed random 512-token text context).

Timing: the ``callback`` KSampler passes marks the end of each step's model call; the seconds per
step of a sampling are the mean of the intervals between consecutive callbacks (so from step 2 on:
no load / patch / attach in them). ``setup`` is the rest of a sampling: from its start to the first
model call (a forward pre-hook on the diffusion model) plus after the last callback, i.e. ComfyUI's
load and LoRA patch, our attach / measure / merge, the restore. Every arm samples once first (its
one-time cost), then ``--rounds`` interleaved rounds (``_timing.interleaved_rounds``: every arm once
per round, order rotated); ratios to the base are taken within a round, their median reported. Step
times are CPU seconds of the worker at ``--threads 1`` (robust to other processes on a shared
machine; wall seconds are printed beside them) and the best (least disturbed) step per arm.
Because the arms share one model, ComfyUI re-patches its LoRA on every sampling that follows another
arm (what switching workflows costs: "setup, later samplings"); the same arm sampled twice in a row
shows the setup without a switch ("same arm again": ComfyUI keeps its patched weights, and so do ours
since adapters stay on a loaded model, docs/lifecycle.md; ``bench_rerun.py`` measures re-runs per arm).

Checks: every arm's latent differs from the base's (the adapters are applied), every arm gives the
same latent in every sampling (so the base too after the others ran: the weights were restored).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FORMATS = ("float8_e4m3fn", "nvfp4")
ARMS = ("base", "comfy1", "comfy4", "dyn1", "dyn4", "auto1")
ARM_TEXT = {
    "base": "base alone",
    "comfy1": "ComfyUI LoraLoaderModelOnly x1",
    "comfy4": "ComfyUI LoraLoaderModelOnly x4 (chained)",
    "dyn1": "ours, dynamic x1",
    "dyn4": "ours, dynamic x4",
    "auto1": "ours, auto x1",
}
TEXT_DIM = 4096  # the Wan 2.1 text context width (testkit.random_wan)
SEED = 42


def log(msg: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# launcher side: model, LoRAs, quantized files, workers, table
# ---------------------------------------------------------------------------
def comfyui_python(comfy_dir: Path, given: str | None) -> str:
    if given:
        return given
    venv = comfy_dir.parent / "comfyui-venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def lora_chains(N, base, names, strength):
    """(comfy_lora(k), ours(k, mode)): the first k LoRAs chained on `base` by ComfyUI's LoraLoaderModelOnly,
    or by our Load LoRA Adapter nodes followed by LoRA Merge Mode `mode` (N: the worker's node classes)."""
    def comfy_lora(k):
        m = base
        for name in names[:k]:
            m = N["LoraLoaderModelOnly"]().load_lora_model_only(m, name, strength)[0]
        return m

    def ours(k, mode):
        m = base
        for name in names[:k]:
            m = N["LoraRuntimeLoadAdapter"]().load(m, name, strength)["result"][0]
        return N["LoraRuntimeMergeMode"]().set_mode(m, mode)[0]
    return comfy_lora, ours


def run_worker(python: str, comfy_dir: Path, cfg: dict, script: str | None = None) -> dict:
    """`script` (default this file) ``--worker CFG`` under ComfyUI's python (cwd = the checkout); its
    last stdout line is the JSON result."""
    cmd = [python, str(Path(script or __file__).resolve()), "--worker", json.dumps(cfg)]
    p = subprocess.Popen(cmd, cwd=str(comfy_dir), stdout=subprocess.PIPE, stderr=None, text=True)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if not line.startswith("{"):
            print(line, end="", flush=True)
    if p.wait() != 0:
        raise SystemExit(f"worker for {cfg.get('format') or cfg.get('form')} failed (rc {p.returncode})")
    return json.loads([ln for ln in lines if ln.startswith("{")][-1])


def table(results: list[dict]) -> str:
    """Markdown: per layout and arm, CPU seconds per step (1 thread: robust to other processes) and wall
    seconds per step, each x the base (median of per-round ratios, min-max), setup seconds, effect."""
    rows = ["| layout | arm | CPU s/step | x base (CPU) | min-max | best step x base (CPU) | wall s/step | x base (wall) "
            "| setup s, first sampling | setup s, later samplings (after another arm) | setup s, same arm again "
            "| whole sampling x base (wall) | latent vs base |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for n in ARMS:
            a = res["arms"][n]
            c, w = a["cpu"], a["wall"]
            bold = "**" if n in ("dyn1",) else ""
            ratio = "1.000" if n == "base" else f"{bold}{c['ratio']:.3f}{bold}"
            spread = "-" if n == "base" else f"{c['min']:.3f}-{c['max']:.3f}"
            diff = "-" if n == "base" else f"{100 * a['rel_diff']:.1f} %"
            best = "1.000" if n == "base" else f"{c['best_ratio']:.3f}"
            rows.append(f"| {res['format']} | {ARM_TEXT[n]} | {c['step_s']:.3f} | {ratio} | {spread} | {best} | "
                        f"{w['step_s']:.3f} | {w['ratio']:.3f} | {a['setup_first_s']:.2f} | {a['setup_s']:.2f} | "
                        f"{'-' if a.get('setup_again_s') is None else format(a['setup_again_s'], '.2f')} | "
                        f"{a['total_ratio']:.3f} | {diff} |")
    return "\n".join(rows)


def launcher(args) -> None:
    comfy_dir = Path(args.comfyui or os.environ.get("COMFYUI_DIR", "")).expanduser().resolve()
    if not ((comfy_dir / "main.py").is_file() and (comfy_dir / "comfy").is_dir()):
        raise SystemExit("--comfyui DIR (or COMFYUI_DIR): a ComfyUI checkout with main.py and comfy/")
    python = comfyui_python(comfy_dir, args.comfyui_python)
    sys.path.insert(0, str(REPO / "tests"))
    from testkit.lora_assets import write_kohya_lora
    from testkit.quantized_checkpoints import quantized_name, write_quantized_checkpoints
    from testkit.random_wan import block_linears, write_random_wan
    if args.smoke:
        args.dims, args.blocks, args.latent, args.rank, args.rounds = "128,512", 2, "64x64", 4, 1
        args.text_tokens = 16
    dim, ffn = (int(v) for v in args.dims.split(","))
    lw, lh = (int(v) for v in args.latent.lower().split("x"))  # image pixels, as EmptyHunyuanLatentVideo
    tokens = (lh // 16) * (lw // 16)
    formats = tuple(args.formats.split(","))
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if args.workdir:  # kept, and reused by a later run with the same model / LoRA settings
            tmp = Path(args.workdir).resolve()
            tmp.mkdir(parents=True, exist_ok=True)
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_qcomfy_")))
        linears = block_linears(dim, ffn, args.blocks)
        loras, qdir = tmp / "loras", tmp / "quantized"
        want = {"dims": [dim, ffn], "blocks": args.blocks, "rank": args.rank, "up_scale": args.up_scale,
                "formats": list(formats)}
        stamp = tmp / "assets.json"
        if stamp.exists() and json.loads(stamp.read_text())["settings"] == want:
            report = json.loads(stamp.read_text())["report"]
            log(f"reusing the model, LoRAs and quantized files in {tmp}")
        else:
            src = tmp / "wan_src.safetensors"
            write_random_wan(src, dim, ffn, args.blocks)
            for i in range(4):
                write_kohya_lora(loras / f"bench_r{args.rank}_{i}.safetensors", seed=7000 + i, rank=args.rank,
                                 alpha=float(args.rank), up_scale=args.up_scale, modules=linears)
            log(f"model ({dim}/{ffn}, {args.blocks} blocks) and 4 LoRAs written; quantizing with ComfyUI's python")
            report = write_quantized_checkpoints(python, comfy_dir, src, qdir, formats=formats,
                                                 layers=tuple(n for n, _, _ in linears))
            if "unsupported" in report:
                raise SystemExit(report["unsupported"])
            for f in formats:
                ideal = qdir / f"tiny_wan_{f}_ideal.safetensors"
                if ideal.exists():
                    ideal.unlink()  # the ideal fp32 model is not used here
            src.unlink()
            stamp.write_text(json.dumps({"settings": want, "report": report}))
        results = []
        for f in formats:
            info = report["formats"][f]
            if "skipped" in info:
                print(f"# {f}: skipped: {info['skipped']}")
                continue
            cfg = {"format": f, "layout": info["layout"], "model": str(qdir / quantized_name(f)),
                   "loras": str(loras), "lora_names": [f"bench_r{args.rank}_{i}.safetensors" for i in range(4)],
                   "pack": str(Path(args.pack or REPO).resolve()), "tmp": str(tmp), "steps": args.steps, "cfg": args.cfg,
                   "rounds": args.rounds, "threads": args.threads, "latent": [lw, lh], "text_tokens": args.text_tokens,
                   "strength": args.strength}
            res = run_worker(python, comfy_dir, cfg)
            res["rel_err"] = statistics.mean(v["rel_err"] for v in info["layers"].values())
            results.append(res)
    v = results[0]["versions"] if results else {}
    print()
    print(f"# ComfyUI {report.get('version', '?')} ({comfy_dir}), torch {v.get('torch')}, comfy-kitchen "
          f"{v.get('comfy_kitchen')}, {v.get('threads')} threads, {v.get('cpu')}")
    print(f"# Wan 2.1 T2V random weights, dim {dim}, ffn {ffn}, {dim // 128} heads, {args.blocks} blocks, every "
          f"block linear quantized; latent {lw}x{lh} px x 1 frame = {tokens} tokens, {args.text_tokens} text tokens; "
          f"rank-{args.rank} kohya LoRAs on all {len(linears)} block linears, strength {args.strength}; euler/simple, "
          f"{args.steps} steps, cfg {args.cfg}, seed {SEED}; {args.rounds} interleaved rounds")
    for res in results:
        print(f"# {res['format']} ({res['layout']}): latent ours vs ComfyUI's LoRA: x1 "
              f"{100 * res['arms']['dyn1']['rel_vs_comfy']:.2f} %, x4 {100 * res['arms']['dyn4']['rel_vs_comfy']:.2f} % "
              f"(ComfyUI re-quantizes the merged weight, ours adds the update in {res['compute_dtype']})")
        print(f"# {res['format']} ({res['layout']}): mean relative quantization error {res['rel_err']:.4f}; "
              f"compute dtype {res['compute_dtype']}; auto chose: {res['auto_decision']}; "
              f"{res['load_before']} -> {res['load_after']}")
    print()
    print(table(results))
    print()
    for res in results:
        d = res["arms"]
        print(f"{res['format']}: s/step x base (CPU / wall): dynamic x1 {d['dyn1']['cpu']['ratio']:.3f} / "
              f"{d['dyn1']['wall']['ratio']:.3f} (target <= 1.15), dynamic x4 {d['dyn4']['cpu']['ratio']:.3f} / "
              f"{d['dyn4']['wall']['ratio']:.3f}, ComfyUI x1 {d['comfy1']['cpu']['ratio']:.3f} / "
              f"{d['comfy1']['wall']['ratio']:.3f}, ComfyUI x4 {d['comfy4']['cpu']['ratio']:.3f} / "
              f"{d['comfy4']['wall']['ratio']:.3f}, auto x1 {d['auto1']['cpu']['ratio']:.3f} / "
              f"{d['auto1']['wall']['ratio']:.3f}")
    print(f"# total {time.perf_counter() - t_start:.0f} s")


# ---------------------------------------------------------------------------
# worker side: runs under ComfyUI's python, cwd = the ComfyUI checkout
# ---------------------------------------------------------------------------
def start_worker(cfg: dict, extra_nodes: tuple[str, ...] = ()) -> dict:
    """A worker's start under ComfyUI's python (cwd = the checkout): CPU mode, ``cfg["threads"]``
    torch threads, the LoRAs folder (and ``cfg["folders"]``, kind -> folder) registered, the pack (``cfg["pack"]``) and each folder of
    `extra_nodes` (another custom node pack, e.g. ComfyUI-GGUF) imported with ComfyUI's
    ``nodes.load_custom_node``. Returns ComfyUI's NODE_CLASS_MAPPINGS."""
    comfy_dir = os.getcwd()
    sys.path.insert(0, comfy_dir)
    sys.path.insert(1, str(HERE))
    from comfy.cli_args import args as comfy_args
    comfy_args.cpu = True  # a CUDA torch build on a machine without a driver: CPU before model_management loads
    import asyncio

    import torch
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    import comfy.model_management  # noqa: F401
    import folder_paths
    import nodes
    import server  # noqa: F401  main.py imports it before any prompt runs; else the pack's first report
    #                (host.send_report imports it) would put ~1 s of aiohttp imports into a measured sampling

    folder_paths.add_model_folder_path("loras", cfg["loras"], is_default=True)
    for kind, folder in (cfg.get("folders") or {}).items():  # before the packs load (ComfyUI-GGUF reads them)
        folder_paths.add_model_folder_path(kind, folder, is_default=True)
    custom = Path(cfg["tmp"]) / "custom_nodes"
    custom.mkdir(exist_ok=True)
    link = custom / "comfyui-lora-runtime"
    if not link.exists():
        link.symlink_to(cfg["pack"], target_is_directory=True)
    for folder in (link, *extra_nodes):
        if not asyncio.run(nodes.load_custom_node(str(folder))):
            raise SystemExit(f"{folder} did not load as a custom node")
    N = nodes.NODE_CLASS_MAPPINGS
    for need in ("LoraRuntimeLoadAdapter", "LoraRuntimeMergeMode", "LoraRuntimeReport", "LoraLoaderModelOnly"):
        assert need in N, need
    return N


class TimedSampler:
    """``comfy.sample.sample`` (what KSampler calls: euler / simple, seed 42, ``cfg["cfg"]``,
    ``cfg["steps"]`` steps) of one-frame latent ``cfg["latent"]`` px with a fixed random text
    context of ``cfg["text_tokens"]`` tokens, timed: the callback KSampler passes marks the end of
    each step's model call; a forward pre-hook on `dm` (the diffusion model every MODEL shares)
    marks the start of each model call. ``sample(model)`` -> (latent, record): ``walls`` / ``cpus``
    the intervals between consecutive callbacks (wall / process CPU seconds: step 2 on, nothing
    but the model calls and the sampler's update), ``setup`` / ``setup_cpu`` the rest of the
    sampling (before the first model call and after the last callback: the host's load and
    patch, our apply / resume, cleanup), ``total`` the whole sampling (wall)."""

    def __init__(self, base, dm, cfg: dict):
        import comfy.sample
        import torch
        self.sample_fn = comfy.sample.sample
        lw, lh = cfg["latent"]
        latent = torch.zeros([1, 16, 1, lh // 8, lw // 8])  # EmptyHunyuanLatentVideo(lw, lh, length 1)
        self.latent = comfy.sample.fix_empty_latent_channels(base, latent)
        self.noise = comfy.sample.prepare_noise(self.latent, SEED)
        g = torch.Generator().manual_seed(1)
        self.positive = [[torch.randn(1, cfg["text_tokens"], TEXT_DIM, generator=g), {}]]
        self.negative = [[torch.zeros(1, cfg["text_tokens"], TEXT_DIM), {}]]
        self.steps, self.cfg = cfg["steps"], cfg["cfg"]
        self.calls = []  # (wall, process CPU) at the start of each model call
        dm.register_forward_pre_hook(lambda mod, inp: self.calls.append((time.perf_counter(), time.process_time())))

    def sample(self, model, name: str = ""):
        marks = []  # (wall, process CPU) at each step's callback: the end of that step's model call
        self.calls.clear()

        def cb(step, x0, x, total):
            marks.append((time.perf_counter(), time.process_time()))

        t0, c0 = time.perf_counter(), time.process_time()
        out = self.sample_fn(model, self.noise, self.steps, self.cfg, "euler", "simple", self.positive,
                             self.negative, self.latent, denoise=1.0, callback=cb, disable_pbar=True, seed=SEED)
        t1, c1 = time.perf_counter(), time.process_time()
        assert len(marks) == self.steps and len(self.calls) >= self.steps, (name, len(marks), len(self.calls))
        calls = self.calls
        return out, {"walls": [b[0] - a[0] for a, b in zip(marks, marks[1:])],
                     "cpus": [b[1] - a[1] for a, b in zip(marks, marks[1:])], "total": t1 - t0,
                     "setup": (calls[0][0] - t0) + (t1 - marks[-1][0]),
                     "setup_cpu": (calls[0][1] - c0) + (c1 - marks[-1][1])}


def worker(cfg: dict) -> None:
    N = start_worker(cfg)
    import comfy.sd
    import torch
    from _timing import interleaved_rounds, load_string

    load_before = load_string()
    t0 = time.perf_counter()
    base = comfy.sd.load_diffusion_model(cfg["model"])
    log(f"{cfg['format']}: load_diffusion_model {time.perf_counter() - t0:.1f} s "
        f"({type(base.model).__name__}, dtype {base.model.get_dtype()}, manual_cast {base.model.manual_cast_dtype})")
    strength, names = cfg["strength"], cfg["lora_names"]

    comfy_lora, ours = lora_chains(N, base, names, strength)
    models = {"base": base, "comfy1": comfy_lora(1), "comfy4": comfy_lora(4), "dyn1": ours(1, "dynamic"),
              "dyn4": ours(4, "dynamic"), "auto1": ours(1, "auto")}

    records = {n: [] for n in models}   # per sampling: (total s, per-step s, setup s)
    outputs = {n: [] for n in models}
    timed = TimedSampler(base, base.model.diffusion_model, cfg)

    def sample(name):
        out, r = timed.sample(models[name], name)
        # setup: before the first model call starts and after the last step's callback (load, patch, attach /
        # merge, restore, ComfyUI's cleanup)
        records[name].append({"wall": statistics.mean(r["walls"]), "cpu": statistics.mean(r["cpus"]),
                              "cpu_best": min(r["cpus"]), "total": r["total"], "setup": r["setup"],
                              "setup_cpu": r["setup_cpu"]})
        outputs[name].append(out)
        return out

    first = {}
    reports = {}
    for n in models:  # the first sampling of each arm: load / patch / attach included
        sample(n)
        first[n] = r = records[n].pop()
        log(f"{cfg['format']}: first sampling {n}: {r['total']:.1f} s ({r['wall']:.2f} s/step wall, "
            f"{r['cpu']:.2f} CPU; setup {r['setup']:.2f} s)")
        if n in ("dyn1", "dyn4", "auto1"):
            reports[n] = N["LoraRuntimeReport"]().show(models[n], {"samples": outputs[n][-1]})["ui"]["lora_report"][0]

    def progress(m):
        last = {n: records[n][-1] for n in models if records[n]}
        log(f"{cfg['format']}: {m.split(':')[0]}: s/step wall / CPU " +
            ", ".join(f"{n} {r['wall']:.2f}/{r['cpu']:.2f}" for n, r in last.items()))

    # whole-sampling times (what interleaved_rounds returns) hold the re-patches; the step times are in records
    interleaved_rounds({n: (lambda n=n: sample(n)) for n in models}, "cpu", refs=("base",), warmup=0,
                       repeats=cfg["rounds"], progress=progress)
    # the same arm sampled twice in a row: ComfyUI keeps its patched weights loaded (no re-patch), ours its kept
    # adapters (docs/lifecycle.md)
    again = {}
    for n in ("comfy1", "comfy4", "auto1"):
        sample(n)
        sample(n)
        again[n] = records[n].pop()["setup"]
        records[n].pop()
        log(f"{cfg['format']}: {n} sampled twice in a row: setup of the second {again[n]:.2f} s")
    ref = outputs["base"][0]
    res = {"format": cfg["format"], "layout": cfg["layout"], "arms": {}, "load_before": load_before}
    for n in models:
        rec, bas = records[n], records["base"]
        for o in outputs[n][1:]:
            assert torch.equal(o, outputs[n][0]), f"{n}: a later sampling gave a different latent"
        rel = float((outputs[n][0] - ref).norm() / ref.norm())
        if n != "base":
            assert rel > 1e-3, f"{n}: the latent equals the base's (rel diff {rel:.2e}): adapter not applied"
        arm = {"rel_diff": rel, "setup_first_s": first[n]["setup"], "setup_first_cpu_s": first[n]["setup_cpu"],
               "first_total_s": first[n]["total"]}
        for key in ("wall", "cpu"):
            ratios = [r[key] / b[key] for r, b in zip(rec, bas)]
            arm[key] = {"step_s": statistics.median(r[key] for r in rec), "ratio": statistics.median(ratios),
                        "min": min(ratios), "max": max(ratios), "rounds": ratios}
        arm["cpu"]["best_ratio"] = min(r["cpu_best"] for r in rec) / min(b["cpu_best"] for b in bas)
        totals = [r["total"] / b["total"] for r, b in zip(rec, bas)]
        arm.update(setup_s=statistics.median(r["setup"] for r in rec), total_s=statistics.median(r["total"] for r in rec),
                   total_ratio=statistics.median(totals))
        arm["setup_again_s"] = again.get(n)
        res["arms"][n] = arm
    for ours_arm, theirs in (("dyn1", "comfy1"), ("dyn4", "comfy4")):
        o, t = outputs[ours_arm][0], outputs[theirs][0]
        res["arms"][ours_arm]["rel_vs_comfy"] = float((o - t).norm() / t.norm())
    dec = reports["auto1"].get("decision") or {}
    res["auto_decision"] = _decision_text(dec)
    res["reports"] = {n: {"decision": _decision_text(r.get("decision") or {}), "patch_seconds": r.get("patch_seconds")}
                      for n, r in reports.items()}
    res["compute_dtype"] = str(base.model.manual_cast_dtype or base.model.get_dtype()).replace("torch.", "")
    try:
        from importlib.metadata import version
        ck = version("comfy-kitchen")
    except Exception:
        ck = "?"
    import platform
    res["versions"] = {"torch": torch.__version__, "comfy_kitchen": ck, "threads": torch.get_num_threads(),
                       "cpu": platform.processor() or platform.machine()}
    res["load_after"] = load_string()
    print(json.dumps(res), flush=True)


def _decision_text(dec: dict) -> str:
    """What the report's decision says, per adapter: chosen mode and the share of the update a merge
    would round away."""
    if not dec:
        return "-"
    parts = []
    for a in dec.get("adapters") or []:
        lost = a.get("share_lost")
        parts.append(f"{a.get('chosen', '?')}" + (f" ({100 * lost:.0f} % of the update rounded away by a merge)"
                                                   if isinstance(lost, (int, float)) else ""))
    return "; ".join(parts) or str(dec)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfyui", default=None, help="the ComfyUI checkout (default: $COMFYUI_DIR)")
    ap.add_argument("--comfyui-python", default=os.environ.get("COMFYUI_PYTHON"),
                    help="ComfyUI's python (default: DIR/../comfyui-venv/bin/python, else this python)")
    ap.add_argument("--formats", default=",".join(FORMATS), help="ComfyUI QUANT_ALGOS names")
    ap.add_argument("--dims", default="1536,8960", help="dim,ffn (Wan 2.1 1.3B: 1536,8960)")
    ap.add_argument("--blocks", type=int, default=1, help="transformer blocks (Wan 1.3B has 30)")
    ap.add_argument("--latent", default="512x512",
                    help="image size WxH of the one-frame latent: 512x512 = 1024 tokens, 832x480 = 1560")
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--up-scale", type=float, default=0.5, help="LoRA update size (testkit: 0.5 = half the weight's)")
    ap.add_argument("--strength", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cfg", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds after each arm's first sampling")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads in the worker (1: its CPU seconds are robust to other processes; 0: torch's "
                         "default)")
    ap.add_argument("--pack", default=None, help="the pack folder ComfyUI imports (default: this checkout; e.g. a "
                    "`git archive` export of a commit, so that uncommitted edits are not measured)")
    ap.add_argument("--workdir", default=None, help="write (and on a later run reuse) the model / LoRA / quantized "
                    "files here instead of a temp dir")
    ap.add_argument("--smoke", action="store_true", help="tiny dims (128/512, 16 tokens, rank 4), 1 round")
    launcher(ap.parse_args())


if __name__ == "__main__":
    main()
