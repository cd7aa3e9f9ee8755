"""Run a script in a real ComfyUI's python, with this repo importable as ``comfyui_lora_runtime``.

`run_probe(python, comfy, script, args, work, timeout)` runs ``python script comfy *args`` with the
ComfyUI checkout as cwd and ``work/pk`` (a symlink to this repo) on PYTHONPATH, asserts it exited 0
and printed at least one ``RESULT <json>`` line, and returns those JSON values in order. A `script`
given as text is written to ``work/probe.py`` first.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def run_probe(python: str, comfy, script: "Path | str", args, work: Path, timeout: float) -> list:
    pk = work / "pk"
    pk.mkdir(exist_ok=True)
    link = pk / "comfyui_lora_runtime"
    if not link.exists():
        link.symlink_to(REPO)
    if not isinstance(script, Path):
        (work / "probe.py").write_text(script)
        script = work / "probe.py"
    env = {**os.environ, "PYTHONPATH": str(pk)}
    proc = subprocess.run([python, str(script), str(comfy), *map(str, args)], cwd=str(comfy), env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [json.loads(ln[len("RESULT "):]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return lines
