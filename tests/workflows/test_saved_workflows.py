"""Saved workflows: UI and API formats agree, files are up to date, embedded ones run."""
import json
from pathlib import Path

import pytest

from comfyui_lora_runtime import NODE_CLASS_MAPPINGS
from comfyui_lora_runtime.standalone.host.core_nodes import CORE_NODE_CLASS_MAPPINGS
from comfyui_lora_runtime.standalone.host.workflow_format import detect_format, ui_to_api
from comfyui_lora_runtime.tools import make_workflows as mw

ROOT = Path(__file__).resolve().parents[2]
WF = ROOT / "workflows" / "api"
UI = ROOT / "workflows"


def _stub(class_type, sockets, widgets, outputs):
    """A stand-in class with the INPUT_TYPES shape of a ComfyUI-only node (for UI->API mapping)."""
    req = {n: (t,) for n, t in sockets}
    req.update({w: ("STRING",) for w in widgets})
    return type(class_type, (), {"INPUT_TYPES": classmethod(lambda cls: {"required": req}),
                                 "RETURN_TYPES": tuple(t for _, t in outputs), "FUNCTION": "f"})


CLASSES = {**CORE_NODE_CLASS_MAPPINGS, **NODE_CLASS_MAPPINGS,
           **{k: _stub(k, *v) for k, v in mw.COMFY_ONLY.items()}}
NAMES = sorted(p.name[: -len(".api.json")] for p in WF.glob("*.api.json"))


def test_every_workflow_has_both_formats():
    assert len(NAMES) >= 7
    for n in NAMES:
        assert (UI / f"{n}.json").is_file(), n


@pytest.mark.parametrize("name", NAMES)
def test_ui_converts_to_the_api_file(name):
    ui = json.loads((UI / f"{name}.json").read_text())
    api = json.loads((WF / f"{name}.api.json").read_text())
    assert detect_format(ui) == "ui" and detect_format(api) == "api"
    converted = ui_to_api(ui, CLASSES)
    assert {k: (v["class_type"], v["inputs"]) for k, v in converted.items()} == \
           {k: (v["class_type"], v["inputs"]) for k, v in api.items()}


def test_files_are_generated_from_the_description():
    graphs = mw.graphs()
    assert sorted(graphs) == NAMES
    for name, g in graphs.items():
        assert json.loads((WF / f"{name}.api.json").read_text()) == mw.api_format(g), \
            f"{name}: run python tools/make_workflows.py"
        assert json.loads((UI / f"{name}.json").read_text()) == mw.ui_format(g, CLASSES), name


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("template_")])
def test_templates_name_the_model_files_they_expect(name):
    api = json.loads((WF / f"{name}.api.json").read_text())
    files = [v for node in api.values() for k, v in node["inputs"].items() if k.endswith("_name") and
             isinstance(v, str) and v.endswith(".safetensors")]
    assert len(files) >= 3
    ours = [n for n in api.values() if n["class_type"].startswith("LoraRuntime")]
    assert {n["class_type"] for n in ours} >= {"LoraRuntimeLoadAdapter", "LoraRuntimeSampler"}


def test_stack_workflow_gives_the_chained_loaders_images(tmp_path):
    """embedded_style_stack (LoRA Stack: style on, distilled off) samples exactly what embedded_style
    (one Load LoRA Adapter) does, and not the base model's images (3 steps, 2 images: the graph, not the
    picture, is under test)."""
    import torch
    from comfyui_lora_runtime.standalone.embedded import require_committed_weights
    from comfyui_lora_runtime.standalone.host import folder_paths
    from comfyui_lora_runtime.standalone.host.executor import execute_prompt

    require_committed_weights()
    folders = folder_paths.ModelFolders(output_dir=tmp_path)

    def images(name):
        prompt = json.loads((WF / f"{name}.api.json").read_text())
        prompt["8"]["inputs"]["steps"] = 3
        prompt["7"]["inputs"]["batch_size"] = 2
        res = execute_prompt(prompt, {**CORE_NODE_CLASS_MAPPINGS, **NODE_CLASS_MAPPINGS}, folders=folders)
        return res.outputs["9"][0], res.ui["8"]["lora_report"][0]

    stack, report = images("embedded_style_stack")
    chain, chain_report = images("embedded_style")
    base, _ = images("embedded_base")
    assert torch.equal(stack, chain)
    assert (stack - base).abs().mean() > 1e-3  # the adapter is on
    assert [a["name"] for a in report["adapters"]] == ["glyph_outline_style.safetensors"]  # the off row is left out
    assert report["decision"]["chosen"] == chain_report["decision"]["chosen"]
