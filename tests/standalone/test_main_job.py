"""Acceptance on the main job's own outputs (`python -m comfyui_lora_runtime demo`).

The main job runs once per module; every figure below is read from the images it saved,
the decisions it wrote and the table it printed, and each is also checked against the
wrong answer (adapter off, forced merge, shifted labels).

The figures: base samples right (judge >= 95 % digit and colour); the style adapter gives
outlined glyphs (>= 95 %); the distilled adapter under `auto` stays dynamic (a merge would
lose >= 80 % of its update) and at 4 steps, CFG 1 gives glyphs the judge reads (>= 90 %)
that differ from the base's 4-step ones (mean |diff| >= 4 levels, measured 5.4; issue 10
asked for 10, but the base's own 20-step CFG-5 images are only 6.8 levels from its 4-step
ones, so no adapter heading for them can give 10 here, and a whole glyph against a black
image is 8.4 levels; see standalone/models/MODEL_CARD.md) and are closer to the base's 20-step CFG-5
ones; where the glyph is, they differ by >= 20 levels (measured 24.4); a forced merge gives
back images close to the base's 4-step ones.
"""
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
from comfyui_lora_runtime.standalone.embedded import require_committed_weights

require_committed_weights()  # a checkout without them fails here, never skips

from comfyui_lora_runtime.standalone import demo  # noqa: E402
from comfyui_lora_runtime.standalone import embedded as E  # noqa: E402
from comfyui_lora_runtime.standalone.embedded import data as D  # noqa: E402
from comfyui_lora_runtime.standalone.embedded.judge import GlyphJudge  # noqa: E402


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    capture = pytest.MonkeyPatch()
    printed = []
    progress_log = io.StringIO()  # not a terminal: every line must still come, one per step
    capture.setattr("builtins.print", lambda *a, **k: printed.append(" ".join(str(x) for x in a)))
    try:
        assert demo.run_demo(out, progress_stream=progress_log) == 0
    finally:
        capture.undo()
    rows = {r["run"]: r for r in json.loads((out / "decisions.json").read_text())}
    images = {k: np.stack([np.asarray(Image.open(f).convert("RGB")) for f in r["files"]]) for k, r in rows.items()}
    return {"out": out, "rows": rows, "images": images, "printed": "\n".join(printed),
            "progress": progress_log.getvalue()}


@pytest.fixture(scope="module")
def judge():
    return GlyphJudge.load(E.JUDGE)


def labels(row):
    words = [p.split() for p in row["prompts"]]
    return (torch.tensor([D.DIGITS.index(w[1]) for w in words]),
            torch.tensor([D.COLOUR_NAMES.index(w[0]) for w in words]))


def verdict(judge, job, key):
    return judge(torch.from_numpy(job["images"][key]).float() / 255.0)


def acc(pred, want):
    return float((pred == want).float().mean())


def mad(a, b):
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


