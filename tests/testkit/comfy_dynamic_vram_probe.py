"""Run in ComfyUI 0.33's python: our adapters and ComfyUI's own LoRA under ComfyUI's dynamic VRAM
(``ModelPatcherDynamic``), on the CPU, one JSON line ``RESULT {...}`` per case.

    python comfy_dynamic_vram_probe.py <comfy_dir> <work_dir>

What is ComfyUI's own code here: ``ModelPatcherDynamic`` (its ``load`` with the patch lists, the
``LowVramPatch`` per patched weight, the virtual-VRAM ranges ``_v`` and the force-loaded small weights
with their backups; ``partially_unload``, ``partially_unload_ram``, ``unpatch_model``, ``detach``),
``comfy.model_management`` (``load_models_gpu``, ``free_memory``, ``LoadedModel.model_unload``),
``comfy.ops``' cast Linear / LayerNorm and its vbar cast path (``cast_modules_with_vbar``,
``resolve_cast_module_with_vbar``: fault, pins, the LoRA patch at the first cast and its write-back into
the resident copy, a streamed weight patched at every cast), ``comfy.pinned_memory``, ``comfy.lora``,
the LoRA loaders (``LoraLoaderModelOnly``, ``LoraLoaderBypassModelOnly``), ``common_ksampler``.

What is simulated (testkit.aimdo_standin; docs/dynamic_vram.md):

- comfy-aimdo's native parts: the virtual VRAM bar (ranges, faults with signatures, eviction), the host
  buffers and CUDA host registration, all on CPU memory;
- the device split: the load device is ``cpu:0`` (ComfyUI reads it as a CPU, so
  ``ModelPatcherDynamic.__new__``'s reroute to the plain ModelPatcher for CPU devices is switched off), and
  ``comfy.ops.cast_bias_weight`` sends every layer with a range down ComfyUI's vbar path, which on a GPU
  the weight's other device selects;
- memory pressure: ``set_capacity`` limits how much may be resident at once, and the cases call ComfyUI's
  own unload functions where a GPU running short would.

The model: ComfyUI's Wan 2.1 class at a tiny config with dim 128 / ffn 256 (so every attention and FFN
Linear is over the 16 KiB under which the dynamic loader force-loads a module; ``text_embedding.0`` is under
it), bf16, seeded. Sampling: seed 42, 3 steps, euler / simple, CFG 3.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback

import torch

comfy_dir, work = sys.argv[1], sys.argv[2]
sys.path.insert(0, comfy_dir)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/: testkit

import comfy.cli_args  # noqa: E402

comfy.cli_args.args.cpu = True
try:
    import comfy_aimdo.model_vbar  # noqa: F401  (ComfyUI 0.33 requires comfy-aimdo; 0.3.64 has no dynamic VRAM)
except ImportError:
    import comfyui_version
    print("RESULT " + json.dumps({"host": "comfyui", "comfyui": getattr(comfyui_version, "__version__", "?"),
                                  "dynamic": False}), flush=True)
    sys.exit(0)
from testkit import aimdo_standin as S  # noqa: E402

S.install()
import comfy.model_management as mm  # noqa: E402

mm.MAX_PINNED_MEMORY = 1 << 30   # pins on (the stand-in registers nothing); 0.33 leaves it at -1 on a CPU
import comfy.model_patcher as mp  # noqa: E402
import comfy.ops  # noqa: E402
import comfy.utils  # noqa: E402
import folder_paths  # noqa: E402
import nodes as comfy_nodes  # noqa: E402
from comfy_extras.nodes_lora_debug import LoraLoaderBypassModelOnly  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import comfyui_lora_runtime as pack  # noqa: E402
from comfyui_lora_runtime.lora_runtime import AdapterSpec, applied, plan, resident  # noqa: E402
from comfyui_lora_runtime.lora_runtime.apply import LoraInjector  # noqa: E402
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter  # noqa: E402
from comfyui_lora_runtime.lora_runtime.layer.base_weight import base_weight  # noqa: E402
from comfyui_lora_runtime.lora_runtime.layer.wrapper import AdaptedLayer, runtime_leftovers  # noqa: E402
from comfyui_lora_runtime.lora_runtime.param_patch import ParamPatch  # noqa: E402
from comfyui_lora_runtime.lora_runtime.files.param_deltas import ParamDelta  # noqa: E402
from comfyui_lora_runtime.nodes import host, lifecycle  # noqa: E402
from testkit import comfy_tiny_models as T  # noqa: E402

KIND = "WAN21_T2V"
T.TINY[KIND] = dataclasses.replace(T.TINY[KIND], config={**T.TINY[KIND].config, "dim": 128, "ffn_dim": 256})
CPU, DEV = torch.device("cpu"), torch.device("cpu", 0)
mp.ModelPatcherDynamic.__new__ = lambda cls, *a, **k: object.__new__(cls)   # no reroute: see module doc
S.route_vbar_casts(DEV)
SAMPLING = {"seed": 42, "steps": 3, "cfg": 3.0, "sampler_name": "euler", "scheduler": "simple"}
OURS, THEIRS = "ours.safetensors", "comfy_blocks0.safetensors"

loras = os.path.join(work, "loras")
os.makedirs(loras, exist_ok=True)
folder_paths.add_model_folder_path("loras", loras, is_default=True)

COUNTS = {"dynamic_loads": 0, "applies": 0}
_real_load, _real_apply = mp.ModelPatcherDynamic.load, LoraInjector.apply


def _counted_load(self, *a, **k):
    COUNTS["dynamic_loads"] += 1
    return _real_load(self, *a, **k)


def _counted_apply(self, *a, **k):
    COUNTS["applies"] += 1
    return _real_apply(self, *a, **k)


mp.ModelPatcherDynamic.load = _counted_load
LoraInjector.apply = _counted_apply


def out(record: dict) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def build(dynamic: bool = True, dtype=torch.bfloat16):
    base, plain = T.build(KIND, dtype)
    if not dynamic:
        return plain
    return mp.ModelPatcherDynamic(base, load_device=DEV, offload_device=CPU)


def linears(dm, keep):
    return [n for n, m in dm.named_modules() if isinstance(m, torch.nn.Linear) and keep(n)]


def write_lora(dm, name: str, layers, seed: int, rank: int = 8, scale: float = 0.1) -> None:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for n in layers:
        o, i = dm.get_submodule(n).weight.shape
        sd[f"diffusion_model.{n}.lora_down.weight"] = torch.randn(rank, i, generator=g) * scale
        sd[f"diffusion_model.{n}.lora_up.weight"] = torch.randn(o, rank, generator=g) * scale
        sd[f"diffusion_model.{n}.alpha"] = torch.tensor(rank / 2.0)
    save_file(sd, os.path.join(loras, name))


def sample(model, hook=None, seed=None) -> torch.Tensor:
    positive, negative = T.conditioning(KIND)
    s = SAMPLING
    comfy.utils.set_progress_bar_global_hook(hook)
    try:
        res = comfy_nodes.common_ksampler(model, s["seed"] if seed is None else seed, s["steps"], s["cfg"],
                                          s["sampler_name"], s["scheduler"], positive, negative,
                                          {"samples": T.latent(KIND)})
    finally:
        comfy.utils.set_progress_bar_global_hook(None)
    return T.flat(res[0]["samples"])


def ours(patcher, mode: str, tier: str = "exact"):
    m = pack.NODE_CLASS_MAPPINGS["LoraRuntimeLoadAdapter"]().load(patcher, OURS, 1.0)["result"][0]
    m = pack.NODE_CLASS_MAPPINGS["LoraRuntimeMergeMode"]().set_mode(m, mode)[0]
    return pack.NODE_CLASS_MAPPINGS["LoraRuntimeQualityTier"]().set_tier(m, tier)[0]


def comfy_lora(patcher, name=THEIRS):
    return comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(patcher, name, 1.0)[0]


def bypass(patcher, name=OURS):
    return LoraLoaderBypassModelOnly().load_lora(patcher, None, name, 1.0, 0.0)[0]


def weights(patcher) -> dict:
    return {k: v.detach().clone() for k, v in patcher.model.diffusion_model.state_dict().items()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def cmp(a: torch.Tensor, b: torch.Tensor):
    return "bitwise" if torch.equal(a, b) else rel(a, b)


def summary(report: dict) -> dict:
    dec = report.get("decision") or {}
    return {"chosen": dec.get("chosen"), "adapters_kept": bool(report.get("adapters_kept")),
            "layers": {g["what"]: g["layers"] for g in report.get("layers") or []},
            "host_patched": (report.get("host_patched") or {}).get("layers", 0),
            "ran_check": report.get("ran_check") or []}


def staged_state(patcher) -> dict:
    dm = patcher.model.diffusion_model
    mods = [m for m in dm.modules() if hasattr(m, "comfy_cast_weights")]
    return {"with_range": sum(hasattr(m, "_v") for m in mods),
            "lowvram_patches": sum(getattr(m, "weight_lowvram_function", None) is not None for m in mods),
            "backups": len(patcher.backup)}


def loaded(model):
    for lm in mm.current_loaded_models:
        if lm.model is model:
            return lm
    raise LookupError("model not loaded")


def unload_all() -> None:
    """ComfyUI's unload_all_models for the load device used here (it frees ``get_torch_device()``, which
    is the CPU with --cpu, not the ``cpu:0`` these models load to)."""
    mm.free_memory(1e30, DEV)
    mm.unload_all_models()


def at_step(k: int, action):
    def hook(value, total, preview=None, *a, **kw):
        if value == k:
            action()
    return hook


# ------------------------------------------------------------------------------------------- cases

def case_setup(fresh: dict) -> dict:
    """No adapter: the dynamic patcher's output is the plain patcher's, bit for bit; what it staged."""
    plain = sample(build(dynamic=False))
    p = build()
    S.reset()
    y = sample(p)
    rec = {"case": "setup", "dynamic_vs_plain": cmp(y, plain), "staged": staged_state(p),
           "is_dynamic": p.is_dynamic(), "vbar_casts": S.STATS.get("vbar_casts", 0),
           "faults": S.STATS["faults"], "resident_hits": S.STATS["resident_hits"]}
    unload_all()
    rec["weights_fresh"] = same_weights(weights(p), fresh)
    return rec, y


def case_comfy_only(fresh: dict, base_out):
    p = build()
    c = comfy_lora(p)
    y = sample(c)
    rec = {"case": "comfy_only", "staged": staged_state(c), "vs_base_rel": rel(y, base_out)}
    unload_all()
    rec["weights_fresh"] = same_weights(weights(p), fresh)
    return rec, y


def case_ours(fresh, base_out, mode, tier, refs) -> dict:
    p = build()
    m = ours(p, mode, tier)
    y = sample(m)
    rep = lifecycle.last_report(m)
    rec = {"case": "ours", "mode": mode, "tier": tier, "report": summary(rep), "vs_base_rel": rel(y, base_out),
           "weights_untouched": same_weights(weights(p), fresh)}
    if tier == "exact":
        rec["vs_comfy_bypass"] = cmp(y, refs["bypass"])
        rec["vs_plain_patcher"] = cmp(y, refs["plain_dynamic"])
    else:
        rec["vs_exact_rel"] = rel(y, refs["bypass"])
    rec["bare_after_vs_base"] = cmp(sample(p), base_out)   # a second prompt without the adapter
    rec["kept_after_bare"] = resident.kept(p.model.diffusion_model) is not None
    unload_all()
    rec["leftovers"] = runtime_leftovers(p.model.diffusion_model)
    rec["weights_fresh"] = same_weights(weights(p), fresh)
    return rec


def case_both(fresh, mode, refs) -> dict:
    """ComfyUI's LoRA on blocks.0 and ours on every block layer (so on the same weights in blocks.0)."""
    p = build()
    c = comfy_lora(p)
    m = ours(c, mode)
    loads0, applies0 = COUNTS["dynamic_loads"], COUNTS["applies"]
    y = sample(m)
    rep = lifecycle.last_report(m)
    loads1, applies1 = COUNTS["dynamic_loads"], COUNTS["applies"]
    y2 = sample(m)                                   # the same graph again
    rep2 = lifecycle.last_report(m)
    rec = {"case": "both", "mode": mode, "report": summary(rep), "report_rerun": summary(rep2),
           "vs_reference": cmp(y, refs["both"]), "vs_comfy_only_rel": rel(y, refs["comfy_only"]),
           "vs_ours_only_rel": rel(y, refs["bypass"]), "rerun_vs_first": cmp(y2, y),
           "loads": [loads1 - loads0, COUNTS["dynamic_loads"] - loads1],
           "applies": [applies1 - applies0, COUNTS["applies"] - applies1],
           "weights_untouched": same_weights(weights(p), fresh)}
    y3 = sample(c)                                   # a second prompt: ComfyUI's LoRA alone on the same weights
    rec["without_ours_vs_comfy_only"] = cmp(y3, refs["comfy_only"])
    rec["kept_after_other"] = resident.kept(p.model.diffusion_model) is not None
    rec["leftovers_after_other"] = runtime_leftovers(p.model.diffusion_model)
    unload_all()
    rec["weights_fresh"] = same_weights(weights(p), fresh)
    return rec


