"""The main job: the embedded workflows under every merge mode and tier, side by side.

    python -m comfyui_lora_runtime demo [--output output/demo]

Runs the saved API workflows in workflows/api/ on the bundled host with the embedded
tiny Wan 2.1 model stored in bfloat16 (as ComfyUI stores it on a GPU, so merge
rounding is real), then writes into the output folder: every image, a contact sheet
(contact_sheet.png) whose rows say what each run proves, and decisions.json; and
prints a table of the decisions (mode chosen, share a merge would lose, tier,
fusions, time per step), each image's mean absolute difference to its reference
run, and the same "what it proves" line.

The two things the project is about, as pictures:
- the style adapter (an update a merge keeps) under `auto` is merged, and every mode
  and tier gives the same outlined glyphs;
- the distilled few-step adapter (an update below a bf16 ulp) under `auto` stays
  dynamic, so 4 steps at CFG 1 look like the base's 20 steps at CFG 5, while a
  forced merge rounds most of it away and gives the base's blurry 4-step image back.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from .host import folder_paths, progress
from .host.executor import execute_prompt
from .host.workflow_format import set_widget_value

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / "workflows" / "api"
UI_WORKFLOWS = ROOT / "workflows"  # the same graphs in the editor's format
FEW_STEPS = 4  # what the distilled adapter is for: 4 steps at CFG 1
PROMPTS = ("red 2", "green 5", "blue 8", "white 7")  # one digit per colour; each prompt is one execution
BATCH = 2  # images per prompt (seeded noise of the workflow's seed)


@dataclass(frozen=True)
class Run:
    key: str            # short id (file prefix, decisions.json)
    workflow: str       # workflows/api/<workflow>.api.json
    proves: str         # the row's label; {share} and {mad} are filled in from the run
    reference: str      # key of the run its mean |diff| is measured against
    # overrides by node class: {class_type: {input: value}}; node ids are looked up in the workflow
    overrides: dict = field(default_factory=dict)
    share_of: str | None = None  # key of the run whose measured share lost {share} shows (a forced merge measures none)
    why: str = ""       # the sheet's second line: why the row looks as it does, where that is not plain


def _few(mode: str | None = None) -> dict:
    o = {"LoraRuntimeSampler": {"steps": FEW_STEPS, "cfg": 1.0}}
    if mode:
        o["LoraRuntimeMergeMode"] = {"mode": mode}
    return o


RUNS = [
    Run("base", "embedded_base", "base, 20 steps CFG 5: the reference", "base"),
    Run("style_auto", "embedded_style", "style, auto -> merge ({share} lost): outlined", "base"),
    Run("style_merge", "embedded_style", "style, forced merge: same outline", "base",
        {"LoraRuntimeMergeMode": {"mode": "merge"}}),
    Run("style_dynamic", "embedded_style", "style, dynamic: same outline", "base",
        {"LoraRuntimeMergeMode": {"mode": "dynamic"}}),
    Run("style_dyn_exact", "embedded_style", "style, dynamic, tier exact: the reference path", "base",
        {"LoraRuntimeMergeMode": {"mode": "dynamic"}, "LoraRuntimeQualityTier": {"tier": "exact"}}),
    Run("style_dyn_high", "embedded_style", "style, dynamic, tier high: close to exact", "base",
        {"LoraRuntimeMergeMode": {"mode": "dynamic"}, "LoraRuntimeQualityTier": {"tier": "high"}},
        why="on the CPU no kernel is fused (fus 0), so high runs lossless's path: the same images"),
    Run("style_diffusers", "embedded_style_diffusers", "style, diffusers keys: same as kohya keys", "base"),
    Run("base_4", "embedded_base", f"base, {FEW_STEPS} steps CFG 1: blurry", "base", _few()),
    Run("distilled_auto", "embedded_distilled",
        f"distilled, auto -> dynamic (a merge would lose {{share}}): {FEW_STEPS} steps sharper (|d| {{mad}} vs base {FEW_STEPS})",
        "base_4", _few()),
    Run("distilled_merge", "embedded_distilled",
        "distilled, forced merge: {share} rounded away -> blurry again (|d| {mad} vs base 4)", "base_4", _few("merge"),
        share_of="distilled_auto"),
    Run("distilled_half", "embedded_distilled_first_half",
        f"distilled on the first half of the steps only (schedule '0:1, 0.5:0'): auto keeps it dynamic "
        f"(|d| {{mad}} vs base {FEW_STEPS})", "base_4", _few(),
        why=f"a small effect, as expected: the adapter acts on steps 1-2 of {FEW_STEPS} only and steps 3-4 run "
            f"without it (on all {FEW_STEPS} steps: the distilled, auto row)"),
]
LABEL_H = 28  # two text lines above each row of the contact sheet


def _classes() -> dict:
    from .. import NODE_CLASS_MAPPINGS
    from .host.core_nodes import CORE_NODE_CLASS_MAPPINGS
    return {**CORE_NODE_CLASS_MAPPINGS, **NODE_CLASS_MAPPINGS}


def _load(name: str) -> dict:
    return json.loads((WORKFLOWS / f"{name}.api.json").read_text())


def node_id(prompt: dict, class_type: str) -> str:
    """The id of the one node of ``class_type`` in an API prompt (ValueError if none or several)."""
    ids = [nid for nid, node in prompt.items() if node.get("class_type") == class_type]
    if len(ids) != 1:
        raise ValueError(f"expected one {class_type} node in the workflow, found {len(ids)} ({ids})")
    return ids[0]


class DemoProgress:
    """Progress of the main job on a stream (default stderr): a line when a run starts and
    ends, and the sampler's steps of every prompt. On a terminal the step line is redrawn
    in place; otherwise (a pipe, a CI log, a file) every step is its own flushed line, so
    a log shows the job moving."""

    def __init__(self, total_runs: int, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total_runs = total_runs
        self.index = 0
        self.label = ""
        self.t0 = time.perf_counter()

    def _line(self, text: str, *, redraw: bool = False) -> None:
        if self.tty and redraw:
            self.stream.write("\r\x1b[K" + text)
        else:
            self.stream.write(("\r\x1b[K" if self.tty else "") + text + "\n")
        self.stream.flush()

    def run_started(self, run: "Run", steps: int) -> None:
        self.index += 1
        self._line(f"run {self.index}/{self.total_runs} {run.key} ({run.workflow}, {steps} steps, "
                   f"{len(PROMPTS)} prompts x {BATCH} images)")

    def prompt_started(self, i: int, text: str) -> None:
        self.label = f"  run {self.index}/{self.total_runs} prompt {i + 1}/{len(PROMPTS)} '{text}'"

    def __call__(self, value, total, preview=None, node_id=None) -> None:  # the sampler's ProgressBar hook
        self._line(f"{self.label}: step {value}/{total}", redraw=True)

    def run_done(self, run: "Run", seconds: float) -> None:
        self._line(f"run {self.index}/{self.total_runs} {run.key} done in {seconds:.1f} s "
                   f"(job {time.perf_counter() - self.t0:.0f} s)")


def run_one(run: Run, out: Path, classes: dict, folders, steps: int, bar: DemoProgress | None = None) -> dict:
    """Every prompt of PROMPTS through the run's workflow; images in prompt order."""
    files, reports, wall = [], [], 0.0
    if bar is not None:
        bar.run_started(run, steps)
    for i, text in enumerate(PROMPTS):
        if bar is not None:
            bar.prompt_started(i, text)
        prompt = _load(run.workflow)
        ui_wf = json.loads((UI_WORKFLOWS / f"{run.workflow}.json").read_text())
        sampler = node_id(prompt, "LoraRuntimeSampler")
        positive = str(prompt[sampler]["inputs"]["positive"][0])  # the text node feeding the sampler's positive
        latent = str(prompt[sampler]["inputs"]["latent_image"][0])
        slug = run.key + "_" + text.replace(" ", "_")
        changes = {sampler: {"steps": steps}, node_id(prompt, "SaveImage"): {"filename_prefix": slug},
                   positive: {"text": text}, latent: {"batch_size": BATCH}}
        for class_type, values in run.overrides.items():
            changes.setdefault(node_id(prompt, class_type), {}).update(values)
        for nid, values in changes.items():  # to both, so each PNG's workflow reproduces it
            prompt[nid]["inputs"].update(values)
            for name, value in values.items():
                set_widget_value(ui_wf, nid, name, value, classes)
        t0 = time.perf_counter()
        with progress.progress_hook(bar):
            res = execute_prompt(prompt, classes, folders=folders, extra_pnginfo={"workflow": ui_wf},
                                 unet_dtype="bf16")
        wall += time.perf_counter() - t0
        files += res.saved_files()
        reports.append(res.ui[sampler]["lora_report"][0])
    images = np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files])
    if bar is not None:
        bar.run_done(run, wall)
    return {"run": run.key, "workflow": run.workflow, "report": reports[-1],
            "prompts": [t for t in PROMPTS for _ in range(BATCH)],
            "steps": prompt[sampler]["inputs"]["steps"], "cfg": prompt[sampler]["inputs"]["cfg"],
            "files": files, "wall_seconds": wall, "images": images}


