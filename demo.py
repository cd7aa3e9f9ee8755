"""The main job: the embedded workflows under every merge mode and tier, side by side.

    python -m comfyui_lora_runtime demo [--output output/demo]

Runs the saved API workflows in workflows/ on the bundled host with the embedded
tiny Wan 2.1 model stored in bfloat16 (as ComfyUI stores it on a GPU, so merge
rounding is real), then writes into the output folder: every image, a labelled
contact sheet (contact_sheet.png) and decisions.json, and prints a table of the
decisions (mode chosen, share a merge would lose, tier, fusions, time per step) with
each image's mean absolute difference to the image without adapter.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from .host.bundled import folder_paths
from .host.bundled.executor import execute_prompt
from .host.bundled.workflow_format import set_widget_value

ROOT = Path(__file__).resolve().parent
WORKFLOWS = ROOT / "workflows"

# (label, workflow, overrides {node: {input: value}})
RUNS = [
    ("no adapter", "embedded_base", {}),
    ("style auto", "embedded_style", {}),
    ("style merge", "embedded_style", {"3": {"mode": "merge"}}),
    ("style dynamic", "embedded_style", {"3": {"mode": "dynamic"}}),
    ("style dyn exact", "embedded_style", {"3": {"mode": "dynamic"}, "4": {"tier": "exact"}}),
    ("style dyn high", "embedded_style", {"3": {"mode": "dynamic"}, "4": {"tier": "high"}}),
    ("style diffusers keys", "embedded_style_diffusers", {}),
    ("distilled auto cfg1", "embedded_distilled", {}),
    ("distilled merge cfg1", "embedded_distilled", {"3": {"mode": "merge"}}),
    ("distilled half cfg1", "embedded_distilled_first_half", {}),  # strength_schedule '0:1, 0.5:0'
    ("base cfg1", "embedded_base", {"8": {"cfg": 1.0}}),
]


def _classes() -> dict:
    from . import NODE_CLASS_MAPPINGS
    from .host.bundled.core_nodes import CORE_NODE_CLASS_MAPPINGS
    return {**CORE_NODE_CLASS_MAPPINGS, **NODE_CLASS_MAPPINGS}


def _load(name: str) -> dict:
    return json.loads((WORKFLOWS / f"{name}.api.json").read_text())


def run_demo(output: str | os.PathLike, steps: int = 20) -> int:
    out = Path(output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    classes = _classes()
    folders = folder_paths.ModelFolders(output_dir=out)
    rows, sheet = [], []
    for label, wf, overrides in RUNS:
        prompt = _load(wf)
        ui_wf = json.loads((WORKFLOWS / f"{wf}.ui.json").read_text())
        slug = label.replace(" ", "_")
        changes = {"8": {"steps": steps}, "10": {"filename_prefix": slug}}
        for node, values in overrides.items():
            changes.setdefault(node, {}).update(values)
        for node, values in changes.items():  # to both, so each PNG's workflow reproduces it
            prompt[node]["inputs"].update(values)
            for name, value in values.items():
                set_widget_value(ui_wf, node, name, value, classes)
        t0 = time.perf_counter()
        res = execute_prompt(prompt, classes, folders=folders, extra_pnginfo={"workflow": ui_wf},
                             unet_dtype="bf16")
        wall = time.perf_counter() - t0
        report = res.ui["8"]["lora_report"][0]
        files = res.saved_files()
        images = np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files])
        rows.append({"run": label, "workflow": wf, "report": report, "files": files, "wall_seconds": wall})
        sheet.append((label, images))
    base = {lbl: imgs for lbl, imgs in sheet}
    for row, (label, imgs) in zip(rows, sheet):
        ref = base["base cfg1"] if "cfg1" in label else base["no adapter"]
        row["mean_abs_diff_vs_base"] = float(np.abs(imgs.astype(np.float64) - ref.astype(np.float64)).mean())
    _contact_sheet(sheet, out / "contact_sheet.png")
    (out / "decisions.json").write_text(json.dumps(rows, indent=1, default=str))
    print(_table(rows))
    print(f"\nimages, contact_sheet.png and decisions.json in {out}")
    return 0


def _table(rows) -> str:
    head = f"{'run':22} {'adapter':38} {'mode':8} {'chosen':8} {'lost':>6} {'tier':8} {'fusions':>7} " \
           f"{'s/step':>7} {'patch s':>7} {'|d| vs base':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        rep = r["report"]
        dec = rep.get("decision") or {}
        share = dec.get("share_lost")
        adapters = ", ".join(f"{a['name']}" for a in rep["adapters"]) or "-"
        lines.append(
            f"{r['run']:22} {adapters[:38]:38} {rep['mode_requested']:8} {dec.get('chosen', '-'):8} "
            f"{(f'{share:.0%}' if share is not None else '-'):>6} {rep['tier']:8} {rep['fusions']['mounted']:>7} "
            f"{rep['seconds_per_step']:>7.3f} {rep['patch_seconds']:>7.3f} {r['mean_abs_diff_vs_base']:>11.2f}")
    return "\n".join(lines)


def _contact_sheet(sheet, path: Path, per_row: int = 4, scale: int = 2) -> None:
    cell = 64 * scale
    label_h = 18
    w = per_row * cell
    h = len(sheet) * (cell + label_h)
    img = Image.new("RGB", (w, h), (24, 24, 24))
    draw = ImageDraw.Draw(img)
    for i, (label, imgs) in enumerate(sheet):
        y = i * (cell + label_h)
        draw.text((4, y + 2), label, fill=(230, 230, 230))
        for j, a in enumerate(imgs[:per_row]):
            tile = Image.fromarray(a).resize((cell, cell), Image.NEAREST)
            img.paste(tile, (j * cell, y + label_h))
    img.save(path)
