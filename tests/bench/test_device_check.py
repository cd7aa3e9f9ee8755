"""The GPU check's dry run: every part planned and its inputs built on the CPU, so the
script a lent GPU runs in one go cannot rot between GPU sessions."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_device_check_dry_run_plans_every_part(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "device_check.py"), "--dry-run", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "device_check.json").read_text())
    parts = res["parts"]
    assert list(parts) == ["env", "tests", "tune", "kernels", "swap", "quantized", "dit", "compile"]
    # the quantized-bases bench ran at smoke size: a ratio line per layout
    assert [ln.split(":")[0] for ln in parts["quantized"]["lines"]] == ["TensorCoreFP8Layout", "TensorCoreNVFP4Layout"]
    bad = {k: v.get("error") for k, v in parts.items() if v["status"] != "ok"}
    assert not bad, bad
    assert "collected" in parts["tests"]["summary"] and parts["tests"]["returncode"] == 0
    assert parts["tune"]["buckets"] == 3 * 4 * 2          # 3 FFN shapes x 4 M buckets x 2 ops
    rows = res["kernels_rows"]
    assert len(rows) == 9 and {r["M"] for r in rows} == {512, 4096, 32760}
    # eager, cuBLASLt, Triton + 5 LoRA sets x (PEFT, shipped, Triton, K-concat cached/rebuilt, delta first)
    assert all(len(r["arms"]) == 3 + 5 * 6 for r in rows)
    assert {"eager", "cublaslt", "triton", "peft_r32x3", "shipped_r32x3", "kconcat_cached_r16x1",
            "kconcat_rebuilt_r128x1", "delta_first_r64x1"} <= set(rows[0]["arms"])
    # the dry run ran every arm once on a tiny CPU row, with the lossless rule vs fp64 per new path
    smoke = res["kernels_smoke"]
    assert set(smoke["ran"]) == set(rows[0]["arms"]) - {"cublaslt"} and "cuda" in smoke["missing"]["cublaslt"]
    assert {a for a, st in smoke["numerics"].items() if st["ok"]} == {
        "triton", "shipped_r32x3", "triton_r32x3", "kconcat_cached_r32x3", "kconcat_rebuilt_r32x3",
        "delta_first_r32x3"}
    assert all(0.9 < st["vs_base_x_effect"] < 1.1 for a, st in smoke["numerics"].items() if "_r" in a)
    runs = list(parts["dit"]["runs"].values())
    assert [r["tokens"] for r in runs] == [1530, 32760, 32760, 1530] and [r["blocks"] for r in runs] == [30, 8, 2, 30]
    assert [r["batches"] for r in runs] == [[1, 2], [1, 2], [1, 2], [1]]
    assert [(r["dims"], r["dim"], r["compile"]) for r in runs] == [
        ("1.3b", 1536, None), ("1.3b", 1536, None), ("14b", 5120, None), ("1.3b", 1536, "reduce-overhead")]
    assert [r["target"] for r in runs] == [1.15, 1.04, 1.03, 1.15]
    assert runs[3]["arms"] == ["none", "merged", "dynamic", "peft"]
    # the swap bench ran at smoke size and its three ratio lines were read
    assert set(parts["swap"]["ratios"]) == {"dynamic / merge", "swap (restore memory copy) / re-patch",
                                            "swap / re-patch"}
    assert any("restore bit-exact over every weight after 3 merges: True" in ln for ln in parts["swap"]["table"])
    assert len(res["compile_rows"]) == 9 + 3
    table = json.loads((tmp_path / "tuned_dry-run.json").read_text())
    assert len(table["entries"]) == 24
    assert (tmp_path / "device_check.md").read_text().startswith("# Device check")


def test_dry_run_refuses_unknown_parts(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "device_check.py"), "--dry-run", "--out",
                           str(tmp_path), "--parts", "tests,warp"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "unknown part(s) ['warp']" in proc.stderr


def test_the_quantized_part_takes_comfy_kitchen_from_the_carry_when_it_is_not_installed(tmp_path, monkeypatch):
    """The GPU image has no comfy-kitchen: the part unpacks it from the dynamic-VRAM carry onto PYTHONPATH,
    and says where it came from (or that it is absent); nothing else of the carry's site comes along."""
    import importlib.util
    import io
    import tarfile
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import device_check as dc
    finally:
        sys.path.remove(str(ROOT / "bench"))
    carry = tmp_path / "carry"
    carry.mkdir()
    with tarfile.open(carry / "site.tar.xz", "w:xz") as tf:
        for name in ("comfy_kitchen/__init__.py", "comfy_aimdo/__init__.py"):
            data = b"MARK = 1\n"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "comfy_kitchen" else real(n, *a))

    monkeypatch.setattr(dc, "ROOT", tmp_path)
    monkeypatch.setattr(dc, "CARRY", carry / "missing")
    env, why = dc.kitchen_env()
    assert env is dc.ENV and why.startswith("absent")
    monkeypatch.setattr(dc, "CARRY", carry)
    env, why = dc.kitchen_env()
    unpacked = Path(env["PYTHONPATH"].split(":")[-1])
    assert why == "from carry/site.tar.xz" and unpacked.name.startswith("comfy_kitchen_")
    assert [p.name for p in unpacked.iterdir()] == ["comfy_kitchen"]
