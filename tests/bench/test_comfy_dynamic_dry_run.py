"""The dynamic-VRAM device part's dry run, in CI: ``device_check.py --dry-run --parts comfy_dynamic`` runs
bench/comfy_dynamic/device_run.py's whole plan on the bundled host (CPU, no ComfyUI, no network: the
carry's plan is checked against recorded sizes, nothing is downloaded), so the script a GPU runs in one
go cannot rot between GPU sessions. What the dry run stands in for is in device_run.py's docstring.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARMS = ["base", "base_twice", "comfy", "comfy_again"] + [f"ours_{m}_{t}{a}" for m in ("auto", "merge", "dynamic")
                                           for t in ("lossless", "exact") for a in ("", "_again")] + \
       ["base_again", "ours_midrun"]


def test_the_dry_run_plans_and_runs_every_variant_and_arm(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "device_check.py"), "--dry-run", "--parts",
                           "comfy_dynamic", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "device_check.json").read_text())
    parts = res["parts"]
    assert list(parts) == ["env", "comfy_dynamic"], list(parts)
    part = parts["comfy_dynamic"]
    assert part["status"] == "ok", part.get("error")
    plan = part["carry_plan"]
    assert plan["plan"] and plan["standins_present"] and plan["size"]["ok"], plan
    assert plan["wheels"] == ["comfy-kitchen==0.2.31", "comfy-aimdo==0.4.13", "torchsde==0.2.6", "trampoline==0.1.2"]
    run = part["run"]
    assert run["dry_run"] and run["comfyui"] == "none (bundled host)" and run["rank"] == 32
    assert [v["variant"] for v in run["variants"]] == ["bf16", "fp8", "nvfp4"]
    for v in run["variants"]:
        name = v["variant"]
        assert "error" not in v and "skipped" not in v, v
        assert list(v["arms"]) == ARMS, (name, list(v["arms"]))
        a = v["arms"]
        assert v["weights_hash_unchanged"] and not v["weights_changed_at_end"], name
        assert not v["changed_at_end_beyond_the_host_alone"] and not v["changed_by_the_host_alone"], name
        assert a["base_twice"]["same_bits"] and a["comfy_again"]["same_bits"], name
        assert a["comfy"]["vs_base_psnr"] < 60, (name, a["comfy"])     # the LoRA changes the output
        for label, arm in a.items():
            assert arm["per_step"] is not None and arm["per_step"] > 0, (name, label)
            if label.startswith("ours_") and not label.endswith(("_again", "midrun")):
                assert arm["applies"] == 1 and arm["report"]["chosen"] in ("merge", "dynamic"), (name, label, arm)
                assert arm["vs_base_psnr"] < 60, (name, label)
                # ours vs the stand-in for ComfyUI's LoRA (our exact merge): dynamic within rounding, merge equal
                assert arm["vs_comfy_psnr"] > 35, (name, label, arm["vs_comfy_psnr"])
            if label.endswith("_again") and label.startswith("ours_"):
                assert arm["applies"] == 0 and arm["report"]["kept"] and arm["same_bits"], (name, label, arm)
        assert a["base_again"]["same_bits"] and a["base_again"]["applies"] == 0, (name, a["base_again"])
        mid = a["ours_midrun"]
        assert mid["events"]["partial_unload"]["stand_in"] == "unload_all_models", mid
        assert mid["same_bits_as_undisturbed"] and mid["vs_undisturbed_psnr"] == math.inf, mid
    md = (tmp_path / "comfy_dynamic" / "comfy_dynamic.md").read_text()
    assert md.startswith("# ComfyUI none (bundled host) dynamic VRAM") and "| ours_midrun |" in md
    assert "ComfyUI dynamic VRAM: ours vs ComfyUI's LoRA" in (tmp_path / "device_check.md").read_text()


def test_the_carry_plan_needs_no_network_and_fits(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "comfy_dynamic" / "build_carry.py"), "--plan"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    plan = json.loads(proc.stdout[proc.stdout.index("{"):])
    s = plan["size"]
    assert s["total_bytes"] == s["carry_bytes"] + s["working_tree_bytes"] <= s["limit_bytes"] == 64 * 2 ** 20
    assert plan["dropped"] == ["comfy_kitchen/backends/hip/_C"] and plan["standins"] == ["av"]


def test_the_pyav_stand_in_imports_like_pyav_and_refuses_any_use():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import av; "
            "from av.container import InputContainer; from av.video.reformatter import ColorPrimaries, ColorRange; "
            "x = ColorPrimaries.BT709; t = av.AudioStream | av.VideoStream; assert av.STAND_IN\n"
            "try:\n    av.open('x.mp4')\nexcept RuntimeError as e:\n    print('REFUSED', e)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT / "bench" / "comfy_dynamic" / "standins")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED av.open: PyAV is not installed here" in proc.stdout
