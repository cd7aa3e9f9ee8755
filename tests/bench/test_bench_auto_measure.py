"""bench_auto_measure.py at --smoke size runs and prints its ratio line. Times nothing."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_auto_measure_smoke_prints_its_ratio():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_auto_measure.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("auto measurement / merge: ") and float(last.split(": ")[1]) > 0
