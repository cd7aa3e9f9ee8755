"""Z-Image, HunyuanVideo 1.5 / 1.0 and Chroma in real ComfyUI: the keys our Load LoRA Adapter
loads and the weights a merge writes, against ComfyUI's own LoraLoaderModelOnly on the same model.

The models are ComfyUI's own classes (``comfy.supported_models.ZImage`` / ``HunyuanVideo15`` /
``HunyuanVideo`` / ``Chroma`` -> ``get_model``: ``Lumina2`` with ``NextDiT``, ``HunyuanVideo15``,
``HunyuanVideo``, ``Chroma``) with tiny configs and seeded weights, wrapped in ComfyUI's
ModelPatcher, so nothing is downloaded. The adapter files are `testkit.dialect_models`' hand-written
files in every dialect of the family (rank 4, kohya files alpha 2, PEFT files none).

Per file, in ComfyUI's python (one process for all families):

- ComfyUI: which file layers its loader loads (each layer alone through ``convert_lora`` +
  ``load_lora`` with ``model_lora_keys_unet``, kept when ``add_patches`` would take the target), and
  the weights after ``LoraLoaderModelOnly`` + ``patch_model`` (then ``unpatch_model``: the base again);
- ours: the Load LoRA Adapter node's coverage (its key placement reads ComfyUI's map of this model),
  and the weights inside ``applied(plan(..., "merge", "exact"))`` (then restored bit for bit).

Asserted: every layer ComfyUI loads, we load, and every weight ComfyUI's merge writes equals ours
bit for bit (the same fp32 products, one rounding); we load every layer of every file (the
family tables place what ComfyUI's map has no name for: musubi-tuner's HunyuanVideo names,
Chroma's approximator in diffusers names), the report saying how many each placed. Families whose
class this ComfyUI lacks are skipped (0.3.64 has no ZImage or HunyuanVideo15).

Measured on ComfyUI 0.33.0 (CPU): every weight ComfyUI writes equal to ours bit for bit. Layers
loaded, ComfyUI / ours: Z-Image native, kohya 40/40; diffusers (transformer., diffusion_model.,
bare), LyCORIS 52/52; HunyuanVideo 1.5 native, kohya, diffusion-pipe (transformer.,
diffusion_model.) 44/44, musubi-tuner 28/44; HunyuanVideo 1.0 the same at 49/49, musubi 31/49;
Chroma native 29/29, diffusers and OneTrainer 37/43 (ComfyUI drops the approximator).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from testkit.comfyui.probe import run_probe

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, os, sys
comfy_dir, repo, work = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, comfy_dir)
sys.path.insert(0, os.path.join(repo, "tests"))
import torch
import comfy.cli_args
comfy.cli_args.args.cpu = True
import comfy.supported_models, comfy.model_patcher, comfy.lora, comfy.lora_convert
import folder_paths
import nodes as comfy_nodes
from safetensors.torch import save_file

import comfyui_lora_runtime as pack
from comfyui_lora_runtime.nodes import host
from comfyui_lora_runtime.lora_runtime import AdapterSpec, applied, plan
from comfyui_lora_runtime.lora_runtime.files.key_formats import split_key
from testkit import dialect_models as M

CPU = torch.device("cpu")


def config(kind):
    if kind == "ZImage":
        return {"image_model": "lumina2", "patch_size": 2, "in_channels": 4, "dim": 64, "cap_feat_dim": 32,
                "n_layers": 2, "qk_norm": True, "n_heads": 2, "n_kv_heads": 2, "axes_dims": [8, 12, 12],
                "axes_lens": [64, 64, 64], "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0,
                "z_image_modulation": True, "time_scale": 1000.0, "multiple_of": 16}
    if kind in ("HunyuanVideo15", "HunyuanVideo"):
        v15 = kind == "HunyuanVideo15"
        return {"image_model": "hunyuan_video", "in_channels": 4, "out_channels": 4, "patch_size": [1, 2, 2],
                "vec_in_dim": None if v15 else 12, "axes_dim": [4, 6, 6], "meanflow": False, "context_in_dim": 24,
                "hidden_size": 32, "mlp_ratio": 4.0, "num_heads": 2, "depth": 2,
                "depth_single_blocks": 0 if v15 else 2, "theta": 256, "qkv_bias": True, "byt5": v15,
                "guidance_embed": not v15, "use_cond_type_embedding": v15, "vision_in_dim": 20 if v15 else None,
                "meanflow_sum": False}
    return {"image_model": "chroma", "in_channels": 16, "out_channels": 16, "context_in_dim": 24, "hidden_size": 32,
            "mlp_ratio": 4.0, "num_heads": 2, "depth": 2, "depth_single_blocks": 2, "axes_dim": [4, 6, 6],
            "theta": 10000, "patch_size": 2, "qkv_bias": True, "in_dim": 8, "out_dim": 32, "hidden_dim": 40,
            "n_layers": 2, "txt_ids_dims": [], "vec_in_dim": None}


FAMILIES = {"ZImage": ("Z-Image",), "HunyuanVideo15": ("HunyuanVideo 1.5", "HunyuanVideo"),
            "HunyuanVideo": ("HunyuanVideo",), "Chroma": ("Chroma",)}
EXTRA = {"HunyuanVideo15": ("HunyuanVideo diffusion-pipe (diffusion_model.)", "HunyuanVideo musubi-tuner")}

loras = os.path.join(work, "loras")
os.makedirs(loras, exist_ok=True)
folder_paths.add_model_folder_path("loras", loras, is_default=True)
print("RESULT " + json.dumps({"host": host.NAME}))
for kind, fams in FAMILIES.items():
    cls = getattr(comfy.supported_models, kind, None)
    if cls is None:
        print("RESULT " + json.dumps({"kind": kind, "absent": True}))
        continue
    cfg = config(kind)
    params = {"HunyuanVideo15": "hunyuan_video", "HunyuanVideo": "hunyuan_video", "Chroma": "chroma"}.get(kind)
    if params:   # only the fields this ComfyUI's params class has (0.3.64's HunyuanVideo has no 1.5 fields)
        import importlib
        mod = importlib.import_module(f"comfy.ldm.{params}.model")
        fields = getattr(mod, "HunyuanVideoParams" if params == "hunyuan_video" else "ChromaParams").__dataclass_fields__
        cfg = {k: v for k, v in cfg.items() if k in fields or k == "image_model"}
    base = cls(cfg).get_model({})
    dm = base.diffusion_model
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in dm.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=CPU, offload_device=CPU)
    if kind == "Chroma":
        dm.mlp_hidden = int(dm.hidden_size * 4)   # testkit's Flux diffusers table reads it
    key_map = comfy.lora.model_lora_keys_unet(base, {})
    model_sd = base.state_dict()
    base_sd = {k: v.clone() for k, v in dm.state_dict().items()}
    if kind == "HunyuanVideo15":
        dialects = [d for d, v in M.MORE_DIALECT_FILES.items() if v[0] == "HunyuanVideo 1.5"] + list(EXTRA[kind])
    elif kind == "HunyuanVideo":
        dialects = [d for d, v in M.MORE_DIALECT_FILES.items() if v[0] == "HunyuanVideo"]
    else:
        dialects = [d for d, v in M.MORE_DIALECT_FILES.items() if v[0] in fams]
    for d in dialects:
        tensors, _ = M.make_dialect_file(d, dm, rank=4, seed=1)
        name = f"{kind}_" + "".join(c if c.isalnum() else "_" for c in d) + ".safetensors"
        path = os.path.join(loras, name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
        by_stem = {}
        for k in tensors:
            by_stem.setdefault(split_key(k)[0], []).append(k)
        comfy_loaded = []
        for s, ks in by_stem.items():   # each layer alone: does ComfyUI's loader take it?
            pd = comfy.lora.load_lora(comfy.lora_convert.convert_lora({k: tensors[k] for k in ks}), key_map,
                                      log_missing=False)
            if any((k if isinstance(k, str) else k[0]) in model_sd for k in pd):
                comfy_loaded.append(s)
        m = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(patcher, name, 1.0)[0]
        m.patch_model(device_to=CPU)
        theirs = {k: v.clone() for k, v in dm.state_dict().items()}
        m.unpatch_model(device_to=CPU, unpatch_weights=True)
        restored_c = all(torch.equal(dm.state_dict()[k], base_sd[k]) for k in base_sd)
        node = pack.NODE_CLASS_MAPPINGS["LoraRuntimeLoadAdapter"]()
        cov = node.load(patcher, name, 1.0, unmatched_keys="error")["ui"]["lora_coverage"][0]
        with torch.no_grad(), applied(dm, plan(dm, [AdapterSpec(path)], "merge", "exact"), fusion_backend=None):
            ours = {k: v.clone() for k, v in dm.state_dict().items()}
        restored_o = all(torch.equal(dm.state_dict()[k], base_sd[k]) for k in base_sd)
        comfy_written = sorted(k for k in base_sd if not torch.equal(theirs[k], base_sd[k]))
        ours_written = sorted(k for k in base_sd if not torch.equal(ours[k], base_sd[k]))
        unequal = sorted(k for k in comfy_written if not torch.equal(theirs[k], ours[k]))
        print("RESULT " + json.dumps({
            "kind": kind, "model_class": type(base).__name__, "dialect": d, "file_layers": len(by_stem),
            "comfy_loaded": len(comfy_loaded), "comfy_only": sorted(set(comfy_loaded) - set(by_stem)),
            "ours": cov["matched"], "ours_unmatched": cov["unmatched"], "format": cov["format"],
            "notes": cov["notes"], "comfy_written": len(comfy_written), "ours_written": len(ours_written),
            "written_by_comfy_not_ours": sorted(set(comfy_written) - set(ours_written)), "unequal": unequal[:5],
            "restored": restored_c and restored_o}))
'''

# (file layers, ComfyUI loads) where ComfyUI's loader loads less than the whole file
COMFY_PARTIAL = {("HunyuanVideo15", "HunyuanVideo musubi-tuner"): (44, 28),
                 ("HunyuanVideo", "HunyuanVideo musubi-tuner"): (49, 31),
                 ("Chroma", "Chroma diffusers"): (43, 37),
                 ("Chroma", "Chroma kohya-diffusers (OneTrainer)"): (43, 37)}


@pytest.fixture(scope="module")
def results(tmp_path_factory, comfy_checkout):
    comfy, python = comfy_checkout
    work = tmp_path_factory.mktemp("families")
    return run_probe(python, comfy, SCRIPT, [REPO, work], work, timeout=900)


@pytest.mark.parametrize("kind", ["ZImage", "HunyuanVideo15", "HunyuanVideo", "Chroma"])
def test_keys_and_merged_weights_against_comfyuis_lora_loader(results, kind):
    assert results[0] == {"host": "comfyui"}
    rows = [r for r in results if r.get("kind") == kind]
    if rows and rows[0].get("absent"):
        pytest.skip(f"this ComfyUI has no comfy.supported_models.{kind}")
    assert rows, kind
    print()
    for r in rows:
        print(f"{kind:15s} {r['dialect']:48s} layers {r['file_layers']:3d}  ComfyUI {r['comfy_loaded']:3d}  "
              f"ours {r['ours']:3d}  weights ComfyUI/ours {r['comfy_written']}/{r['ours_written']}")
        assert r["restored"], r
        # every layer of every file is ours, in strict mode
        assert r["ours"] == r["file_layers"] and r["ours_unmatched"] == 0, r
        assert r["comfy_loaded"] == COMFY_PARTIAL.get((kind, r["dialect"]), (0, r["file_layers"]))[1], r
        # whatever ComfyUI writes we write, bit for bit
        assert r["written_by_comfy_not_ours"] == [] and r["unequal"] == [], r
        assert r["comfy_written"] <= r["ours_written"]
        placed = [n for n in r["notes"] if "layers placed by ComfyUI's key map for " in n]
        assert placed and placed[0].startswith(f"{r['comfy_loaded']} of the file's {r['file_layers']} layers"), r
        extra = r["file_layers"] - r["comfy_loaded"]
        tables = [n for n in r["notes"] if "placed by the pack's own key tables" in n]
        assert (tables[0].startswith(f"{extra} layers") if extra else not tables), r
