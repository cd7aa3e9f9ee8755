"""The report's text (log, CLI) leads each adapter line with what a cut line must keep: the layer
count and the decision, then the file name (a long one whole here: a log is not cut)."""
from comfyui_lora_runtime.nodes import report

NAME = "glyph_outline_style_diffusers_rank32_epoch0100.safetensors"


def _report(adapters, decisions):
    return {"host": "comfyui", "tier": "lossless", "mode_requested": "auto",
            "decision": {"chosen": "merge", "reason": "merged", "share_lost": 0.0, "adapters": decisions},
            "adapters": adapters, "params": [], "fusions": {"mounted": 0, "sites": [], "skipped": 0,
                                                             "skip_reasons": []},
            "patch_seconds": 0.1, "seconds_per_step": 0.02}


def test_adapter_lines_put_layer_count_and_decision_before_the_file():
    a = {"name": NAME, "strength": 1.0, "coverage": {"matched": 32, "file_layers": 32, "format": "kohya"},
         "decision": {"name": NAME, "chosen": "merge", "share_lost": 0.0}}
    b = {"name": "b.safetensors", "strength": 0.5,
         "coverage": {"matched": 30, "file_layers": 32, "unmatched": 2, "unmatched_tensors": 4},
         "decision": {"name": "b.safetensors", "chosen": "dynamic", "share_lost": 0.9}}
    lines = report.text(_report([a, b], [a["decision"], b["decision"]])).splitlines()
    assert lines[1] == f"  32/32 layers, merge (a merge would lose 0.0%): {NAME} x1.0 (kohya)"
    assert lines[2] == ("  30/32 layers, 2 layers or keys (4 tensors) not loaded, dynamic (a merge would lose "
                        "90.0%): b.safetensors x0.5")


def test_an_adapter_without_its_own_decision_says_its_layers_first():
    a = {"name": "c.safetensors", "strength": 0.8, "coverage": {"matched": 4, "file_layers": 4}}
    lines = report.text(_report([a], [])).splitlines()
    assert lines[1] == "  4/4 layers: c.safetensors x0.8"


def test_fused_calls_are_named_by_the_backend_they_ran():
    r = _report([], [])
    r["fusions"] = {"mounted": 2, "skipped": 0, "skip_reasons": [], "sites": [
        {"site": "blocks.0.ffn", "fusions": ["linear_gelu_tanh"], "routes": {"base_fused": 3, "lora_fused": 5},
         "ran": {"base_fused:cublaslt": 3, "lora_fused:triton": 5}},
        {"site": "blocks.1.ffn", "fusions": ["linear_gelu_tanh"], "routes": {"lora_fused": 4},
         "ran": {"lora_fused:triton": 2, "lora_fused:delta_first": 2}}]}
    lines = report.text(r).splitlines()
    assert "  fused calls by backend: triton 7, cublaslt 3, delta_first 2" in lines
    r["fusions"]["sites"] = [{"site": "s", "fusions": ["x"]}]  # an older report: no per-backend counts
    assert not any("by backend" in ln for ln in report.text(r).splitlines())


def test_layers_with_a_comfyui_patch_beside_ours_are_counted_and_named():
    from comfyui_lora_runtime.nodes import lifecycle
    refusals = {f"blocks.{i}.ffn.0": lifecycle.COMFY_PATCHED for i in range(6)}
    hp = report.host_patched_entry(refusals, {"a.safetensors": [f"blocks.{i}.ffn.0" for i in range(8)],
                                              "b.safetensors": ["blocks.0.ffn.0", "blocks.7.ffn.0"]})
    assert hp["layers"] == 6 and hp["per_adapter"] == {"a.safetensors": 6, "b.safetensors": 1}
    a = {"name": "a.safetensors", "strength": 1.0, "coverage": {"matched": 8, "file_layers": 8}}
    r = {**_report([a], []), "host_patched": {k: v for k, v in hp.items() if k != "per_adapter"}}
    assert ("  6 adapted layers carry a ComfyUI patch beside ours (blocks.0.ffn.0, blocks.1.ffn.0, blocks.2.ffn.0, "
            "blocks.3.ffn.0 and 2 more): ComfyUI applies its patch to the weight, ours stays dynamic on top"
            ) in report.text(r).splitlines()
    assert report.host_patched_entry({}, {"a.safetensors": ["x"]})["layers"] == 0
