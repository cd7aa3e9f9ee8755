"""bench_quantized.py at --smoke size: every arm runs on each layout (the adapter changes the
output) and a ratio line per layout is printed. Times nothing: no timing assertion."""
import pytest

pytest.importorskip("comfy_kitchen")
from testkit.bench_smoke import run_smoke  # noqa: E402


def test_bench_quantized_smoke_prints_a_line_per_layout():
    out = run_smoke("bench_quantized.py")
    lines = out.strip().splitlines()
    for layout, line in zip(("TensorCoreFP8Layout", "TensorCoreNVFP4Layout"), lines[-2:]):
        assert line.startswith(f"{layout}: base ") and "dyn1 / base" in line and "cast1 / base" in line
