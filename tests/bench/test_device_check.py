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
    assert list(parts) == ["env", "tests", "tune", "kernels", "dit", "compile"]
    bad = {k: v.get("error") for k, v in parts.items() if v["status"] != "ok"}
    assert not bad, bad
    assert "collected" in parts["tests"]["summary"] and parts["tests"]["returncode"] == 0
    assert parts["tune"]["buckets"] == 3 * 4 * 2          # 3 FFN shapes x 4 M buckets x 2 ops
    rows = res["kernels_rows"]
    assert len(rows) == 9 and {r["M"] for r in rows} == {512, 4096, 32760}
    assert all(len(r["arms"]) == 3 + 4 * 2 * 2 for r in rows)  # eager, fused, cuBLASLt + ranks x counts x 2
    runs = list(parts["dit"]["runs"].values())
    assert [r["tokens"] for r in runs] == [1530, 32760] and [r["blocks"] for r in runs] == [30, 8]
    assert all(r["batches"] == [1, 2] for r in runs)
    assert len(res["compile_rows"]) == 9 + 3
    table = json.loads((tmp_path / "tuned_dry-run.json").read_text())
    assert len(table["entries"]) == 24
    assert (tmp_path / "device_check.md").read_text().startswith("# Device check")


def test_dry_run_refuses_unknown_parts(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "device_check.py"), "--dry-run", "--out",
                           str(tmp_path), "--parts", "tests,warp"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "unknown part(s) ['warp']" in proc.stderr
