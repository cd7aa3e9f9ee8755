"""A process of its own for the shared decision cache tests (`python -m testkit.decision_worker ...`).

- ``decide FOLDER ADAPTER [ADAPTER...]``: the tiny Wan-like model (bf16, fixed seed) with the
  adapters at 0.8 in ``auto``, a fresh `DecisionCache` on the disk folder; prints one JSON line:
  the measurement count, the decision and the entry names in the folder.
- ``write FOLDER WORKER ROUNDS``: writes the same entries as every other worker, and entries
  of its own, ROUNDS times; prints the notes `put` returned (none expected).

`spawn(args)` starts one with this interpreter and the pack importable.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SHARED_KEYS = 4


def spawn(args: list[str]) -> subprocess.Popen:
    import comfyui_lora_runtime
    paths = [str(Path(comfyui_lora_runtime.__file__).resolve().parent.parent), str(Path(__file__).resolve().parents[1])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "testkit.decision_worker", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def shared_key(i: int) -> tuple:
    return (("blocks.0.ffn.0", ("cpu", "torch.bfloat16", (64, 32), 123 + i, 456), None), f"digest{i}", 0.8, 4.0, True)


def _decide(folder: str, adapters: list[str]) -> dict:
    import torch

    from comfyui_lora_runtime.lora_runtime import AdapterSpec, DecisionCache, applied, plan
    from comfyui_lora_runtime.lora_runtime.decision.disk_cache import DiskDecisionStore
    from testkit.fixtures import TinyWanLike

    model = TinyWanLike(dtype=torch.bfloat16)
    cache = DecisionCache(disk=DiskDecisionStore(folder))
    specs = [AdapterSpec(a, 0.8) for a in adapters]
    with torch.no_grad(), applied(model, plan(model, specs, "auto"), cache) as report:
        decision = report.decision.to_dict()
    return {"measurements": cache.measurements, "decision": decision, "entries": sorted(os.listdir(folder))}


def _write(folder: str, worker: int, rounds: int) -> dict:
    from comfyui_lora_runtime.lora_runtime.decision.disk_cache import DiskDecisionStore
    store = DiskDecisionStore(folder)
    notes = []
    for r in range(rounds):
        for i in range(SHARED_KEYS):
            notes.append(store.put("share", shared_key(i), 0.25 + i / 100))
        notes.append(store.put("share", ("own", worker, r % 3), worker / 1000))
    return {"notes": [n for n in notes if n], "writes": store.writes}


def main(argv: list[str]) -> None:
    if argv[0] == "decide":
        out = _decide(argv[1], argv[2:])
    elif argv[0] == "write":
        out = _write(argv[1], int(argv[2]), int(argv[3]))
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
