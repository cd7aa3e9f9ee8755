"""`python -m comfyui_lora_runtime run ...`: exit codes, --set, outputs, PNG metadata."""
import json
import subprocess
import sys

import pytest
import torch

from comfyui_lora_runtime.standalone.cli import main, parse_set, CliError
from comfyui_lora_runtime.standalone.host import progress
from comfyui_lora_runtime.standalone.host.core_nodes import CORE_NODE_CLASS_MAPPINGS
from comfyui_lora_runtime.standalone.host.png_metadata import read_png_metadata


class ToyImage:
    """LATENT [B,16,T,h,w] -> IMAGE [B, h*2, w*2, 3] filled with `level`."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "level": ("FLOAT", {"default": 0.5, "min": 0, "max": 1})}}
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "go"

    def go(self, samples, level):
        b, _, _, h, w = samples["samples"].shape
        if level == 0.25:
            raise RuntimeError("level 0.25 is cursed")
        if level == 0.75:
            raise KeyboardInterrupt
        if level == 1.0:
            progress.interrupt_current_processing()
        return (torch.full((b, h * 2, w * 2, 3), float(level)),)


NODES = {**CORE_NODE_CLASS_MAPPINGS, "ToyImage": ToyImage}

API = {
    "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 48, "length": 1, "batch_size": 2}},
    "7": {"class_type": "ToyImage", "inputs": {"samples": ["4", 0], "level": 0.5}},
    "8": {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": "cli/test"}},
}

UI = {
    "nodes": [
        {"id": 4, "type": "EmptyHunyuanLatentVideo", "mode": 0, "inputs": [],
         "outputs": [{"name": "LATENT", "type": "LATENT", "links": [1]}], "widgets_values": [64, 48, 1, 1]},
        {"id": 7, "type": "ToyImage", "mode": 0, "inputs": [{"name": "samples", "type": "LATENT", "link": 1}],
         "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [2]}], "widgets_values": [0.5]},
        {"id": 8, "type": "SaveImage", "mode": 0, "inputs": [{"name": "images", "type": "IMAGE", "link": 2}],
         "outputs": [], "widgets_values": ["ui"]},
    ],
    "links": [[1, 4, 0, 7, 0, "LATENT"], [2, 7, 0, 8, 0, "IMAGE"]],
}


@pytest.fixture(autouse=True)
def _reset_interrupt():
    progress.interrupt_current_processing(False)
    yield
    progress.interrupt_current_processing(False)


def write(tmp_path, data, name="wf.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def run_cli(tmp_path, data, *extra):
    return main(["run", write(tmp_path, data), "--output", str(tmp_path / "out"),
                 "--models", str(tmp_path / "models"), *extra], node_classes=NODES)


def test_parse_set():
    assert parse_set("5.seed=42") == ("5", "seed", 42)
    assert parse_set("5.name=hello world") == ("5", "name", "hello world")
    assert parse_set('5.name="7"') == ("5", "name", "7")
    assert parse_set("12.cfg=2.5") == ("12", "cfg", 2.5)
    for bad in ("5seed=1", "5.seed", ".seed=1"):
        with pytest.raises(CliError):
            parse_set(bad)


def test_run_api_ok(tmp_path, capsys):
    assert run_cli(tmp_path, API) == 0
    out = capsys.readouterr()
    files = sorted((tmp_path / "out" / "cli").iterdir())
    assert [f.name for f in files] == ["test_00001_.png", "test_00002_.png"]
    assert str(files[0]) in out.out and "[7] ToyImage" in out.err
    meta = read_png_metadata(files[0])
    assert set(meta) == {"prompt"} and meta["prompt"]["7"]["inputs"]["level"] == 0.5


def test_run_ui_with_set_writes_workflow_chunk(tmp_path, capsys):
    assert run_cli(tmp_path, UI, "--set", "7.level=0.2", "--set", "4.width=32") == 0
    [png] = (tmp_path / "out").iterdir()
    from PIL import Image
    img = Image.open(png)
    assert img.size == (8, 12)                       # width 32 -> latent w 4 -> image w 8
    assert img.getpixel((0, 0)) == (51, 51, 51)      # int(255 * 0.2)
    meta = read_png_metadata(png)
    expected = json.loads(json.dumps(UI))            # --set reaches the workflow chunk too
    expected["nodes"][1]["widgets_values"] = [0.2]
    expected["nodes"][0]["widgets_values"] = [32, 48, 1, 1]
    assert meta["workflow"] == expected
    assert meta["prompt"]["7"]["inputs"]["level"] == 0.2


@pytest.mark.parametrize("args,needle", [
    (["--set", "99.level=1"], "no node '99'"),
    (["--set", "7.nope=1"], "has no input 'nope'"),
    (["--set", "7.level=high"], "Failed to convert"),
    (["--set", "4.width=8"], "smaller than min"),
])
def test_bad_overrides_exit_2(tmp_path, capsys, args, needle):
    assert run_cli(tmp_path, API, *args) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_validation_errors_exit_2(tmp_path, capsys):
    bad = json.loads(json.dumps(API))
    bad["8"]["inputs"]["images"] = ["4", 0]
    assert run_cli(tmp_path, bad) == 2
    err = capsys.readouterr().err
    assert "node 8 (SaveImage)" in err and "mismatch" in err
    assert run_cli(tmp_path, {"nodes": "x"}) == 2
    assert run_cli(tmp_path, {"1": {"class_type": "Nope", "inputs": {}}}) == 2
    assert "Nope" in capsys.readouterr().err


def test_run_error_exit_1(tmp_path, capsys):
    bad = json.loads(json.dumps(API))
    bad["7"]["inputs"]["level"] = 0.25
    assert run_cli(tmp_path, bad) == 1
    err = capsys.readouterr().err
    assert "node 7 (ToyImage)" in err and "cursed" in err


@pytest.mark.parametrize("level", [0.75, 1.0])   # Ctrl-C at once / interrupt requested
def test_interrupt_exit_130(tmp_path, capsys, level):
    bad = json.loads(json.dumps(API))
    bad["7"]["inputs"]["level"] = level
    assert run_cli(tmp_path, bad) == 130
    assert "interrupted" in capsys.readouterr().err
    assert not (tmp_path / "out" / "cli").exists()


def test_module_entry_point_subprocess(tmp_path):
    """The real `python -m` entry (no injected nodes): validation failure is exit 2."""
    wf = {"4": API["4"], "8": {"class_type": "SaveImage",
                               "inputs": {"images": ["4", 0], "filename_prefix": "x"}}}
    cmd = [sys.executable, "-m", "comfyui_lora_runtime", "run", write(tmp_path, wf),
           "--output", str(tmp_path / "out"), "--models", str(tmp_path / "models")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "received_type(LATENT) mismatch input_type(IMAGE)" in r.stderr
    r = subprocess.run(cmd + ["--set", "8.images=1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "replaces the link" in r.stderr
    r = subprocess.run(cmd[:4] + ["/nonexistent.json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "cannot read workflow" in r.stderr


def test_sigint_first_requests_interrupt_second_aborts():
    import os
    import signal
    from comfyui_lora_runtime.standalone.cli import _install_sigint
    previous = _install_sigint()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert progress.processing_interrupted()
        with pytest.raises(progress.InterruptProcessingException):
            progress.throw_exception_if_processing_interrupted()
        progress.interrupt_current_processing()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)


class ToyText:
    """A STRING socket (forceInput): the UI workflow has no widget for it."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "text": ("STRING", {"forceInput": True})}}
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "go"

    def go(self, samples, text):
        b, _, _, h, w = samples["samples"].shape
        return (torch.full((b, h * 2, w * 2, 3), 0.5),)