def mad_where_lit(a, b, level=32):
    """Mean |diff| over the pixels lit above ``level`` in either image (where the glyph is)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    lit = np.maximum(a.max(-1), b.max(-1)) > level
    return float(np.abs(a - b).mean(-1)[lit].mean())


def test_every_run_and_prompt_ran(job):
    assert [r.key for r in demo.RUNS] == list(job["rows"])
    for key, imgs in job["images"].items():
        assert imgs.shape == (len(demo.PROMPTS) * demo.BATCH, 64, 64, 3), key


def test_base_samples_are_right(job, judge):
    d, c = labels(job["rows"]["base"])
    v = verdict(judge, job, "base")
    assert acc(v.digit, d) >= 0.95 and acc(v.colour, c) >= 0.95
    # wrong answer: the same verdicts against shifted labels
    assert acc(v.digit, (d + 1) % 10) <= 0.2 and acc(v.colour, (c + 1) % 4) <= 0.2


def test_style_adapter_outlines_and_merges(job, judge):
    d, c = labels(job["rows"]["style_auto"])
    v = verdict(judge, job, "style_auto")
    # 8 images here; the >= 95 % figure is measured on 80 in tests/standalone/embedded (100 %). The judge
    # also reads some CFG-5 base glyphs with colour fringes as outlined (6 % of 80; here 3 of 8)
    outlined, base_outlined = float(v.outlined.float().mean()), float(verdict(judge, job, "base").outlined.float().mean())
    assert outlined >= 0.85 and outlined - base_outlined >= 0.5, (outlined, base_outlined)
    assert acc(v.colour, c) >= 0.95
    dec = job["rows"]["style_auto"]["report"]["decision"]
    assert dec["chosen"] == "merge" and dec["share_lost"] < 0.5
    # wrong answer: without the adapter the images differ visibly
    assert mad(job["images"]["style_auto"], job["images"]["base"]) >= 15.0
    # every mode and tier gives the same outline: merge vs dynamic within lossless
    for key in ("style_merge", "style_dynamic", "style_dyn_exact", "style_dyn_high", "style_diffusers"):
        assert mad(job["images"][key], job["images"]["style_auto"]) <= 1.0, key
    assert np.array_equal(job["images"]["style_diffusers"], job["images"]["style_auto"])  # both auto -> merge


def test_distilled_auto_stays_dynamic_and_gives_sharp_glyphs_in_4_steps(job, judge):
    row = job["rows"]["distilled_auto"]
    assert row["steps"] == demo.FEW_STEPS == 4 and row["cfg"] == 1.0
    dec = row["report"]["decision"]
    assert dec["chosen"] == "dynamic" and dec["share_lost"] >= 0.8
    d, c = labels(row)
    v = verdict(judge, job, "distilled_auto")
    assert acc(v.digit, d) >= 0.9 and acc(v.colour, c) >= 0.9
    few, dist, ref = job["images"]["base_4"], job["images"]["distilled_auto"], job["images"]["base"]
    assert mad(dist, few) >= 4.0  # measured 5.4 (issue 10 asked 10: see the module docstring); the bolder strokes show on the sheet
    # towards what the base needs 20 steps at CFG 5 for: closer to it than the base's 4 steps
    assert mad(dist, ref) < 0.95 * mad(few, ref)  # measured 6.0 vs 6.8
    # where the glyph is (17 % of the pixels), the effect is plain to see
    assert mad_where_lit(dist, few) >= 20.0  # measured 24.4


def test_a_forced_merge_rounds_the_distilled_adapter_away(job, judge):
    row = job["rows"]["distilled_merge"]
    dec = row["report"]["decision"]
    assert dec["requested"] == "merge" and dec["chosen"] == "merge"
    few, dist, merged = (job["images"][k] for k in ("base_4", "distilled_auto", "distilled_merge"))
    assert job["rows"]["distilled_auto"]["report"]["decision"]["share_lost"] >= 0.8  # measured by auto
    kept = mad(merged, few) / mad(dist, few)  # share of the visible effect a merge keeps
    assert kept <= 0.4, kept  # measured 0.24: what remains is noise from the few entries that cross an ulp
    # the merge is closer to the base at 4 steps than to the adapter's dynamic result (1.3 vs 4.4)
    assert mad(merged, few) < 0.5 * mad(dist, merged)
    assert mad_where_lit(merged, few) <= 0.4 * mad_where_lit(dist, few)  # measured 6.6 vs 24.4


def test_sheet_and_table_say_what_each_row_proves(job):
    printed = job["printed"]
    for row in job["rows"].values():
        assert row["proves"] in printed
    assert "distilled, auto -> dynamic" in job["rows"]["distilled_auto"]["proves"]
    assert "4 steps sharper" in job["rows"]["distilled_auto"]["proves"]
    assert "rounded away -> blurry" in job["rows"]["distilled_merge"]["proves"]
    share = job["rows"]["distilled_auto"]["report"]["decision"]["share_lost"]
    assert f"{share:.0%} rounded away" in job["rows"]["distilled_merge"]["proves"]
    sheet = Image.open(job["out"] / "contact_sheet.png")
    assert sheet.size[1] == len(demo.RUNS) * (128 + demo.LABEL_H)


def test_committed_contact_sheet_is_what_the_main_job_writes(job):
    new = np.asarray(Image.open(job["out"] / "contact_sheet.png").convert("RGB"))
    committed = np.asarray(Image.open(ROOT / "docs" / "contact_sheet.png").convert("RGB"))
    assert committed.shape == new.shape
    # Same code, same weights: bit-identical on the CPU type that wrote it, but another CPU type
    # sums in another order and 20 steps at CFG 5 grow that: measured up to 0.70 per row (0.44
    # overall) between two x86 machines. A stale sheet (the previous weights) differs by
    # 1.2-9.7 per row (6.2 overall), so each row band (label strip + images) must be within 1.
    band = new.shape[0] // len(demo.RUNS)  # one label strip + one row of images per run
    per_row = [mad(committed[i:i + band], new[i:i + band]) for i in range(0, new.shape[0], band)]
    assert max(per_row) <= 1.0, per_row


def test_progress_per_run_and_per_step_when_not_a_terminal(job):
    lines = job["progress"].splitlines()
    assert "\r" not in job["progress"] and "\x1b" not in job["progress"]  # no terminal redraws in a log
    n = len(demo.RUNS)
    for i, run in enumerate(demo.RUNS, 1):
        steps = job["rows"][run.key]["steps"]
        assert any(l.startswith(f"run {i}/{n} {run.key} ({run.workflow}, {steps} steps") for l in lines), run.key
        assert any(re.match(rf"run {i}/{n} {run.key} done in [0-9.]+ s", l) for l in lines), run.key
        for p, text in enumerate(demo.PROMPTS, 1):
            got = [l for l in lines if l.startswith(f"  run {i}/{n} prompt {p}/{len(demo.PROMPTS)} '{text}': step ")]
            assert got == [f"  run {i}/{n} prompt {p}/{len(demo.PROMPTS)} '{text}': step {s}/{steps}"
                           for s in range(1, steps + 1)], (run.key, text)


def test_sheet_notes_say_what_d_is_and_why_rows_look_as_they_do(job):
    rows = job["rows"]
    for key, row in rows.items():
        assert "mean absolute difference in 0..255 levels" in row["note"], key
        if key != "base":
            assert f"|d| {row['mean_abs_diff_vs_reference']:.1f}" in row["note"] and f"vs '{row['reference']}'" in row["note"]
    # the half-schedule row: a smaller effect than the adapter on every step, and the note says why
    few = job["images"]["base_4"]
    assert mad(job["images"]["distilled_half"], few) < 0.5 * mad(job["images"]["distilled_auto"], few)  # 1.0 vs 5.4
    assert "steps 1-2 of 4 only" in rows["distilled_half"]["note"]
    # high and lossless: the same images where no kernel is fused (the CPU), and the note says so
    if all(r["report"]["fusions"]["mounted"] == 0 for r in rows.values()):
        assert np.array_equal(job["images"]["style_dyn_high"], job["images"]["style_dynamic"])
        assert "high runs lossless's path" in rows["style_dyn_high"]["note"]
