"""Our adapters vs ComfyUI's own LoRA in real ComfyUI 0.33 with dynamic VRAM on, on a GPU; or the same
plan on the CPU with stand-ins (``--dry-run``, for CI).

    python bench/comfy_dynamic/device_run.py --carry bench/.carry/comfy_dynamic --out DIR      # on the GPU
    python bench/comfy_dynamic/device_run.py --dry-run --out DIR                                # CPU, no ComfyUI

On the GPU (``ComfyHost``): the carried ComfyUI 0.33 source and wheels (`build_carry.py`) are unpacked
and imported in this process; dynamic VRAM is switched on as ComfyUI's main.py does (comfy-aimdo
initialised for the device, ``CoreModelPatcher = ModelPatcherDynamic``, ``aimdo_enabled``). Per variant
(``bf16``, ``fp8`` = float8_e4m3fn and ``nvfp4`` QuantizedTensor block linears, quantized by ComfyUI's own
``QuantizedTensor.from_float``), a random-weight Wan 2.1 T2V model with Wan-1.3B dims (dim 1536, ffn 8960,
30 blocks, `testkit.random_wan`) is loaded through ComfyUI's ``UNETLoader``, and one rank-32 LoRA on every
block linear (`testkit.lora_assets.write_kohya_lora`) is applied by ComfyUI's ``LoraLoaderModelOnly`` and
by ours (``auto`` / ``merge`` / ``dynamic`` x ``lossless`` / ``exact``). Each arm samples ``--steps`` steps
(euler / simple, CFG 1: one model call per step, a fixed random text context, an 832x480x17 latent:
7800 tokens) and reports: the latent's PSNR against ComfyUI's LoRA and against the base (the wrong
answer), the report's decision and per-layer groups, a second run of the same graph (our adapters
applied again or not, its setup seconds, the same bits), peak VRAM (torch's allocator, and the device's
use read by ``mem_get_info`` after every step: comfy-aimdo's ranges are outside torch's allocator) and
seconds per step (the mean interval between the sampler's step callbacks). Then: the base again after
every adapter arm (a second prompt without the adapter: bit for bit the first), a run of ours in which,
after step 2, a second model is loaded through UNETLoader and run and ComfyUI's ``partially_unload``
frees half of ours (compared bit for bit with the undisturbed run), and the hash of the stored base
weights after everything against the hash after loading.

``--dry-run`` (``DryHost``): no ComfyUI, no network, CPU, the pack's test dependencies only. The same
plan and the same measurement code run on the bundled host (`standalone/host`) at tiny dims (dim 128,
ffn 256, 2 blocks, an 8x8x1 latent): its UNETLoader (quantized variants through comfy-kitchen, a test
dependency, skipped with the reason when it is missing), our nodes, a stand-in for ComfyUI's LoRA (our
merge, exact) and for the second model's partial unload (the bundled host's ``unload_all_models``); no
VRAM figures. It checks that the script runs end to end, and `build_carry.py --plan` checks the carry.
Outputs: DIR/comfy_dynamic.json and DIR/comfy_dynamic.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "tests"))            # testkit: the model and LoRA writers


def _ensure_package() -> None:
    """`comfyui_lora_runtime` importable (installed, or a link to this checkout on sys.path), not imported:
    the pack picks its host when it is first imported, so ComfyUI must be importable before that."""
    import importlib.util
    if importlib.util.find_spec("comfyui_lora_runtime") is None:
        link_dir = Path(tempfile.mkdtemp(prefix="lora_runtime_pkg_"))
        (link_dir / "comfyui_lora_runtime").symlink_to(REPO, target_is_directory=True)
        sys.path.insert(0, str(link_dir))


_ensure_package()
import torch  # noqa: E402

VARIANTS = ("bf16", "fp8", "nvfp4")
QUANT_FORMATS = {"fp8": "float8_e4m3fn", "nvfp4": "nvfp4"}
MODES, TIERS = ("auto", "merge", "dynamic"), ("lossless", "exact")
GPU_DIMS = dict(dim=1536, ffn=8960, blocks=30, latent=(1, 16, 5, 60, 104), text_tokens=512, steps=4)
DRY_DIMS = dict(dim=128, ffn=256, blocks=2, latent=(1, 16, 1, 8, 8), text_tokens=7, steps=3)
RANK, SEED = 32, 42
MIDRUN_STEP = 2


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def psnr(a: torch.Tensor, ref: torch.Tensor) -> float:
    """dB against `ref`, peak = its value range; inf when equal."""
    a, ref = a.double().cpu(), ref.double().cpu()
    mse = float(((a - ref) ** 2).mean())
    if mse == 0.0:
        return math.inf
    peak = float(ref.max() - ref.min())
    return 10.0 * math.log10(peak * peak / mse)


def checksums(tensors: dict) -> dict:
    """Per stored tensor: (sum, position-weighted sum) of its bytes as integers, on the GPU when there is
    one: cheap enough to take after every arm, and a change to any weight shows in it."""
    from comfyui_lora_runtime.lora_runtime.layer.base_weight import quant_layout, stored_tensors
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for k in sorted(tensors):
        t = tensors[k]
        sums = []
        for part in (stored_tensors(t) if quant_layout(t) is not None else [t]):
            b = part.detach().contiguous().reshape(-1).view(torch.uint8).to(dev).to(torch.int64)
            w = torch.arange(b.numel(), device=dev, dtype=torch.int64) % 65521
            sums += [int(b.sum()), int((b * w).sum())]
        out[k] = tuple(sums)
    return out


def changed(before: dict, after: dict) -> list:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def tensor_hash(tensors: dict) -> str:
    """blake2b over every tensor's bytes (a quantized one: its stored data and scales), in key order."""
    from comfyui_lora_runtime.lora_runtime.layer.base_weight import quant_layout, stored_tensors
    h = hashlib.blake2b(digest_size=16)
    for k in sorted(tensors):
        t = tensors[k]
        parts = stored_tensors(t) if quant_layout(t) is not None else [t]
        h.update(k.encode())
        for p in parts:
            p = p.detach().contiguous().cpu().reshape(-1)
            h.update(p.view(torch.uint8).numpy().tobytes() if p.numel() else b"")
    return h.hexdigest()


