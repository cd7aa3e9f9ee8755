"""Run a bench/ script at its --smoke size, as the bench tests do: asserts it exits 0 and returns
its stdout (the scripts time nothing there; the tests read their lines)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_smoke(script: str, cwd: Path = ROOT, args: tuple[str, ...] = ()) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--smoke", *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout
