"""Write the saved workflows from one description: API format in workflows/api/, UI format in
workflows/ (the folder ComfyUI's template browser reads; its thumbnails are made by
tools/make_thumbnails.py).

    python tools/make_workflows.py            # rewrite workflows/api/*.api.json and workflows/*.json

Each graph below is described once; the API file is what POST /prompt takes, the UI
file is what ComfyUI's editor loads (drag-and-drop) with the same widget values.
Widget order comes from the node classes' INPUT_TYPES for our nodes and the bundled
core nodes, and from `COMFY_ONLY` for ComfyUI nodes the bundled host does not have.
Node sizes and places come from their content measured for the widest plausible font
(tools/workflow_layout.py), so no node covers another whatever font the browser has.
ComfyUI lists every .json directly in a pack's example_workflows/, example/, examples/, workflow/
or workflows/ folder as a template, but not those in a subfolder: the API files live in
workflows/api/, which it does not scan.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python tools/make_workflows.py
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import workflow_layout as layout
else:
    from . import workflow_layout as layout

ROOT = Path(__file__).resolve().parents[1]
API_OUT = ROOT / "workflows" / "api"
UI_OUT = ROOT / "workflows"

# ComfyUI nodes outside the bundled host: (socket inputs, widget names, outputs)
COMFY_ONLY = {
    "CLIPLoader": ([], ["clip_name", "type", "device"], [("CLIP", "CLIP")]),
    "DualCLIPLoader": ([], ["clip_name1", "clip_name2", "type", "device"], [("CLIP", "CLIP")]),
    "CLIPTextEncode": ([("clip", "CLIP")], ["text"], [("CONDITIONING", "CONDITIONING")]),
    "VAELoader": ([], ["vae_name"], [("VAE", "VAE")]),
    "VAEDecode": ([("samples", "LATENT"), ("vae", "VAE")], [], [("IMAGE", "IMAGE")]),
    "SaveAnimatedWEBP": ([("images", "IMAGE")], ["filename_prefix", "fps", "lossless", "quality", "method"], []),
    "FluxGuidance": ([("conditioning", "CONDITIONING")], ["guidance"], [("CONDITIONING", "CONDITIONING")]),
    "EmptySD3LatentImage": ([], ["width", "height", "batch_size"], [("LATENT", "LATENT")]),
    "CheckpointLoaderSimple": ([], ["ckpt_name"], [("MODEL", "MODEL"), ("CLIP", "CLIP"), ("VAE", "VAE")]),
    "LTXVConditioning": ([("positive", "CONDITIONING"), ("negative", "CONDITIONING")], ["frame_rate"],
                         [("positive", "CONDITIONING"), ("negative", "CONDITIONING")]),
    "EmptyLTXVLatentVideo": ([], ["width", "height", "length", "batch_size"], [("LATENT", "LATENT")]),
}
# ComfyUI-only widgets that are multi-line text boxes
COMFY_ONLY_MULTILINE = {("CLIPTextEncode", "text")}
# titles ComfyUI gives the core nodes (NODE_DISPLAY_NAME_MAPPINGS); a node not named here shows its class name
CORE_TITLES = {"UNETLoader": "Load Diffusion Model", "CLIPLoader": "Load CLIP", "VAELoader": "Load VAE",
               "CLIPTextEncode": "CLIP Text Encode (Prompt)", "VAEDecode": "VAE Decode", "SaveImage": "Save Image",
               "CheckpointLoaderSimple": "Load Checkpoint"}
# the LoRA Stack's editor widgets (web/lora_stack.js): per row, then the add button
STACK_ROW_WIDGETS = ("LoRA {n}", "{n} file", "{n} strength", "{n} schedule", "{n} branch", "{n} blocks",
                     "\u2715 remove LoRA {n}")
STACK_ADD = "+ Add LoRA"
SOCKET_TYPES = {"MODEL", "CLIP", "VAE", "CONDITIONING", "LATENT", "IMAGE", "MASK", "SIGMAS", "NOISE", "GUIDER",
                "SAMPLER"}


def node_classes() -> dict:
    sys.path.insert(0, str(ROOT.parent))
    from comfyui_lora_runtime import NODE_CLASS_MAPPINGS
    from comfyui_lora_runtime.standalone.host.core_nodes import CORE_NODE_CLASS_MAPPINGS
    return {**CORE_NODE_CLASS_MAPPINGS, **NODE_CLASS_MAPPINGS}


def signature(class_type: str, classes: dict):
    """(sockets [(name, type)], widgets [(name, has_control)], outputs [(name, type)], is_output)."""
    if class_type in COMFY_ONLY:
        sockets, widgets, outputs = COMFY_ONLY[class_type]
        return sockets, [(w, False) for w in widgets], outputs, not outputs
    cls = classes[class_type]
    spec = cls.INPUT_TYPES()
    sockets, widgets = [], []
    for section in ("required", "optional"):
        for name, s in (spec.get(section) or {}).items():
            t = s[0]
            opts = s[1] if len(s) > 1 and isinstance(s[1], dict) else {}
            if isinstance(t, str) and (t in SOCKET_TYPES or opts.get("forceInput")):  # a socket, never a widget
                sockets.append((name, t))
            else:
                opts = s[1] if len(s) > 1 else {}
                widgets.append((name, bool(opts.get("control_after_generate"))))
    names = getattr(cls, "RETURN_NAMES", None) or cls.RETURN_TYPES
    outputs = list(zip(names, cls.RETURN_TYPES))
    return sockets, widgets, outputs, bool(getattr(cls, "OUTPUT_NODE", False))


def title_of(class_type: str, graph: dict, nid: int) -> str:
    """The title the editor draws: the graph's own, else the node's display name."""
    if nid in graph.get("titles", {}):
        return graph["titles"][nid]
    from comfyui_lora_runtime import NODE_DISPLAY_NAME_MAPPINGS
    return NODE_DISPLAY_NAME_MAPPINGS.get(class_type) or CORE_TITLES.get(class_type) or class_type


def multiline_widgets(class_type: str, classes: dict) -> set[str]:
    if class_type in COMFY_ONLY:
        return {w for c, w in COMFY_ONLY_MULTILINE if c == class_type}
    spec = classes[class_type].INPUT_TYPES()
    return {name for section in ("required", "optional") for name, s in (spec.get(section) or {}).items()
            if len(s) > 1 and isinstance(s[1], dict) and s[1].get("multiline")}


def shown_widgets(class_type: str, classes: dict, values: dict) -> list[tuple[str, str, bool]]:
    """(label, value, multiline) of each widget the editor draws for this node."""
    _, widgets, _, _ = signature(class_type, classes)
    if class_type == "LoraRuntimeStack":  # the rows text is hidden; one line of widgets per row
        from comfyui_lora_runtime.nodes.stack_node import parse_rows
        out = []
        for n, row in enumerate(parse_rows(values["rows"]), 1):
            shown = ("off" if not row["on"] else "on", row["lora"], layout.value_text(row["strength"]),
                     row["schedule"], row["branch"], row.get("blocks", ""), "")
            out += [(label.format(n=n), v, False) for label, v in zip(STACK_ROW_WIDGETS, shown)]
        out.append((STACK_ADD, "", False))
        return out + [(name, layout.value_text(values[name]), False) for name, _ in widgets if name != "rows"]
    multi = multiline_widgets(class_type, classes)
    out = []
    for name, control in widgets:
        out.append((name, layout.value_text(values[name]), name in multi))
        if control:
            out.append(("control after generate", "randomize", False))
    return out


def node_sizes(graph: dict, classes: dict) -> dict:
    """{node id: [width, height]} from each node's content (tools/workflow_layout.py)."""
    sizes = {}
    for nid, (ctype, values) in graph["nodes"].items():
        sockets, _, outputs, _ = signature(ctype, classes)
        sizes[nid] = layout.node_size(title_of(ctype, graph, nid), [n for n, _ in sockets], [n for n, _ in outputs],
                                      shown_widgets(ctype, classes, values))
    return sizes