class ToyString:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("STRING", {"default": "a"})}}
    RETURN_TYPES = ("STRING",)
    FUNCTION = "go"

    def go(self, value):
        return (value,)


def test_set_the_ui_workflow_cannot_hold_exits_2(tmp_path, capsys):
    ui = json.loads(json.dumps(UI))
    ui["nodes"][1] = {"id": 7, "type": "ToyText", "mode": 0,
                      "inputs": [{"name": "samples", "type": "LATENT", "link": 1},
                                 {"name": "text", "type": "STRING", "link": 3}],
                      "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [2]}], "widgets_values": []}
    ui["nodes"].append({"id": 9, "type": "ToyString", "mode": 0, "inputs": [],
                        "outputs": [{"name": "STRING", "type": "STRING", "links": [3]}], "widgets_values": ["b"]})
    ui["links"].append([3, 9, 0, 7, 1, "STRING"])
    classes = {**NODES, "ToyText": ToyText, "ToyString": ToyString}
    args = ["run", write(tmp_path, ui), "--output", str(tmp_path / "out"), "--models", str(tmp_path / "models")]
    assert main(args, node_classes=classes) == 0
    assert main(args + ["--set", "7.text=hi"], node_classes=classes) == 2
    err = capsys.readouterr().err
    assert "--set '7.text=hi': cannot write it into the UI workflow" in err and "'text' is not a widget" in err
    assert len(list((tmp_path / "out").iterdir())) == 1   # only the first run's image
