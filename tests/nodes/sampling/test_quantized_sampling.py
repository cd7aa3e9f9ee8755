"""A quantized checkpoint (ComfyUI 0.33's format, int8 tensorwise) through the bundled host's
UNETLoader, our Load LoRA Adapter and a stock KSampler: the int8 feed-forward computes ffn.2 from
its weight without calling the layer, the first model call finds it, the adapter is applied at
cast time and the report says so; the stored bytes are the same after the run."""
import pytest
import torch

pytest.importorskip("comfy_kitchen")

from comfyui_lora_runtime.standalone.host import quant_checkpoints  # noqa: E402
from comfyui_lora_runtime.standalone.host.executor import execute_prompt  # noqa: E402
from comfyui_lora_runtime.standalone.host.wan21 import load_wan_checkpoint  # noqa: E402
from comfyui_lora_runtime.nodes import report  # noqa: E402
from testkit.fixtures import write_kohya  # noqa: E402
from testkit.nodes_helpers import CLASSES, Capture, sampling_graph  # noqa: E402
from testkit.refdata import REF  # noqa: E402


@pytest.fixture
def int8_model(models_dir):
    wan = load_wan_checkpoint(REF / "tiny_wan_d128_l2.safetensors")
    q = quant_checkpoints.quantize_model(wan, "TensorWiseINT8Layout")
    quant_checkpoints.save_quantized(models_dir / "diffusion_models" / "tiny_wan_int8.safetensors", q)
    g = torch.Generator().manual_seed(5)
    pairs = {n: (torch.randn(4, m.in_features, generator=g) * 0.3, torch.randn(m.out_features, 4, generator=g) * 0.3)
             for n, m in wan.named_modules() if n.endswith("ffn.2")}
    write_kohya(models_dir / "loras" / "ffn2_only.safetensors", pairs, alpha=4.0)
    return models_dir


def _run(folders, strength: float, mode="dynamic"):
    nodes = {"2": {"class_type": "LoraRuntimeLoadAdapter", "inputs": {
        "model": ["1", 0], "lora_name": "ffn2_only.safetensors", "strength": strength}}}
    p = sampling_graph(nodes, "2", mode=mode, tier="lossless")
    p["1"]["inputs"]["unet_name"] = "tiny_wan_int8.safetensors"
    Capture.seen.clear()
    res = execute_prompt(p, CLASSES, folders=folders)
    return Capture.seen[-1], res.ui["10"]["lora_report"][0]


def test_int8_ffn_adapter_is_applied_at_cast_time_and_reported(int8_model, folders):
    base, r0 = _run(folders, 0.0)   # the adapter off: the base model's output
    assert "ran_check" not in r0
    got, r = _run(folders, 1.0)
    assert (got - base).abs().max() > 1e-3, "the ffn.2 adapter was dropped by the int8 feed-forward"
    handled = {f["layer"]: f["handled"] for f in r.get("ran_check", [])}
    assert handled == {"blocks.0.ffn.2": "applied at cast time", "blocks.1.ffn.2": "applied at cast time"}
    assert "2 adapted layers applied at cast time (blocks.0.ffn.2, blocks.1.ffn.2)" in report.text(r)
    again, r2 = _run(folders, 1.0)  # a later sampling patches them up front and verifies: same result
    assert torch.equal(again, got) and r2["ran_check"] == r["ran_check"]