def api_format(graph: dict) -> dict:
    out = {}
    for nid, (ctype, values) in graph["nodes"].items():
        out[str(nid)] = {"class_type": ctype, "inputs": {
            k: ([str(v[0]), v[1]] if isinstance(v, tuple) else v) for k, v in values.items()},
            "_meta": {"title": graph.get("titles", {}).get(nid, ctype)}}
    return out


def ui_format(graph: dict, classes: dict) -> dict:
    nodes, links = [], []
    link_id = 0
    out_links: dict[tuple[int, int], list[int]] = {}
    pending = []
    sizes = node_sizes(graph, classes)
    places = layout.table_positions(graph["layout"], sizes)
    for order, (nid, (ctype, values)) in enumerate(graph["nodes"].items()):
        sockets, widgets, outputs, _ = signature(ctype, classes)
        inputs = []
        for slot, (name, t) in enumerate(sockets):
            v = values.get(name)
            if isinstance(v, tuple):
                link_id += 1
                origin, oslot = v
                links.append([link_id, origin, oslot, nid, slot, t])
                out_links.setdefault((origin, oslot), []).append(link_id)
                inputs.append({"name": name, "type": t, "link": link_id})
            else:
                inputs.append({"name": name, "type": t, "link": None})
        wv = []
        for name, control in widgets:
            if name not in values:
                raise KeyError(f"node {nid} ({ctype}): no value for widget {name!r}")
            wv.append(values[name])
            if control:
                wv.append("fixed")
        node = {"id": nid, "type": ctype, "pos": places[nid], "size": sizes[nid],
                "flags": {}, "order": order, "mode": 0, "inputs": inputs, "outputs": [],
                "properties": {"Node name for S&R": ctype}, "widgets_values": wv}
        if nid in graph.get("titles", {}):
            node["title"] = graph["titles"][nid]
        pending.append((node, outputs))
        nodes.append(node)
    for node, outputs in pending:
        node["outputs"] = [{"name": n, "type": t, "links": out_links.get((node["id"], i), []), "slot_index": i}
                           for i, (n, t) in enumerate(outputs)]
    return {"last_node_id": max(graph["nodes"]), "last_link_id": link_id, "nodes": nodes, "links": links,
            "groups": [], "config": {}, "extra": {"comfyui_lora_runtime": graph["about"]}, "version": 0.4}