def block_linears(dims) -> list[tuple[str, int, int]]:
    from testkit.random_wan import block_linears as bl
    return bl(dims["dim"], dims["ffn"], dims["blocks"])


def write_assets(work: Path, dims, variants, quantize) -> dict:
    """The bf16 model, its quantized variants (`quantize(src, dst, fmt, layers)`) and the LoRA."""
    from testkit.lora_assets import write_kohya_lora
    from testkit.random_wan import write_random_wan
    models, loras = work / "diffusion_models", work / "loras"
    models.mkdir(parents=True, exist_ok=True)
    loras.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    write_random_wan(models / "wan_bf16.safetensors", dims["dim"], dims["ffn"], dims["blocks"])
    out = {"bf16": "wan_bf16.safetensors"}
    layers = [n for n, _, _ in block_linears(dims)]
    for v in variants:
        if v in QUANT_FORMATS:
            try:
                why = quantize(models / "wan_bf16.safetensors", models / f"wan_{v}.safetensors", QUANT_FORMATS[v],
                               layers)
            except Exception as e:  # noqa: BLE001  (that variant is reported skipped with the reason)
                why = f"skipped: quantizing to {QUANT_FORMATS[v]} failed: {type(e).__name__}: {e}"
            out[v] = why or f"wan_{v}.safetensors"
    write_kohya_lora(loras / "lora_r32.safetensors", seed=7, rank=RANK, alpha=float(RANK),
                     modules=block_linears(dims))
    log(f"assets written in {time.perf_counter() - t0:.1f}s")
    return out


