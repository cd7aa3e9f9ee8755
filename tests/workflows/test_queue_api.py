"""workflows/api/queue_api.py prints what the merge mode decided (issue 14, item 3): fed the
LoRA Sampler's report dicts as /history returns them; no server needed."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "workflows" / "api" / "queue_api.py"
spec = importlib.util.spec_from_file_location("queue_api", SCRIPT)
queue_api = importlib.util.module_from_spec(spec)
spec.loader.exec_module(queue_api)


def report(requested, chosen, share, reason, **extra):
    decision = {"requested": requested, "chosen": chosen, "share_lost": share, "reason": reason,
                "layers": 40, "cached": False, "threshold": 0.5,
                "adapters": [{"name": "style.safetensors", "chosen": chosen, "share_lost": share,
                              "reason": reason, "layers": 40, "cached": False}], **extra}
    return {"host": "comfyui", "mode_requested": requested, "tier": "lossless", "decision": decision,
            "adapters": [{"name": "style.safetensors", "strength": 1.0, "layers": 40,
                          "coverage": {"matched": 40, "file_layers": 40, "unmatched": 0},
                          "decision": decision["adapters"][0]}]}


@pytest.mark.parametrize("rep,first", [
    (report("dynamic", "dynamic", None, "dynamic mode never touches the weights"),
     "node 8: mode dynamic -> dynamic (dynamic mode never touches the weights), tier lossless"),
    (report("merge", "merge", None, "merge mode folds every adapter into the weights"),
     "node 8: mode merge -> merge (merge mode folds every adapter into the weights), tier lossless"),
    (report("auto", "merge", 0.0078, "merged: a merge rounds away 1% of its update (<= 50%)"),
     "node 8: mode auto -> merge: a merge would lose 0.8% (merged: a merge rounds away 1% of its update "
     "(<= 50%)), tier lossless"),
    (report("auto", "dynamic", 0.9496, "stays unmerged: merging into the base weights would round away 95% "
                                       "of its update (> 50%)"),
     "node 8: mode auto -> dynamic: a merge would lose 95.0% (stays unmerged: merging into the base weights "
     "would round away 95% of its update (> 50%)), tier lossless"),
])
def test_report_says_what_the_mode_decided(rep, first):
    lines = queue_api.report_lines("8", rep)
    assert lines[0] == first
    assert "None" not in "\n".join(lines)
    assert lines[1].startswith("  style.safetensors x1.0: 40/40 layers; " + rep["decision"]["chosen"])


def test_kept_dynamic_and_no_adapter():
    rep = report("merge", "merge", None, "merge mode folds every adapter into the weights; 2 layers stay "
                 "dynamic (the host patches it)", kept_dynamic=2, kept_dynamic_reason="the host patches it",
                 kept_dynamic_examples=["blocks.0.q", "blocks.0.k"])
    lines = queue_api.report_lines("8", rep)
    assert lines[1] == "  2 layers kept dynamic: the host patches it"
    empty = {"host": "comfyui", "mode_requested": "auto", "tier": "exact", "decision": None, "adapters": []}
    assert queue_api.report_lines("8", empty) == ["node 8: mode auto -> no adapter, tier exact"]


def test_still_runs_as_a_script():
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--server" in r.stdout


def test_real_reports_from_the_bundled_host(tmp_path):
    """The report the LoRA Sampler really returns (the embedded workflows, bf16 weights)."""
    import json

    from comfyui_lora_runtime import NODE_CLASS_MAPPINGS
    from comfyui_lora_runtime.standalone.embedded import require_committed_weights
    from comfyui_lora_runtime.standalone.host.core_nodes import CORE_NODE_CLASS_MAPPINGS
    from comfyui_lora_runtime.standalone.host.executor import execute_prompt

    api_dir = SCRIPT.parent
    require_committed_weights()  # a checkout without them fails, never skips
    classes = {**CORE_NODE_CLASS_MAPPINGS, **NODE_CLASS_MAPPINGS}

    def first_line(workflow, mode):
        prompt = json.loads((api_dir / f"{workflow}.api.json").read_text())
        prompt["8"]["inputs"]["steps"] = 1
        prompt["7"]["inputs"]["batch_size"] = 1
        prompt["3"]["inputs"]["mode"] = mode
        res = execute_prompt(prompt, classes, output_dir=tmp_path, unet_dtype="bf16")
        return queue_api.report_lines("8", res.ui["8"]["lora_report"][0])[0]

    assert first_line("embedded_style", "dynamic") == \
        "node 8: mode dynamic -> dynamic (dynamic mode never touches the weights), tier lossless"
    line = first_line("embedded_distilled", "auto")
    assert line.startswith("node 8: mode auto -> dynamic: a merge would lose 9") and "stays unmerged" in line
