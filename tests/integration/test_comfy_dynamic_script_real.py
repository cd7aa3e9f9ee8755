"""The dynamic-VRAM device run's ComfyUI code path, on a CPU: ``bench/comfy_dynamic/device_run.py --comfyui
COMFYUI_DIR --tiny`` runs real ComfyUI's UNETLoader, its own LoRA loader, its sampler and its unload, and
our nodes, through every arm of the GPU plan at tiny dims (bf16, fp8 and nvfp4 bases). Dynamic VRAM is off
here (comfy-aimdo needs a CUDA device) and the results say so; what this proves is that the script the GPU
runs in one go works against ComfyUI's own code, beyond the bundled-host dry run in CI (it found ComfyUI
0.33's progress throttle, which kept the mid-run unload from ever firing). ComfyUI 0.3.64 has no
``comfy.quant_ops`` (the quantized variants): skipped there."""
from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "comfy_dynamic" / "device_run.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory, comfy_checkout):
    comfy, python = comfy_checkout
    if not (Path(comfy) / "comfy" / "quant_ops.py").is_file():
        pytest.skip("this ComfyUI has no comfy.quant_ops (0.33+): the device run's quantized variants need it")
    out = tmp_path_factory.mktemp("comfy_dynamic_script")
    proc = subprocess.run([python, str(SCRIPT), "--comfyui", str(comfy), "--tiny", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "comfy_dynamic.json").read_text()), (out / "comfy_dynamic.md").read_text()


def test_every_variant_and_arm_runs_on_real_comfyui(run):
    res, md = run
    assert res["pack_host"] == "comfyui" and res["comfyui"] and res["dynamic_vram"].startswith("off: ")
    assert f"Dynamic VRAM: {res['dynamic_vram']}" in md      # the table says dynamic VRAM was off
    assert [v["variant"] for v in res["variants"]] == ["bf16", "fp8", "nvfp4"]
    for v in res["variants"]:
        assert "error" not in v and "skipped" not in v, v
        a = v["arms"]
        assert a["comfy"]["vs_base_psnr"] < 60, v["variant"]          # ComfyUI's LoRA changes the output
        for mode in ("auto", "merge", "dynamic"):
            for tier in ("lossless", "exact"):
                ours = a[f"ours_{mode}_{tier}"]
                # ours vs ComfyUI's LoRA: the same adapter (merge: the same bits on a plain base), not the base
                assert ours["vs_comfy_psnr"] > 30 and ours["vs_base_psnr"] < 60, (v["variant"], mode, tier, ours)
                again = a[f"ours_{mode}_{tier}_again"]
                assert again["applies"] == 0 and again["same_bits"], (v["variant"], mode, tier, again)
        assert a["base_twice"]["same_bits"] and a["comfy_again"]["same_bits"] and a["base_again"]["same_bits"]
        mid = a["ours_midrun"]
        # the hook fired at step 2 (every step reaches it), a second model ran, ours was unloaded in part
        part = mid["events"]["partial_unload"]
        assert part["loaded_after"] < part["loaded_before"], part
        assert mid["same_bits_as_undisturbed"] and mid["vs_undisturbed_psnr"] == math.inf
        assert v["weights_hash_unchanged"] and not v["weights_changed_at_end"], v["variant"]