def _embedded(about, adapter=None, strength=1.0, mode="auto", tier="lossless", prompt="white 7", batch=4,
              cfg=5.0, prefix="lora_runtime/embedded", schedule="", steps=20, stack_rows=None):
    n = {1: ("UNETLoader", {"unet_name": "tiny_wan_glyphs.safetensors", "weight_dtype": "default"})}
    model = (1, 0)
    layout = {1: (0, 0)}
    if stack_rows is not None:  # the LoRA Stack in the loader's place
        n[2] = ("LoraRuntimeStack", {"model": model, "rows": json.dumps(stack_rows), "unmatched_keys": "error"})
        n[3] = ("LoraRuntimeMergeMode", {"model": (2, 0), "mode": mode, "restore_memory": "lean"})
        model = (3, 0)
        layout.update({2: (1, 0), 3: (2, 0)})
    elif adapter:
        n[2] = ("LoraRuntimeLoadAdapter", {"model": model, "lora_name": adapter, "strength": strength,
                                         "unmatched_keys": "error", "strength_schedule": schedule,
                                         "branch": "both", "blocks": ""})
        n[3] = ("LoraRuntimeMergeMode", {"model": (2, 0), "mode": mode, "restore_memory": "lean"})
        model = (3, 0)
        layout.update({2: (1, 0), 3: (2, 0)})
    n[4] = ("LoraRuntimeQualityTier", {"model": model, "tier": tier})
    n[5] = ("LoraRuntimeTinyTextEncode", {"text": prompt})
    n[6] = ("LoraRuntimeTinyTextEncode", {"text": ""})
    n[7] = ("EmptyHunyuanLatentVideo", {"width": 64, "height": 64, "length": 1, "batch_size": batch})
    n[8] = ("LoraRuntimeSampler", {"model": (4, 0), "seed": 42, "steps": steps, "cfg": cfg, "sampler_name": "euler",
                                   "scheduler": "simple", "positive": (5, 0), "negative": (6, 0),
                                   "latent_image": (7, 0), "denoise": 1.0})
    n[9] = ("LoraRuntimeTinyDecode", {"samples": (8, 0)})
    n[10] = ("SaveImage", {"images": (9, 0), "filename_prefix": prefix})
    layout.update({4: (3, 0), 5: (0, 1), 6: (0, 2), 7: (1, 2), 8: (4, 0), 9: (5, 0), 10: (6, 0)})
    return {"about": about, "nodes": n, "layout": layout,
            "titles": {5: "Positive prompt", 6: "Negative prompt (empty = unconditional)"}}