def quantize_with(quantized_tensor, layout_of):
    """A checkpoint quantizer: every named block linear's weight as ``quantized_tensor.from_float`` of
    its fp32 value in the format's layout (per-tensor scales recalculated), stored as ComfyUI 0.33 reads
    it (`quant_formats.quantized_weight_entries`: the data, its scales, ``comfy_quant``)."""
    from safetensors.torch import load_file, save_file

    from comfyui_lora_runtime.standalone.host.quant_formats import quantized_weight_entries

    def quantize(src, dst, fmt, layers):
        sd = load_file(str(src))
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        # comfy-kitchen's CUDA nvfp4 quantizer takes fp16/bf16 only; fp8 from the fp32 value
        src_dtype = torch.float32 if fmt.startswith("float8") else torch.bfloat16
        for n in layers:
            w = sd.pop(f"{n}.weight").to(dev, src_dtype)
            kw = {"scale": "recalculate"} if fmt.startswith("float8") else {}
            qt = quantized_tensor.from_float(w, layout_of(fmt), **kw)
            sd.update({k: v.cpu() for k, v in quantized_weight_entries(f"{n}.", qt, fmt).items()})
        save_file({k: v.contiguous() for k, v in sd.items()}, str(dst), metadata={"format": fmt})
        return ""
    return quantize


# ------------------------------------------------------------------------------------ hosts

class HostBase:
    """What the plan needs of a host; the measurement code is the same for both."""

    dry = False
    stored_stay_put = False   # checksum the stored base weights after every arm
    steps_seconds: list

    def ours(self, model, lora: str, mode: str, tier: str):
        import comfyui_lora_runtime as pack
        m = pack.NODE_CLASS_MAPPINGS["LoraRuntimeLoadAdapter"]().load(model, lora, 1.0)["result"][0]
        m = pack.NODE_CLASS_MAPPINGS["LoraRuntimeMergeMode"]().set_mode(m, mode)[0]
        return pack.NODE_CLASS_MAPPINGS["LoraRuntimeQualityTier"]().set_tier(m, tier)[0]

    def report(self, model) -> dict:
        from comfyui_lora_runtime.nodes import lifecycle
        r = lifecycle.last_report(model) or {}
        dec = r.get("decision") or {}
        return {"chosen": dec.get("chosen"), "kept": bool(r.get("adapters_kept")),
                "layers": {g["what"]: g["layers"] for g in r.get("layers") or []},
                "patch_seconds": r.get("patch_seconds"), "ran_check": len(r.get("ran_check") or [])}

    def cond(self, dims):
        g = torch.Generator().manual_seed(5)
        c = torch.randn(1, dims["text_tokens"], 4096, generator=g)
        return [[c, {}]], [[torch.zeros_like(c), {}]]


class DryHost(HostBase):
    """The bundled host at tiny dims on the CPU (see module doc)."""

    dry = True

    def __init__(self, work: Path):
        from comfyui_lora_runtime.standalone.host import folder_paths
        self.work = work
        self._folders = folder_paths.ModelFolders(work)
        self._ctx = folder_paths.activated(self._folders)
        self._ctx.__enter__()

    def quantizer(self):
        from comfyui_lora_runtime.standalone.host import quant_formats
        try:
            quant_formats.require_comfy_kitchen("the dry run's quantized variants")
        except ImportError as e:
            return lambda *a: f"skipped: {e}"
        from comfy_kitchen.tensor import QuantizedTensor
        return quantize_with(QuantizedTensor, lambda fmt: quant_formats.FORMATS[fmt][0])

    def load(self, name: str):
        from comfyui_lora_runtime.standalone.host.core_nodes import UNETLoader
        return UNETLoader().load_unet(name, "default")[0]

    def comfy_lora(self, model, lora: str):
        return self.ours(model, lora, "merge", "exact")   # stand-in: ComfyUI's merge, here ours

    def sample(self, model, dims, hook=None):
        from comfyui_lora_runtime.standalone.host import progress
        from comfyui_lora_runtime.standalone.host.core_nodes import KSampler
        pos, neg = self.cond(dims)
        stamps = []

        def h(value, total, preview=None, node_id=None):
            stamps.append(time.perf_counter())
            if hook is not None:
                hook(value)
        with progress.progress_hook(h):
            out = KSampler().sample(model, SEED, dims["steps"], 1.0, "euler", "simple", pos, neg,
                                    {"samples": torch.zeros(dims["latent"])})[0]
        return out["samples"], stamps

    def stored(self, model) -> dict:
        return model.model.diffusion_model.state_dict()

    def unload_all(self):
        from comfyui_lora_runtime.standalone.host import model_management
        model_management.unload_all_models()

    def partial_unload(self, model) -> dict:
        self.unload_all()   # stand-in: the bundled host has no partial unload
        return {"freed_bytes": None, "stand_in": "unload_all_models"}

    def memory(self):
        return None

    def reset_memory(self):
        pass