def run_demo(output: str | os.PathLike, steps: int = 20, progress_stream=None) -> int:
    """progress_stream: where DemoProgress writes (default stderr)."""
    out = Path(output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    classes = _classes()
    folders = folder_paths.ModelFolders(output_dir=out)
    bar = DemoProgress(len(RUNS), progress_stream)
    rows = []
    for run in RUNS:
        few = run.overrides.get("LoraRuntimeSampler", {}).get("steps")
        rows.append(run_one(run, out, classes, folders, few or steps, bar))
    by_key = {r["run"]: r for r in rows}
    for run, row in zip(RUNS, rows):
        ref = by_key[run.reference]["images"]
        row["reference"] = run.reference
        row["mean_abs_diff_vs_reference"] = float(np.abs(row["images"].astype(np.float64) - ref.astype(np.float64)).mean())
        share = (by_key[run.share_of or run.key]["report"].get("decision") or {}).get("share_lost")
        row["proves"] = run.proves.format(share="-" if share is None else f"{share:.0%}",
                                          mad=f"{row['mean_abs_diff_vs_reference']:.1f}")
    for run, row in zip(RUNS, rows):
        row["note"] = sheet_note(run, row)
    contact_sheet([(r["proves"], r["note"], r["images"]) for r in rows], out / "contact_sheet.png")
    (out / "decisions.json").write_text(json.dumps([{k: v for k, v in r.items() if k != "images"} for r in rows],
                                                   indent=1, default=str))
    print(table(rows))
    print(f"\nimages, contact_sheet.png and decisions.json in {out}")
    return 0


def table(rows) -> str:
    head = f"{'run':16} {'steps':>5} {'cfg':>4} {'mode':8} {'chosen':8} {'lost':>5} {'tier':8} {'fus':>3} " \
           f"{'s/step':>6} {'|d|':>5} {'vs':7} what it proves"
    lines = [head, "-" * len(head)]
    for r in rows:
        rep = r["report"]
        dec = rep.get("decision") or {}
        share = dec.get("share_lost")
        lines.append(
            f"{r['run']:16} {r['steps']:>5} {r['cfg']:>4.1f} {rep['mode_requested']:8} {dec.get('chosen', '-'):8} "
            f"{(f'{share:.0%}' if share is not None else '-'):>5} {rep['tier']:8} {rep['fusions']['mounted']:>3} "
            f"{rep['seconds_per_step']:>6.3f} {r['mean_abs_diff_vs_reference']:>5.1f} {r['reference']:7} {r['proves']}")
    return "\n".join(lines)


def sheet_note(run: Run, row: dict) -> str:
    """The second line of a row: what its |d| is, and why it looks as it does where that is not plain."""
    if run.reference == run.key:
        d = "|d| = mean absolute difference in 0..255 levels, per pixel and channel, to the run named on each row"
    else:
        d = (f"|d| {row['mean_abs_diff_vs_reference']:.1f} = mean absolute difference in 0..255 levels "
             f"vs '{run.reference}'")
    return d + (f"; {run.why}" if run.why else "")


def contact_sheet(sheet, path: Path, per_row: int = 8, scale: int = 2) -> None:
    """One row per run: its label (what it proves) and a note (|d|, why) above its first ``per_row`` images."""
    cell = 64 * scale
    label_h = LABEL_H
    w = per_row * cell
    h = len(sheet) * (cell + label_h)
    img = Image.new("RGB", (w, h), (24, 24, 24))
    draw = ImageDraw.Draw(img)
    for i, (label, note, imgs) in enumerate(sheet):
        y = i * (cell + label_h)
        draw.text((4, y + 2), label, fill=(230, 230, 230))
        draw.text((4, y + 15), note, fill=(160, 160, 160))
        for j, a in enumerate(imgs[:per_row]):
            tile = Image.fromarray(a).resize((cell, cell), Image.NEAREST)
            img.paste(tile, (j * cell, y + label_h))
    img.save(path)