def _template(about, loader_nodes, model, clip, vae, latent, pos_text, neg_text, sampler, save, lora, extra=None):
    n = dict(loader_nodes)
    n[20] = ("LoraRuntimeLoadAdapter", {"model": model, "lora_name": lora, "strength": 1.0, "unmatched_keys": "error",
                                        "strength_schedule": "", "branch": "both", "blocks": ""})
    n[21] = ("LoraRuntimeMergeMode", {"model": (20, 0), "mode": "auto", "restore_memory": "lean"})
    n[22] = ("LoraRuntimeQualityTier", {"model": (21, 0), "tier": "lossless"})
    n[23] = ("CLIPTextEncode", {"clip": clip, "text": pos_text})
    n[24] = ("CLIPTextEncode", {"clip": clip, "text": neg_text})
    pos, neg = (23, 0), (24, 0)
    if extra:
        pos, neg = extra(n, pos, neg)
    n[25] = latent
    n[26] = ("LoraRuntimeSampler", {"model": (22, 0), "positive": pos, "negative": neg, "latent_image": (25, 0),
                                    **sampler})
    n[27] = ("VAEDecode", {"samples": (26, 0), "vae": vae})
    n[28] = save
    layout = {k: (i % 6, i // 6) for i, k in enumerate(n)}
    return {"about": about, "nodes": n, "layout": layout}


def graphs() -> dict:
    g = {
        "embedded_base": _embedded("Embedded tiny Wan 2.1: the base model, no adapter.",
                                   prefix="lora_runtime/base"),
        "embedded_style": _embedded("Embedded tiny Wan 2.1 with the outline style adapter (kohya format); "
                                    "auto merge mode, lossless tier.", adapter="glyph_outline_style.safetensors",
                                    prefix="lora_runtime/style"),
        "embedded_style_diffusers": _embedded(
            "The same style adapter saved in the diffusers-named Wan dialect (attn1.to_q, ffn.net.0.proj).",
            adapter="glyph_outline_style_diffusers.safetensors", prefix="lora_runtime/style_diffusers"),
        "embedded_distilled": _embedded(
            "Embedded tiny Wan 2.1 with the distilled (CFG-free) adapter, PEFT format: its update is far below a "
            "bf16 ulp, so auto keeps it dynamic on bf16 weights. 4 steps, cfg 1 (what it is distilled for).",
            adapter="glyph_distilled_cfg.safetensors", cfg=1.0, steps=4, prefix="lora_runtime/distilled"),
    }
    g["embedded_style_stack"] = _embedded(
        "Embedded tiny Wan 2.1 with the LoRA Stack: row 1, the outline style adapter at strength 1, on; row 2, "
        "the distilled adapter, switched off (a row that is off is left out, as a loader not in the chain). The "
        "same images as embedded_style, which chains one Load LoRA Adapter.",
        prefix="lora_runtime/style_stack", stack_rows=[
            {"on": True, "lora": "glyph_outline_style.safetensors", "strength": 1.0, "schedule": "", "branch": "both"},
            {"on": False, "lora": "glyph_distilled_cfg.safetensors", "strength": 1.0, "schedule": "",
             "branch": "both"}])
    g["embedded_distilled_first_half"] = _embedded(
        "Embedded tiny Wan 2.1, distilled adapter on the first half of the denoising only (strength_schedule "
        "'0:1, 0.5:0', keyframes in ComfyUI's start_percent convention), cfg 1: the strength changes at run "
        "time with no re-merge; auto keeps the adapter dynamic because its strength varies. 4 steps.",
        adapter="glyph_distilled_cfg.safetensors", cfg=1.0, steps=4, prefix="lora_runtime/distilled_first_half",
        schedule="0:1, 0.5:0")
    wan_loaders = {
        1: ("UNETLoader", {"unet_name": "wan2.1_t2v_1.3B_bf16.safetensors", "weight_dtype": "default"}),
        2: ("CLIPLoader", {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan", "device": "default"}),
        3: ("VAELoader", {"vae_name": "wan_2.1_vae.safetensors"}),
        4: ("ModelSamplingSD3", {"model": (1, 0), "shift": 8.0}),
    }
    g["template_wan21_t2v_1.3b_lora"] = _template(
        "Template: Wan 2.1 T2V 1.3B with a LoRA. Needs diffusion_models/wan2.1_t2v_1.3B_bf16.safetensors, "
        "text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors, vae/wan_2.1_vae.safetensors, "
        "loras/wan21_lora.safetensors.", wan_loaders, (4, 0), (2, 0), (3, 0),
        ("EmptyHunyuanLatentVideo", {"width": 832, "height": 480, "length": 33, "batch_size": 1}),
        "a cat walking on a beach at sunset", "blurry, low quality",
        {"seed": 42, "steps": 30, "cfg": 6.0, "sampler_name": "uni_pc", "scheduler": "simple", "denoise": 1.0},
        ("SaveAnimatedWEBP", {"images": (27, 0), "filename_prefix": "lora_runtime/wan", "fps": 16.0,
                              "lossless": False, "quality": 90, "method": "default"}),
        "wan21_lora.safetensors")
    flux_loaders = {
        1: ("UNETLoader", {"unet_name": "flux1-dev.safetensors", "weight_dtype": "default"}),
        2: ("DualCLIPLoader", {"clip_name1": "clip_l.safetensors", "clip_name2": "t5xxl_fp16.safetensors",
                               "type": "flux", "device": "default"}),
        3: ("VAELoader", {"vae_name": "ae.safetensors"}),
    }

    def flux_guidance(n, pos, neg):
        n[30] = ("FluxGuidance", {"conditioning": pos, "guidance": 3.5})
        return (30, 0), neg

    g["template_flux1_dev_lora"] = _template(
        "Template: FLUX.1-dev with a LoRA. Needs diffusion_models/flux1-dev.safetensors, text_encoders/clip_l and "
        "t5xxl_fp16, vae/ae.safetensors, loras/flux_lora.safetensors.", flux_loaders, (1, 0), (2, 0), (3, 0),
        ("EmptySD3LatentImage", {"width": 1024, "height": 1024, "batch_size": 1}),
        "a red fox in the snow, photo", "",
        {"seed": 42, "steps": 20, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0},
        ("SaveImage", {"images": (27, 0), "filename_prefix": "lora_runtime/flux"}), "flux_lora.safetensors",
        extra=flux_guidance)
    ltx_loaders = {
        1: ("CheckpointLoaderSimple", {"ckpt_name": "ltx-video-2b-v0.9.5.safetensors"}),
        2: ("CLIPLoader", {"clip_name": "t5xxl_fp16.safetensors", "type": "ltxv", "device": "default"}),
    }

    def ltx_conditioning(n, pos, neg):
        n[31] = ("LTXVConditioning", {"positive": pos, "negative": neg, "frame_rate": 25.0})
        return (31, 0), (31, 1)

    g["template_ltxv_lora"] = _template(
        "Template: LTX-Video 2B v0.9.5 with a LoRA. Needs checkpoints/ltx-video-2b-v0.9.5.safetensors, "
        "text_encoders/t5xxl_fp16.safetensors, loras/ltxv_lora.safetensors.", ltx_loaders, (1, 0), (2, 0), (1, 2),
        ("EmptyLTXVLatentVideo", {"width": 768, "height": 512, "length": 97, "batch_size": 1}),
        "a drone shot over a forest river", "low quality, worst quality, deformed, distorted",
        {"seed": 42, "steps": 30, "cfg": 3.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0},
        ("SaveAnimatedWEBP", {"images": (27, 0), "filename_prefix": "lora_runtime/ltxv", "fps": 24.0,
                              "lossless": False, "quality": 90, "method": "default"}),
        "ltxv_lora.safetensors", extra=ltx_conditioning)
    return g


def main() -> None:
    classes = node_classes()
    API_OUT.mkdir(parents=True, exist_ok=True)
    UI_OUT.mkdir(exist_ok=True)
    for name, graph in graphs().items():
        (API_OUT / f"{name}.api.json").write_text(json.dumps(api_format(graph), indent=1) + "\n")
        (UI_OUT / f"{name}.json").write_text(json.dumps(ui_format(graph, classes), indent=1) + "\n")
        print(f"wrote workflows/api/{name}.api.json and workflows/{name}.json")


if __name__ == "__main__":
    main()
