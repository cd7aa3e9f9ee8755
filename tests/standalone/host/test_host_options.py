"""The bundled host's weight dtype is an option given per run (execute_prompt(unet_dtype=...),
options.using, the CLI's --bf16-unet): nothing is written to os.environ, so it ends with
the run; $LORA_RUNTIME_UNET_DTYPE is only the default (issue 14, item 4)."""
import os
from pathlib import Path

import pytest
import torch

from comfyui_lora_runtime.standalone.embedded import require_committed_weights
from comfyui_lora_runtime.standalone.cli import main
from comfyui_lora_runtime.standalone.host import core_nodes, folder_paths, options
from comfyui_lora_runtime.standalone.host.executor import execute_prompt

ROOT = Path(__file__).resolve().parents[3]
SEEN = []


class DtypeProbe:
    """Records the weight dtype UNETLoader would load with, at run time."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tag": ("STRING", {"default": ""})}}
    RETURN_TYPES = ()
    FUNCTION = "go"
    OUTPUT_NODE = True

    def go(self, tag):
        SEEN.append(core_nodes.unet_dtype())
        return {}


NODES = {**core_nodes.CORE_NODE_CLASS_MAPPINGS, "DtypeProbe": DtypeProbe}
PROMPT = {"1": {"class_type": "DtypeProbe", "inputs": {"tag": "x"}}}


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(options.UNET_DTYPE_ENV, raising=False)
    SEEN.clear()


def test_execute_prompt_option_is_scoped_to_the_run(tmp_path):
    execute_prompt(PROMPT, NODES, output_dir=tmp_path, unet_dtype="bf16")
    execute_prompt(PROMPT, NODES, output_dir=tmp_path)
    assert SEEN == [torch.bfloat16, torch.float32]
    assert options.UNET_DTYPE_ENV not in os.environ
    with pytest.raises(ValueError, match="unet_dtype='fp64'"):
        execute_prompt(PROMPT, NODES, output_dir=tmp_path, unet_dtype="fp64")


def test_environment_is_only_the_default(monkeypatch):
    monkeypatch.setenv(options.UNET_DTYPE_ENV, "bf16")
    assert core_nodes.unet_dtype() is torch.bfloat16
    with options.using(unet_dtype="fp32"):
        assert core_nodes.unet_dtype() is torch.float32    # the explicit option wins
    with options.using(unet_dtype=None):
        assert core_nodes.unet_dtype() is torch.bfloat16   # None keeps what is in effect
    monkeypatch.setenv(options.UNET_DTYPE_ENV, "nope")
    with pytest.raises(ValueError, match="LORA_RUNTIME_UNET_DTYPE='nope'"):
        core_nodes.unet_dtype()


@pytest.mark.parametrize("flag,expected", [(["--bf16-unet"], torch.bfloat16), ([], torch.float32)])
def test_cli_passes_the_dtype_without_touching_the_environment(tmp_path, flag, expected):
    wf = tmp_path / "wf.json"
    wf.write_text('{"1": {"class_type": "DtypeProbe", "inputs": {"tag": "x"}}}')
    assert main(["run", str(wf), "--output", str(tmp_path / "out"), *flag], node_classes=NODES) == 0
    assert SEEN == [expected]
    assert options.UNET_DTYPE_ENV not in os.environ
    assert core_nodes.unet_dtype() is torch.float32        # nothing left behind for the next run


def test_unet_loader_loads_in_the_option_dtype():
    name = "tiny_wan_glyphs.safetensors"
    require_committed_weights()  # a checkout without them fails, never skips
    with folder_paths.activated(folder_paths.ModelFolders(models_dir=ROOT / "standalone" / "models")):
        with options.using(unet_dtype="bf16"):
            (bf16,) = core_nodes.UNETLoader().load_unet(name, "default")
        (fp32,) = core_nodes.UNETLoader().load_unet(name, "default")
    assert next(bf16.model.diffusion_model.parameters()).dtype is torch.bfloat16
    assert next(fp32.model.diffusion_model.parameters()).dtype is torch.float32