class ComfyHost(HostBase):
    """Real ComfyUI 0.33 in this process, dynamic VRAM on (see module doc)."""

    def __init__(self, comfy_dir: Path, site: Path | None, work: Path, dynamic: bool = True):
        if site is not None:
            sys.path.insert(0, str(site))
        sys.path.insert(0, str(comfy_dir))
        import comfy.cli_args  # noqa: F401  (its defaults: this process parses no ComfyUI arguments)
        from comfy.cli_args import args
        if not torch.cuda.is_available():
            args.cpu = True
        # as ComfyUI's main.py: comfy-aimdo's library is loaded before any comfy module binds it
        self.dynamic = self._load_aimdo(args) if dynamic else "off: not asked for (--static)"
        import comfy.memory_management
        import comfy.model_management as mm
        import comfy.model_patcher as mp
        if self.dynamic == "on":
            self.dynamic = self._switch_on_dynamic_vram(args, mm, mp)
        self.stored_stay_put = self.dynamic == "on"
        import folder_paths
        folder_paths.add_model_folder_path("diffusion_models", str(work / "diffusion_models"), is_default=True)
        folder_paths.add_model_folder_path("loras", str(work / "loras"), is_default=True)
        self.mm, self.mp = mm, mp
        self._device_peak = 0
        import comfyui_version
        self.version = comfyui_version.__version__

    @staticmethod
    def _load_aimdo(args) -> str:
        try:
            import comfy_aimdo.control
            headroom = None if args.reserve_vram is None else int(args.reserve_vram * 1024 ** 3)
            comfy_aimdo.control.init(simple_vram_headroom=headroom, nvml_pressure=not args.disable_nvml_pressure)
        except Exception as e:  # noqa: BLE001  (recorded in the results, never hidden)
            return f"off: comfy-aimdo failed to load: {type(e).__name__}: {e}"
        return "on" if comfy_aimdo.control.lib is not None else "off: comfy-aimdo's library did not load"

    @staticmethod
    def _switch_on_dynamic_vram(args, mm, mp) -> str:
        """As ComfyUI's main.py does; "on", or "off: <why>" when comfy-aimdo cannot run here (the run
        then goes on with the plain ModelPatcher, and every table says so)."""
        import comfy.memory_management
        import comfy_aimdo.control
        try:
            ok = comfy_aimdo.control.init_devices((d.index, int(args.vram_headroom * 1024 ** 3))
                                                  for d in mm.get_all_torch_devices())
        except Exception as e:  # noqa: BLE001  (recorded in the results, never hidden)
            return f"off: comfy-aimdo failed to start: {type(e).__name__}: {e}"
        if not ok:
            return "off: comfy-aimdo found no device"
        mp.CoreModelPatcher = mp.ModelPatcherDynamic
        comfy.memory_management.aimdo_enabled = True
        return "on"

    def quantizer(self):
        from comfy.quant_ops import QUANT_ALGOS, QuantizedTensor
        return quantize_with(QuantizedTensor, lambda fmt: QUANT_ALGOS[fmt]["comfy_tensor_layout"])

    def load(self, name: str):
        import nodes
        m = nodes.UNETLoader().load_unet(name, "default")[0]
        if m.is_dynamic() != (self.dynamic == "on"):
            raise RuntimeError(f"UNETLoader gave a {type(m).__name__} with dynamic VRAM {self.dynamic}")
        return m

    def comfy_lora(self, model, lora: str):
        import nodes
        return nodes.LoraLoaderModelOnly().load_lora_model_only(model, lora, 1.0)[0]

    def sample(self, model, dims, hook=None):
        import comfy.utils
        import nodes
        # every step's progress update reaches the hook (0.33 throttles them to one per 100 ms)
        for name in ("PROGRESS_THROTTLE_MIN_INTERVAL", "PROGRESS_THROTTLE_MIN_PERCENT"):
            if hasattr(comfy.utils, name):
                setattr(comfy.utils, name, 0)
        pos, neg = self.cond(dims)
        stamps = []

        def h(value, total, preview=None, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                free, total_mem = torch.cuda.mem_get_info()
                self._device_peak = max(self._device_peak, total_mem - free)
            stamps.append(time.perf_counter())
            if hook is not None:
                hook(value)
        comfy.utils.set_progress_bar_global_hook(h)
        try:
            out = nodes.common_ksampler(model, SEED, dims["steps"], 1.0, "euler", "simple", pos, neg,
                                        {"samples": torch.zeros(dims["latent"])})[0]
        finally:
            comfy.utils.set_progress_bar_global_hook(None)
        return out["samples"], stamps

    def stored(self, model) -> dict:
        return model.model.diffusion_model.state_dict()

    def unload_all(self):
        self.mm.unload_all_models()

    def partial_unload(self, model) -> dict:
        for lm in self.mm.current_loaded_models:
            if lm.model is model:
                before = model.loaded_size()
                lm.model_unload(memory_to_free=max(1, before // 2))
                return {"loaded_before": before, "loaded_after": model.loaded_size()}
        return {"error": "model not loaded"}

    def reset_memory(self):
        self._device_peak = 0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def memory(self):
        if not torch.cuda.is_available():
            return None
        return {"torch_peak_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 3),
                "device_peak_gib": round(self._device_peak / 2 ** 30, 3)}


# ------------------------------------------------------------------------------------- plan

def per_step(stamps: list) -> float | None:
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return round(sum(gaps) / len(gaps), 5) if gaps else None


def run_variant(host, name: str, model_file: str, dims, counts) -> dict:
    lora = "lora_r32.safetensors"
    rec: dict = {"variant": name, "model": model_file, "arms": {}}
    t0 = time.perf_counter()
    base = host.load(model_file)
    rec["load_seconds"] = round(time.perf_counter() - t0, 3)
    hash0 = tensor_hash(host.stored(base))
    sums0 = checksums(host.stored(base))
    stored_ref = {"sums": sums0}   # after the base arm: what ComfyUI's own run of the base leaves in the stored tensors
    rec["weights_changed_after"], rec["stored_checked_per_arm"] = {}, host.stored_stay_put

    def arm(label, model, hook=None):
        host.reset_memory()
        applies = counts["applies"]
        t = time.perf_counter()
        lat, stamps = host.sample(model, dims, hook)
        total = time.perf_counter() - t
        entry = {"seconds": round(total, 3), "per_step": per_step(stamps),
                 "setup": round(total - (stamps[-1] - stamps[0]) if stamps else total, 3),
                 "applies": counts["applies"] - applies, "memory": host.memory()}
        rec["arms"][label] = entry
        # with dynamic VRAM nothing may write the stored weights, not even while a patched model is loaded
        # (without it ComfyUI's and our merges patch them in place until the model is unloaded)
        now = checksums(host.stored(base)) if host.stored_stay_put else stored_ref["sums"]
        moved = changed(stored_ref["sums"], now)
        if label == "base":
            # the host alone, no adapter anywhere yet (on the GPU ComfyUI 0.33 rewrites the 31 modulation
            # parameters here): later arms are compared with this state, so only adapters' writes show
            rec["changed_by_the_host_alone"], stored_ref["sums"], moved = moved, now, []
        if moved:   # the stored base weights differ from their loaded bytes after this arm
            rec["weights_changed_after"][label] = {"count": len(moved), "first": moved[:5]}
        log(f"{name} {label}: {entry['per_step']} s/step, setup {entry['setup']} s, stored weights changed: {len(moved)}")
        return lat, entry

    lat_base, _ = arm("base", base)
    lat_b1, e = arm("base_twice", base)     # is the base itself deterministic here?
    e.update(same_bits=torch.equal(lat_b1, lat_base), vs_base_psnr=psnr(lat_b1, lat_base))
    comfy = host.comfy_lora(base, lora)
    lat_comfy, e = arm("comfy", comfy)
    lat_c2, e2 = arm("comfy_again", comfy)
    e.update(vs_base_psnr=psnr(lat_comfy, lat_base))
    e2.update(same_bits=torch.equal(lat_c2, lat_comfy), vs_comfy_psnr=psnr(lat_c2, lat_comfy))
    ours_lat = {}
    for mode in MODES:
        for tier in TIERS:
            m = host.ours(base, lora, mode, tier)
            lat, e = arm(f"ours_{mode}_{tier}", m)
            e.update(report=host.report(m), vs_comfy_psnr=psnr(lat, lat_comfy), vs_base_psnr=psnr(lat, lat_base))
            lat2, e2 = arm(f"ours_{mode}_{tier}_again", m)
            e2.update(report=host.report(m), same_bits=torch.equal(lat2, lat))
            ours_lat[(mode, tier)] = (m, lat)
    lat_b2, e = arm("base_again", base)
    e.update(same_bits=torch.equal(lat_b2, lat_base), vs_base_psnr=psnr(lat_b2, lat_base))
    # mid-run: a second model loaded and run, then half of ours freed (ComfyUI's partially_unload)
    m, ref = ours_lat[("dynamic", "lossless")]
    events = {}

    def midrun(step):
        if step != MIDRUN_STEP or events:
            return
        other = host.load(model_file)
        host.sample(other, dict(dims, steps=1))
        events["partial_unload"] = host.partial_unload(m)
    lat_mid, e = arm("ours_midrun", m, midrun)
    e.update(events=events, same_bits_as_undisturbed=torch.equal(lat_mid, ref),
             vs_undisturbed_psnr=psnr(lat_mid, ref))
    host.unload_all()
    rec["weights_hash_unchanged"] = tensor_hash(host.stored(base)) == hash0
    end = checksums(host.stored(base))
    rec["weights_changed_at_end"] = changed(sums0, end)[:10]
    rec["changed_at_end_beyond_the_host_alone"] = changed(stored_ref["sums"], end)[:10]
    return rec


def markdown(res: dict) -> str:
    lines = [f"# ComfyUI {res.get('comfyui', '?')} dynamic VRAM: ours vs ComfyUI's LoRA "
             f"({'dry run, CPU' if res['dry_run'] else res.get('device', 'GPU')})", ""]
    if "dynamic_vram" in res:
        lines += [f"Dynamic VRAM: {res['dynamic_vram']}. Dims: {res['dims']}, rank {res['rank']}.", ""]
    for v in res["variants"]:
        if "skipped" in v or "error" in v:
            lines += [f"## {v['variant']}: {v.get('skipped') or v.get('error')}", ""]
            continue
        lines += [f"## {v['variant']} (weights unchanged after everything: {v['weights_hash_unchanged']})", "",
                  "| arm | s/step | setup s | applies | same bits as before | vs ComfyUI's LoRA dB | vs base dB | "
                  "decision | layers | torch peak GiB | device peak GiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for label, a in v["arms"].items():
            rep = a.get("report") or {}
            mem = a.get("memory") or {}
            lay = "; ".join(f"{n} {k}" for k, n in (rep.get("layers") or {}).items())
            same = a.get("same_bits", a.get("same_bits_as_undisturbed", ""))
            lines.append(f"| {label} | {a['per_step']} | {a['setup']} | {a['applies']} | {same} | "
                         f"{_db(a.get('vs_comfy_psnr'))} | {_db(a.get('vs_base_psnr'))} | "
                         f"{rep.get('chosen', '')}{' (kept)' if rep.get('kept') else ''} | {lay} | "
                         f"{mem.get('torch_peak_gib', '')} | {mem.get('device_peak_gib', '')} |")
        lines.append("")
        moved = v.get("weights_changed_after") or {}
        if v.get("stored_checked_per_arm"):
            lines += [f"Stored base weights changed after: " + ("; ".join(
                f"{k} ({c['count']}: {', '.join(c['first'])})" for k, c in moved.items()) or "no arm"), ""]
            lines += [f"Stored tensors the base arm alone changed (no adapter yet: the host's own doing): "
                      f"{len(v.get('changed_by_the_host_alone') or [])} "
                      f"({', '.join((v.get('changed_by_the_host_alone') or [])[:5])})", ""]
        lines += [f"Stored base weights differing from their loaded bytes after the final unload: "
                  f"{', '.join(v.get('weights_changed_at_end') or []) or 'none'}; "
                  f"from their state after the base arm: "
                  f"{', '.join(v.get('changed_at_end_beyond_the_host_alone') or []) or 'none'}", ""]
    return "\n".join(lines) + "\n"


def _db(v):
    return "" if v is None else ("inf" if v == math.inf else f"{v:.1f}")


def unpack_carry(carry: Path, dest: Path) -> tuple[Path, Path, dict]:
    manifest = json.loads((carry / "manifest.json").read_text())
    want = tuple(manifest["python"])
    if sys.version_info[:2] != want:
        raise SystemExit(f"device_run: the carry was built for Python {want[0]}.{want[1]}, this is "
                         f"{sys.version_info[0]}.{sys.version_info[1]}: build it again with --python-version")
    for name in ("site.tar.xz", "comfyui.tar.xz"):
        with tarfile.open(carry / name) as tf:
            tf.extractall(dest / name.split(".")[0], filter="data")
    return dest / "comfyui", dest / "site", manifest


def install_counters() -> dict:
    from comfyui_lora_runtime.lora_runtime.apply import LoraInjector
    counts = {"applies": 0}
    real = LoraInjector.apply

    def apply(self, *a, **k):
        counts["applies"] += 1
        return real(self, *a, **k)
    LoraInjector.apply = apply
    return counts


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--carry", type=Path, default=REPO / "bench" / ".carry" / "comfy_dynamic")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--comfyui", type=Path, default=None,
                   help="a ComfyUI checkout whose requirements this python has (instead of the carry)")
    p.add_argument("--static", action="store_true", help="leave dynamic VRAM off (ComfyUI's plain ModelPatcher)")
    p.add_argument("--tiny", action="store_true", help="the dry run's tiny dims on real ComfyUI (a CPU smoke)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    dims = dict(DRY_DIMS if args.dry_run or args.tiny else GPU_DIMS)
    if args.steps:
        dims["steps"] = args.steps
    variants = [v for v in args.variants.split(",") if v]
    work = Path(tempfile.mkdtemp(prefix="comfy_dynamic_"))
    res: dict = {"dry_run": args.dry_run, "dims": {k: list(v) if isinstance(v, tuple) else v for k, v in dims.items()},
                 "rank": RANK, "variants": []}
    t0 = time.perf_counter()
    if args.dry_run:
        host = DryHost(work)
        res["comfyui"] = "none (bundled host)"
    else:
        if not torch.cuda.is_available() and not args.tiny:
            raise SystemExit("device_run: no CUDA device (use --dry-run, or --tiny --comfyui DIR, on a CPU)")
        if args.comfyui is not None:
            comfy_dir, site, manifest = args.comfyui.resolve(), None, {}
        else:
            comfy_dir, site, manifest = unpack_carry(args.carry, work)
        host = ComfyHost(comfy_dir, site, work, dynamic=not args.static)
        res.update(comfyui=host.version, dynamic_vram=host.dynamic, carry=manifest.get("files"),
                   device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
        log(f"ComfyUI {host.version}, dynamic VRAM {host.dynamic}")
    from comfyui_lora_runtime.nodes import host as pack_host
    res["pack_host"] = pack_host.NAME
    if pack_host.NAME != ("bundled" if args.dry_run else "comfyui"):
        raise SystemExit(f"device_run: the pack runs on the {pack_host.NAME} host")
    counts = install_counters()
    files = write_assets(work, dims, variants, host.quantizer())
    for v in variants:
        f = files.get(v, "")
        if not f.endswith(".safetensors"):
            res["variants"].append({"variant": v, "skipped": f or "not written"})
            continue
        try:
            res["variants"].append(run_variant(host, v, f, dims, counts))
        except Exception as e:  # a variant that breaks is reported; the next one still runs
            import traceback
            res["variants"].append({"variant": v, "error": f"{type(e).__name__}: {e}",
                                    "trace": traceback.format_exc()[-3000:]})
            host.unload_all()
        (args.out / "comfy_dynamic.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    res["seconds"] = round(time.perf_counter() - t0, 1)
    (args.out / "comfy_dynamic.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (args.out / "comfy_dynamic.md").write_text(markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