def case_midrun(fresh, event: str, refs) -> dict:
    """ComfyUI's LoRA + ours (dynamic, exact) with something of ComfyUI's happening after the first step."""
    p = build()
    m = ours(comfy_lora(p), "dynamic")
    holder = {}
    other = build() if event == "second_model" else None

    def act():
        before = dict(S.STATS)
        if event == "partial_unload":      # what free_memory asks of a loaded model when it needs some VRAM
            lm = loaded(m)
            holder["freed"] = lm.model_unload(memory_to_free=max(1, m.loaded_size() // 2))
            holder["freed_bytes"] = S.STATS["evicted_bytes"] - before.get("evicted_bytes", 0)
        elif event == "ram_unload":        # pinned host copies given back (RAM pressure)
            holder["freed_bytes"] = m.partially_unload_ram(1e32)
        elif event == "second_model":      # another model loads and runs; its faults evict our ranges
            S.set_capacity(int(m.model_size() * 1.2))
            mm.load_models_gpu([other])
            with torch.inference_mode():
                dm = other.model.diffusion_model
                x = torch.zeros(1, 16, 1, 8, 8, dtype=torch.bfloat16)
                ctx = T.conditioning(KIND)[0][0][0].to(torch.bfloat16)
                dm(x, torch.tensor([500.0]), ctx)
            holder["freed_bytes"] = S.STATS["evicted_bytes"] - before.get("evicted_bytes", 0)
        elif event == "full_unload":       # ComfyUI frees the whole device while the sampling runs
            mm.free_memory(1e30, DEV)
            holder["loaded_after"] = any(lm.model is m for lm in mm.current_loaded_models)
        holder["faults_before"] = S.STATS["faults"]

    S.reset()
    try:
        y = sample(m, hook=at_step(1, act))
        holder["faults_after"] = S.STATS["faults"]
        rep = lifecycle.last_report(m)
    finally:
        S.set_capacity(None)
    rec = {"case": "midrun", "event": event, "vs_reference": cmp(y, refs["both_dynamic"]),
           "vs_comfy_only_rel": rel(y, refs["comfy_only"]), "report": summary(rep),
           "stats": dict(S.STATS), **{k: v for k, v in holder.items()}}
    rec["kept_after"] = resident.kept(p.model.diffusion_model) is not None
    rec["leftovers_after"] = runtime_leftovers(p.model.diffusion_model) if event == "full_unload" else None
    unload_all()
    rec["weights_fresh"] = same_weights(weights(p), fresh)
    return rec


def case_reads() -> dict:
    """Our read of a base weight against the weight ComfyUI's cast computes with, and a DoRA layer on a
    weight ComfyUI's LoRA patches, through ComfyUI's own vbar cast (the layer level)."""
    rec = {"case": "reads"}
    for dtype in (torch.float32, torch.bfloat16):
        p = build(dtype=dtype)
        c = comfy_lora(p)
        mm.load_models_gpu([c])
        mod = c.model.diffusion_model.blocks[0].ffn[0]
        x = torch.randn(4, mod.in_features, generator=torch.Generator().manual_seed(9)).to(dtype)
        w_cast, _ = comfy.ops.cast_bias_weight(mod, x)          # what the layer multiplies with (first cast)
        w_cast2, _ = comfy.ops.cast_bias_weight(mod, x)         # the resident copy, written back
        ours_read = base_weight(mod).tensor
        stored = mod.weight.detach().float()
        tag = str(dtype).replace("torch.", "")
        rec[tag] = {"has_range": hasattr(mod, "_v"), "lowvram_patch": mod.weight_lowvram_function is not None,
                    "read_vs_cast": cmp(ours_read.to(dtype), w_cast), "resident_vs_first": cmp(w_cast2, w_cast),
                    "read_vs_cast_rel": rel(ours_read, w_cast), "stored_vs_cast_rel": rel(stored, w_cast)}
        if dtype == torch.float32:
            rec["dora"] = dora_check(mod, x, w_cast)
        unload_all()
    return rec


def dora_check(mod, x, w_cast) -> dict:
    g = torch.Generator().manual_seed(11)
    out_f, in_f, r = mod.out_features, mod.in_features, 4
    down, up = torch.randn(r, in_f, generator=g) * 0.2, torch.randn(out_f, r, generator=g) * 0.2
    mag = torch.rand(out_f, 1, generator=g) + 0.5
    w = AdaptedLayer(mod, "blocks.0.ffn.0")
    w.attach()
    try:
        w.add_adapter("dora", LayerAdapter("blocks.0.ffn.0", down=down, up=up, alpha=2.0, dora_scale=mag), 0.8)
        with torch.no_grad():
            y = mod(x)
    finally:
        w.detach()
    s, b = 2.0 / r, mod.bias.detach().double()

    def dora(w_base):
        v = w_base + s * (up.double() @ down.double())
        wp = mag.double() * v / (v.norm(dim=1, keepdim=True) + torch.finfo(torch.float32).eps)
        return torch.nn.functional.linear(x.double(), w_base + 0.8 * (wp - w_base), b)

    ref = dora(w_cast.double())
    stored = mod.weight.detach().double()
    wrong = dora(stored) + torch.nn.functional.linear(x.double(), w_cast.double() - stored)
    return {"vs_reference_rel": rel(y, ref), "wrong_vs_reference_rel": rel(wrong, ref)}


def case_param_on_streamed_norm() -> dict:
    """A norm delta on a LayerNorm the dynamic loader streams (8192 wide: over 16 KiB)."""
    ops = comfy.ops.disable_weight_init

    class Box(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = ops.LayerNorm(8192, elementwise_affine=True, dtype=torch.bfloat16)
            self.proj = ops.Linear(8192, 64, dtype=torch.bfloat16)

        def forward(self, x):
            return self.proj(self.norm(x))

    box = Box()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        box.norm.weight.copy_(1 + 0.1 * torch.randn(8192, generator=g))
        box.norm.bias.copy_(0.1 * torch.randn(8192, generator=g))
        box.proj.weight.copy_(torch.randn(64, 8192, generator=g) / 90)
        box.proj.bias.zero_()
    p = mp.ModelPatcherDynamic(box, load_device=DEV, offload_device=CPU)
    mm.load_models_gpu([p])
    stored = box.norm.weight.detach().clone()
    delta = 0.5 * torch.randn(8192, generator=g)
    path = os.path.join(work, "norm_delta.safetensors")
    save_file({"diffusion_model.norm.diff": delta}, path)
    x = torch.randn(2, 8192, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        y_base = box(x)
        y_base_again = box(x)                                     # now from the resident copy
        with applied(box, plan(box, [AdapterSpec(path)], "auto", "exact")) as rep:
            y_ours = box(x)
            y_ours_again = box(x)
        y_after = box(x)
        # the wrong answer: write the delta into the stored tensor, as a plain merge would
        pp = ParamPatch("norm.weight", box.norm.weight)
        pp.add("a", ParamDelta("norm", "diff", "norm.weight", delta), 1.0)
        pp.merge()
        y_written = box(x)
        pp.restore()
    ref_w = (stored.float() + delta).to(torch.bfloat16)
    ref = box.proj(torch.nn.functional.layer_norm(x, (8192,), ref_w, box.norm.bias.detach()))
    rec = {"case": "param_on_streamed_norm", "norm_has_range": hasattr(box.norm, "_v"),
           "params": rep.params, "ours_vs_reference": cmp(y_ours, ref), "ours_again": cmp(y_ours_again, y_ours),
           "ours_vs_base_rel": rel(y_ours, y_base), "after_vs_base": cmp(y_after, y_base),
           "base_resident": cmp(y_base_again, y_base), "stored_untouched": torch.equal(box.norm.weight, stored),
           "written_vs_base": cmp(y_written, y_base), "written_vs_reference_rel": rel(y_written, ref)}
    unload_all()
    return rec


def main() -> None:
    import comfyui_version

    probe = build(dynamic=False)
    dm = probe.model.diffusion_model
    our_layers = linears(dm, lambda n: n.startswith("blocks.")) + ["text_embedding.0"]
    their_layers = linears(dm, lambda n: n.startswith("blocks.0."))
    write_lora(dm, OURS, our_layers, seed=1)
    write_lora(dm, THEIRS, their_layers, seed=2, scale=0.2)
    fresh = weights(probe)
    out({"host": host.NAME, "comfyui": getattr(comfyui_version, "__version__", "?"), "dynamic": True,
         "our_layers": len(our_layers),
         "comfy_layers": len(their_layers), "overlap": len(set(our_layers) & set(their_layers)),
         "small_layers": [n for n in our_layers if mm.module_size(dm.get_submodule(n)) <= 16 * 1024]})
    refs = {}
    steps = []

    def run(fn, *a):
        try:
            r = fn(*a)
            if isinstance(r, tuple):
                r, y = r
                steps.append(y)
            out(r)
        except Exception as e:
            out({"case": getattr(fn, "__name__", "?"), "args": [str(x) for x in a if isinstance(x, str)],
                 "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]})
            try:
                unload_all()
            except Exception:
                pass

    run(case_setup, fresh)
    base_out = steps[-1]
    run(case_comfy_only, fresh, base_out)
    refs["comfy_only"] = steps[-1]
    # references: ComfyUI's own unmerged LoRA (its bypass loader) with our file, alone and on top of its LoRA,
    # under dynamic VRAM; ours in dynamic mode on a plain (non-dynamic) patcher
    q = build()
    refs["bypass"] = sample(bypass(q))
    unload_all()
    q = build()
    refs["both"] = sample(bypass(comfy_lora(q)))
    unload_all()
    q = build(dynamic=False)
    refs["plain_dynamic"] = sample(ours(q, "dynamic"))
    unload_all()
    for mode in ("merge", "auto", "dynamic"):
        run(case_ours, fresh, base_out, mode, "exact", refs)
    run(case_ours, fresh, base_out, "dynamic", "lossless", refs)
    for mode in ("merge", "auto", "dynamic"):
        run(case_both, fresh, mode, refs)
    p = build()
    refs["both_dynamic"] = sample(ours(comfy_lora(p), "dynamic"))
    unload_all()
    for event in ("partial_unload", "ram_unload", "second_model", "full_unload"):
        run(case_midrun, fresh, event, refs)
    run(case_reads)
    run(case_param_on_streamed_norm)


main()
