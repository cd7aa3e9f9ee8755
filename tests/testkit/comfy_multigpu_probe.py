"""Run in ComfyUI's python: our MODEL through ``ModelPatcher.deepclone_multigpu`` (what core's multi-GPU
nodes do per extra device), on the CPU, one JSON line ``RESULT {...}`` per case.

    python comfy_multigpu_probe.py <comfy_dir> <work_dir>

The model: ComfyUI's Wan 2.1 class at its tiny config (`comfy_tiny_models`, bf16, seeded), its patcher
given a ``cached_patcher_init`` factory that builds it again (what a core loader registers; the
deep clone calls it for a pristine copy). Per case (merge mode merge / dynamic / auto, exact tier; with
and without ComfyUI's own LoraLoaderModelOnly upstream on 5 of the layers ours covers):

- sample our MODEL (seed 42, 2 steps, euler / simple, CFG 3); deep-clone it onto the CPU device;
  sample the clone: both outputs, reports (decision, per adapter, host-patched layers) and the
  decision cache's measurements taken by the clone's sampling;
- the clone's model is a new one; its intent, wrappers and callbacks are ours;
- auto mode once more with our ON_DEEPCLONE_MULTIGPU callback removed (the wrong answer: the clone
  measures again);
- after ``unload_all_models``: both models' weights equal a fresh build bit for bit, no module keeps
  runtime state, and the bare model samples as before.
"""
from __future__ import annotations

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
import comfy.model_management  # noqa: E402
import comfy.patcher_extension  # noqa: E402
import folder_paths  # noqa: E402
import nodes as comfy_nodes  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import comfyui_lora_runtime as pack  # noqa: E402
from comfyui_lora_runtime.lora_runtime.layer.wrapper import runtime_leftovers  # noqa: E402
from comfyui_lora_runtime.nodes import caches, host, lifecycle  # noqa: E402
from testkit import comfy_tiny_models as T  # noqa: E402

KIND = "WAN21_T2V"
CPU = torch.device("cpu")
SAMPLING = {"seed": 42, "steps": 2, "cfg": 3.0, "sampler_name": "euler", "scheduler": "simple"}
OURS, THEIRS = "ours_all.safetensors", "comfy_part.safetensors"

loras = os.path.join(work, "loras")
os.makedirs(loras, exist_ok=True)
folder_paths.add_model_folder_path("loras", loras, is_default=True)


def out(record: dict) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def build():
    base, patcher = T.build(KIND, torch.bfloat16)
    patcher.cached_patcher_init = (lambda: build(), ())
    return patcher


def write_lora(dm, name: str, keep, seed: int) -> int:
    g = torch.Generator().manual_seed(seed)
    sd, n_layers = {}, 0
    for n, m in dm.named_modules():
        if isinstance(m, torch.nn.Linear) and keep(n):
            o, i = m.weight.shape
            sd[f"diffusion_model.{n}.lora_down.weight"] = torch.randn(4, i, generator=g) * 0.1
            sd[f"diffusion_model.{n}.lora_up.weight"] = torch.randn(o, 4, generator=g) * 0.1
            sd[f"diffusion_model.{n}.alpha"] = torch.tensor(2.0)
            n_layers += 1
    save_file(sd, os.path.join(loras, name))
    return n_layers


def sample(model) -> torch.Tensor:
    positive, negative = T.conditioning(KIND)
    s = SAMPLING
    res = comfy_nodes.common_ksampler(model, s["seed"], s["steps"], s["cfg"], s["sampler_name"], s["scheduler"],
                                      positive, negative, {"samples": T.latent(KIND)})
    return T.flat(res[0]["samples"])


def ours(patcher, mode: str):
    m = pack.NODE_CLASS_MAPPINGS["LoraRuntimeLoadAdapter"]().load(patcher, OURS, 1.0)["result"][0]
    m = pack.NODE_CLASS_MAPPINGS["LoraRuntimeMergeMode"]().set_mode(m, mode)[0]
    return pack.NODE_CLASS_MAPPINGS["LoraRuntimeQualityTier"]().set_tier(m, "exact")[0]


