"""bench_switch.py at --smoke size: the script runs end to end (every arm, the bit-exact
check after the rounds) and ends with its ratio line. Times nothing: no timing assertion."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_switch_smoke_prints_its_ratio_line():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_switch.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert "restore bit-exact over every weight after 3 merges: True" in proc.stdout
    assert lines[-3].startswith("dynamic / merge: ")
    assert lines[-2].startswith("swap (restore memory copy) / re-patch: ")
    assert lines[-1].startswith("swap / re-patch: ") and float(lines[-1].split(": ")[1]) > 0
