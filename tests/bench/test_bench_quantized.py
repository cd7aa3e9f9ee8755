"""bench_quantized.py at --smoke size: every arm runs on each layout (the adapter changes the
output) and a ratio line per layout is printed. Times nothing: no timing assertion."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("comfy_kitchen")
ROOT = Path(__file__).resolve().parents[2]


def test_bench_quantized_smoke_prints_a_line_per_layout():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_quantized.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    for layout, line in zip(("TensorCoreFP8Layout", "TensorCoreNVFP4Layout"), lines[-2:]):
        assert line.startswith(f"{layout}: base ") and "dyn1 / base" in line and "cast1 / base" in line