def summary(report: dict) -> dict:
    dec = report.get("decision") or {}
    return {"chosen": dec.get("chosen"), "kept_dynamic": dec.get("kept_dynamic", 0),
            "adapters": [(a["name"], (a.get("decision") or {}).get("chosen"), a["coverage"].get("matched"))
                         for a in report["adapters"]],
            "host_patched": (report.get("host_patched") or {}).get("layers", 0)}


def weights(patcher) -> dict:
    return {k: v.detach().clone() for k, v in patcher.model.diffusion_model.state_dict().items()}


def case(fresh: dict, base_out: torch.Tensor, mode: str, comfy_upstream: bool, callback: bool = True) -> dict:
    p = build()
    src = p
    if comfy_upstream:
        src = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(p, THEIRS, 1.0)[0]
    m = ours(src, mode)
    if not callback:   # the wrong answer: without our ON_DEEPCLONE_MULTIGPU callback the clone measures again
        m.remove_callbacks_with_key(comfy.patcher_extension.CallbacksMP.ON_DEEPCLONE_MULTIGPU, lifecycle.WRAPPER_KEY)
    source_cache = caches.decision_cache_for(host.diffusion_model(m))
    original = sample(m)
    rep_o = lifecycle.last_report(m)
    clone = m.deepclone_multigpu(new_load_device=CPU)
    cache = caches.decision_cache_for(host.diffusion_model(clone))
    measured_before = cache.measurements
    cloned = sample(clone)
    rep_c = lifecycle.last_report(clone)
    r = {"mode": mode, "comfy_upstream": comfy_upstream, "callback": callback,
         "original_measurements": source_cache.measurements,
         "new_model": clone.model is not m.model,
         "same_intent": lifecycle.read(clone) == lifecycle.read(m),
         "registered": lifecycle.is_registered(clone),
         "clone_vs_original": "bitwise" if torch.equal(cloned, original) else
         float((cloned.float() - original.float()).abs().max()),
         "original_vs_base_rel": float((original.float() - base_out.float()).norm() / base_out.float().norm()),
         "report_original": summary(rep_o), "report_clone": summary(rep_c),
         "clone_measurements": cache.measurements - measured_before}
    comfy.model_management.unload_all_models()
    r["weights_fresh"] = {what: all(torch.equal(v, fresh[k]) for k, v in weights(x).items())
                          for what, x in (("original", m), ("clone", clone))}
    r["leftovers"] = runtime_leftovers(m.model.diffusion_model) + runtime_leftovers(clone.model.diffusion_model)
    r["base_again"] = torch.equal(sample(p), base_out)
    return r


def main() -> None:
    import comfyui_version

    probe = build()
    dm = probe.model.diffusion_model
    n_ours = write_lora(dm, OURS, lambda n: n.startswith("blocks."), seed=1)
    part = [n for n, m in dm.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("blocks.0.")][:5]
    write_lora(dm, THEIRS, lambda n: n in part, seed=2)
    fresh = weights(probe)
    base_out = sample(probe)
    out({"host": host.NAME, "comfyui": getattr(comfyui_version, "__version__", "?"),
         "deepclone": hasattr(probe, "deepclone_multigpu"), "our_layers": n_ours, "comfy_layers": len(part)})
    if not hasattr(probe, "deepclone_multigpu"):
        return
    for mode in ("merge", "dynamic", "auto"):
        for upstream in (False, True):
            try:
                out(case(fresh, base_out, mode, upstream))
                if mode == "auto" and not upstream:
                    out(case(fresh, base_out, mode, upstream, callback=False))
            except Exception as e:
                out({"mode": mode, "comfy_upstream": upstream, "error": f"{type(e).__name__}: {e}",
                     "trace": traceback.format_exc()[-2000:]})


main()
