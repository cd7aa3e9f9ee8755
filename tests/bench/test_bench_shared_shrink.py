"""bench_shared_shrink.py at --smoke size: both cases run end to end (their outputs checked
against fp64 and the adapter-off output inside the script), the sibling group serves calls, and
the script ends with its two ratio lines. Times nothing: no timing assertion."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_shared_shrink_smoke_prints_its_ratio_lines():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_shared_shrink.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT / "bench")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert "# qkv shared:" in proc.stdout and "calls served from a sibling's GEMM so far 2" in proc.stdout
    assert "# qkv unshared:" in proc.stdout and "sibling groups 0" in proc.stdout
    assert lines[-2].startswith("added time segmented / per part (sliced): ")
    assert lines[-1].startswith("added time shared / unshared (qkv): ") and float(lines[-1].split(": ")[1]) != 0
