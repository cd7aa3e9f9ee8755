"""Run in ComfyUI's python: per tiny model family (`comfy_tiny_models`), our Load LoRA Adapter against
ComfyUI's own LoRA loaders on the same model, one JSON line ``RESULT {...}`` per family.

    python comfy_family_probe.py <comfy_dir> <work_dir> [kind ...]

Per family (ComfyUI's class at its tiny config, bf16 weights, CPU):

- a native LoRA file (``diffusion_model.<module>`` kohya keys on every Linear, rank 4, alpha 2, factors
  N(0, 0.1^2): the scale of `dialect_models`' files);
- keys: the file layers ComfyUI's loader loads (each layer alone through ``convert_lora`` +
  ``load_lora`` with ``model_lora_keys_unet``), and the layers our Load LoRA Adapter loads;
- weights: ComfyUI's ``LoraLoaderModelOnly`` + ``patch_model`` against ours inside
  ``applied(plan(..., "merge", "exact"))`` (the keys ComfyUI writes, bit for bit);
- outputs of one KSampler run (seed 42, 2 steps, euler / simple, CFG 3): the base; ComfyUI's
  ``LoraLoaderModelOnly`` (it merges); ComfyUI's ``LoraLoaderBypassModelOnly`` (its unmerged LoRA,
  when this ComfyUI has it); the fp32 "ideal" (the same seeded model in fp32 under ComfyUI's
  LoRA); ours in merge and dynamic mode (exact tier); the base again at the end.

LTX-2 (``LTXAV``) adds a file on its text connectors only (the layers ComfyUI runs in
``extra_conds``, before the sampler's loop), its outputs the same way, and both files with our
OUTER_SAMPLE / PREPARE_SAMPLING wrappers removed (the lifecycle of a host without them: the adapters
go on in SAMPLER_SAMPLE, after the connectors ran).

Numbers come out as "bitwise" or a PSNR in dB (`lora_assets.psnr`: peak = the reference's range).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

comfy_dir, work = sys.argv[1], sys.argv[2]
kinds = sys.argv[3:]
sys.path.insert(0, comfy_dir)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/: testkit

import comfy.cli_args  # noqa: E402

comfy.cli_args.args.cpu = True
import comfy.lora  # noqa: E402
import comfy.lora_convert  # noqa: E402
import comfy.patcher_extension  # noqa: E402
import comfy.supported_models  # noqa: E402
import folder_paths  # noqa: E402
import nodes as comfy_nodes  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import comfyui_lora_runtime as pack  # noqa: E402
from comfyui_lora_runtime.nodes import host  # noqa: E402
from comfyui_lora_runtime.lora_runtime import AdapterSpec, applied, plan  # noqa: E402
from comfyui_lora_runtime.lora_runtime.files.key_formats import split_key  # noqa: E402
from comfyui_lora_runtime.nodes import lifecycle  # noqa: E402
from testkit import comfy_tiny_models as T  # noqa: E402
from testkit.lora_assets import psnr  # noqa: E402

try:
    from comfy_extras.nodes_lora_debug import LoraLoaderBypassModelOnly
except ImportError:          # ComfyUI before its bypass loader (0.3.64)
    LoraLoaderBypassModelOnly = None

CPU = torch.device("cpu")
RANK, ALPHA, FACTOR = 4, 2.0, 0.1
SAMPLING = {"seed": 42, "steps": 2, "cfg": 3.0, "sampler_name": "euler", "scheduler": "simple"}
# the connector-only file: larger factors, so that its effect on the output is clear (35 dB from the base)
CONNECTOR_FACTOR = 0.5
NO_WINDOW = (comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING)

loras = os.path.join(work, "loras")
os.makedirs(loras, exist_ok=True)
folder_paths.add_model_folder_path("loras", loras, is_default=True)


def out(record: dict) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def vs(a: torch.Tensor, ref: torch.Tensor):
    return "bitwise" if torch.equal(a, ref) else round(psnr(a, ref), 2)


def write_lora(dm, name: str, keep=lambda n: True, factor: float = FACTOR, seed: int = 1) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    sd, layers = {}, []
    for n, m in dm.named_modules():
        if isinstance(m, torch.nn.Linear) and keep(n):
            o, i = m.weight.shape
            sd[f"diffusion_model.{n}.lora_down.weight"] = torch.randn(RANK, i, generator=g) * factor
            sd[f"diffusion_model.{n}.lora_up.weight"] = torch.randn(o, RANK, generator=g) * factor
            sd[f"diffusion_model.{n}.alpha"] = torch.tensor(ALPHA)
            layers.append(n)
    save_file(sd, os.path.join(loras, name))
    return layers


def sample(kind: str, model) -> torch.Tensor:
    positive, negative = T.conditioning(kind)
    s = SAMPLING
    res = comfy_nodes.common_ksampler(model, s["seed"], s["steps"], s["cfg"], s["sampler_name"], s["scheduler"],
                                      positive, negative, {"samples": T.latent(kind)})
    return T.flat(res[0]["samples"])


def ours(patcher, name: str, mode: str, *, window: bool = True):
    m = pack.NODE_CLASS_MAPPINGS["LoraRuntimeLoadAdapter"]().load(patcher, name, 1.0)["result"][0]
    m = pack.NODE_CLASS_MAPPINGS["LoraRuntimeMergeMode"]().set_mode(m, mode)[0]
    m = pack.NODE_CLASS_MAPPINGS["LoraRuntimeQualityTier"]().set_tier(m, "exact")[0]
    if not window:
        for hook in NO_WINDOW:
            m.remove_wrappers_with_key(hook, lifecycle.WRAPPER_KEY)
    return m


def keys_and_weights(patcher, base, name: str) -> dict:
    """The layers ComfyUI's loader and ours load, and the weights each merge writes."""
    dm = base.diffusion_model
    path = os.path.join(loras, name)
    from safetensors.torch import load_file

    tensors = load_file(path)
    key_map = comfy.lora.model_lora_keys_unet(base, {})
    model_sd = base.state_dict()
    by_stem: dict[str, list[str]] = {}
    for k in tensors:
        by_stem.setdefault(split_key(k)[0], []).append(k)
    comfy_loaded = 0
    for ks in by_stem.values():   # each layer alone: does ComfyUI's loader take it?
        pd = comfy.lora.load_lora(comfy.lora_convert.convert_lora({k: tensors[k] for k in ks}), key_map,
                                  log_missing=False)
        comfy_loaded += any((k if isinstance(k, str) else k[0]) in model_sd for k in pd)
    base_sd = {k: v.clone() for k, v in dm.state_dict().items()}
    m = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(patcher, name, 1.0)[0]
    m.patch_model(device_to=CPU)
    theirs = {k: v.clone() for k, v in dm.state_dict().items()}
    m.unpatch_model(device_to=CPU, unpatch_weights=True)
    cov = pack.NODE_CLASS_MAPPINGS["LoraRuntimeLoadAdapter"]().load(patcher, name, 1.0, unmatched_keys="error")
    cov = cov["ui"]["lora_coverage"][0]
    with torch.no_grad(), applied(dm, plan(dm, [AdapterSpec(path)], "merge", "exact"), fusion_backend=None):
        mine = {k: v.clone() for k, v in dm.state_dict().items()}
    restored = all(torch.equal(dm.state_dict()[k], base_sd[k]) for k in base_sd)
    comfy_written = sorted(k for k in base_sd if not torch.equal(theirs[k], base_sd[k]))
    ours_written = sorted(k for k in base_sd if not torch.equal(mine[k], base_sd[k]))
    return {"file_layers": len(by_stem), "comfy_loaded": comfy_loaded, "ours": cov["matched"],
            "ours_unmatched": cov["unmatched"], "notes": cov["notes"], "comfy_written": len(comfy_written),
            "ours_written": len(ours_written),
            "written_by_comfy_not_ours": sorted(set(comfy_written) - set(ours_written)),
            "unequal": sorted(k for k in comfy_written if not torch.equal(theirs[k], mine[k]))[:5],
            "restored": restored}


