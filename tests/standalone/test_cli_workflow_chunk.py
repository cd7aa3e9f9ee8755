"""`run WORKFLOW.ui.json --set ...`: the PNG's workflow chunk carries the overrides too,
so the workflow dropped back in (here: run again as a UI workflow) reproduces the image
(issue 14, item 1). Runs the embedded workflow on the CPU (seconds)."""
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from comfyui_lora_runtime.standalone.cli import default_node_classes, main
from comfyui_lora_runtime.standalone.host.png_metadata import read_png_metadata
from comfyui_lora_runtime.standalone.host.workflow_format import ui_to_api

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / "workflows" / "embedded_style.json"
from comfyui_lora_runtime.standalone.embedded import require_committed_weights

require_committed_weights()  # a checkout without them fails here, never skips


def run(workflow, out, *sets):
    args = ["run", str(workflow), "--output", str(out), "--models", str(ROOT / "standalone" / "models")]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    files = sorted(Path(out).rglob("*.png"))
    assert len(files) == 4  # batch of 4
    return files


def pixels(files):
    return np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files])


def widgets(workflow, node_id):
    return next(n for n in workflow["nodes"] if n["id"] == node_id)["widgets_values"]


def test_set_reaches_the_workflow_chunk_and_it_reproduces_the_image(tmp_path, capsys):
    sets = ("8.seed=4242", "5.text=white 3", "8.steps=3", "7.batch_size=4")
    first = run(WORKFLOW, tmp_path / "a", *sets)
    meta = read_png_metadata(first[0])
    wf, prompt = meta["workflow"], meta["prompt"]

    # the chunks agree: the prompt has the overrides, and so do the widgets
    assert prompt["8"]["inputs"]["seed"] == 4242 and prompt["5"]["inputs"]["text"] == "white 3"
    assert widgets(wf, 8)[:3] == [4242, "fixed", 3]
    assert widgets(wf, 5) == ["white 3"]
    original = json.loads(WORKFLOW.read_text())
    assert widgets(original, 8)[0] == 42 and widgets(original, 5) == ["white 7"]
    converted = ui_to_api(wf, default_node_classes())
    assert {k: v["inputs"] for k, v in converted.items()} == {k: v["inputs"] for k, v in prompt.items()}

    # the workflow chunk, run as a UI workflow with no --set, gives the same images
    chunk = tmp_path / "from_png.ui.json"
    chunk.write_text(json.dumps(wf))
    again = run(chunk, tmp_path / "b")
    assert np.array_equal(pixels(first), pixels(again))
    assert read_png_metadata(again[0])["prompt"] == prompt

    # and the overrides did change the image
    plain = run(WORKFLOW, tmp_path / "c", "8.steps=3")
    assert not np.array_equal(pixels(first), pixels(plain))


def test_set_value_is_written_as_validation_converted_it(tmp_path):
    """A JSON number given for a STRING widget lands as the string the prompt holds."""
    files = run(WORKFLOW, tmp_path, "5.text=7", "8.steps=1", "8.cfg=4")
    meta = read_png_metadata(files[0])
    assert meta["prompt"]["5"]["inputs"]["text"] == "7" and widgets(meta["workflow"], 5) == ["7"]
    assert meta["prompt"]["8"]["inputs"]["cfg"] == 4.0
    assert widgets(meta["workflow"], 8)[3] == 4.0 and isinstance(widgets(meta["workflow"], 8)[3], float)