def outputs(kind: str, patcher, patcher32, name: str, base_out: torch.Tensor, *, windowless: bool = False) -> dict:
    """Every output of one file, compared: vs ComfyUI's merge, its bypass, the fp32 ideal, the base."""
    comfy_out = sample(kind, comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(patcher, name, 1.0)[0])
    ideal = sample(kind, comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(patcher32, name, 1.0)[0])
    r = {"comfy_vs_base": vs(comfy_out, base_out), "comfy_vs_ideal": vs(comfy_out, ideal)}
    bypass = None
    if LoraLoaderBypassModelOnly is not None:
        bypass = sample(kind, LoraLoaderBypassModelOnly().load_lora_model_only(patcher, name, 1.0)[0])
        r["bypass_vs_comfy"] = vs(bypass, comfy_out)
        r["bypass_vs_ideal"] = vs(bypass, ideal)
    for mode in ("merge", "dynamic"):
        for window in (True, False) if windowless else (True,):
            m = ours(patcher, name, mode, window=window)
            o = sample(kind, m)
            tag = mode if window else f"{mode}_no_window"
            r[f"{tag}_vs_comfy"] = vs(o, comfy_out)
            r[f"{tag}_vs_base"] = vs(o, base_out)
            r[f"{tag}_vs_ideal"] = vs(o, ideal)
            if bypass is not None:
                r[f"{tag}_vs_bypass"] = vs(o, bypass)
            report = lifecycle.last_report(m) or {}
            r[f"{tag}_ran_check"] = [(f["layer"], f["handled"]) for f in report.get("ran_check") or []]
    return r


def family(kind: str) -> dict:
    cls = getattr(comfy.supported_models, kind, None)
    if cls is None:
        return {"kind": kind, "absent": True}
    t0 = time.perf_counter()
    base, patcher = T.build(kind, torch.bfloat16)
    base32, patcher32 = T.build(kind, torch.float32)
    dm = base.diffusion_model
    rec = {"kind": kind, "model_class": type(base).__name__, "config_dropped": base.tiny_config_dropped}
    name = f"{kind}_native.safetensors"
    write_lora(dm, name)
    rec.update(keys_and_weights(patcher, base, name))
    base_out = sample(kind, patcher)
    rec["outputs"] = outputs(kind, patcher, patcher32, name, base_out, windowless=kind == "LTXAV")
    if kind == "LTXAV":
        cname = f"{kind}_connectors.safetensors"
        rec["connector_layers"] = write_lora(dm, cname, lambda n: "_embeddings_connector." in n,
                                             factor=CONNECTOR_FACTOR, seed=2)
        rec["connectors"] = outputs(kind, patcher, patcher32, cname, base_out, windowless=True)
    rec["base_again"] = vs(sample(kind, patcher), base_out)
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


def main() -> None:
    import comfyui_version

    out({"host": host.NAME, "comfyui": getattr(comfyui_version, "__version__", "?"),
         "bypass_loader": LoraLoaderBypassModelOnly is not None})
    for kind in kinds or list(T.TINY):
        try:
            out(family(kind))
        except Exception as e:  # one family's failure is reported, the others still run
            out({"kind": kind, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]})


main()
