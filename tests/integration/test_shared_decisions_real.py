"""Two real ComfyUI workers share the ``auto`` merge decision through a folder (CPU).

Two ComfyUI servers on 127.0.0.1 (their own base directories, models and adapter files: the
same bytes) start with ``LORA_RUNTIME_DECISION_CACHE_DIR`` naming one folder, as workers
behind one queue that share a disk. The same prompt (the reference tiny Wan, Load LoRA
Adapter 0.8 -> Merge Mode ``auto`` -> Quality Tier ``exact`` -> KSampler -> SaveLatent, the
LoRA Runtime Report, and a KSampler on the bare model: the wrong answer) runs on the first
server, which measures the adapter and writes the entry, then on the second, whose first
prompt measures nothing (``decision.measured`` 0, ``shared_cache`` 1 in its report) and
saves the same latent bit for bit. Then the entry is truncated, the second server drops its
models and cached outputs (``/free``), and the prompt runs again: the entry is ignored, the
adapter measured again, the report says so, and the latent is still the same; the entry is
whole again afterwards.

On the first server, the loader's identity follows the file: the identical prompt again comes
from ComfyUI's cache (the loader does not run), the file rewritten under its name runs the
loader and the sampler again (another latent, measured anew), and the first file's bytes
under a new name run the loader but measure nothing.

Printed, not asserted: each server's first-use seconds (the prompt's wall time, and the
report's patch seconds, which hold the measurement).
"""
from __future__ import annotations

import json
import shutil
import time

import pytest
from testkit.comfyui.server import ComfyServer, comfyui_dir, comfyui_python, free_port, prepare_base, skip_reason
from testkit.comfyui.prompts import latent_of
from testkit.lora_assets import PromptGraph, install_model_and_lora, write_kohya_lora

ENV = "LORA_RUNTIME_DECISION_CACHE_DIR"
LORA = "it_shared_decision.safetensors"
SETTINGS = {"seed": 7, "steps": 3, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple"}


@pytest.fixture(scope="module")
def workers(tmp_path_factory, reference):
    comfy_dir = comfyui_dir()
    if comfy_dir is None:
        pytest.skip(skip_reason())
    folder = tmp_path_factory.mktemp("shared-decisions")
    servers = []
    try:
        for i in range(2):
            base = prepare_base(tmp_path_factory.mktemp(f"comfyui-worker{i}"), reference)
            s = ComfyServer(comfy_dir, comfyui_python(comfy_dir), base, free_port(), env={ENV: str(folder)})
            servers.append(s)
            install_model_and_lora(s, reference, LORA, seed=3601)
            if servers[0] is not s:  # the same bytes (safetensors may order a header's metadata either way)
                shutil.copyfile(servers[0].loras_dir / LORA, s.loras_dir / LORA)
            s.start()
        yield folder, servers
    finally:
        for s in servers:
            s.stop()


def _prompt(comfy, tag: str) -> PromptGraph:
    g = PromptGraph(comfy.helper_cond_class, "shared_decisions", tag, SETTINGS, 0.8)
    g.ours("8", LORA, "auto", tier="exact")
    g.ksampler("9", ["1", 0])  # the bare model
    return g


def _run(comfy, tag: str):
    t0 = time.perf_counter()
    lat, reps = _prompt(comfy, tag).run(comfy, require_ran=True)
    return lat, reps["8"], time.perf_counter() - t0


def test_second_worker_measures_nothing_and_matches_bit_for_bit(workers):
    folder, (first, second) = workers
    assert first.loras_dir.joinpath(LORA).read_bytes() == second.loras_dir.joinpath(LORA).read_bytes()

    lat1, rep1, wall1 = _run(first, "w1")
    dec1 = rep1["decision"]
    assert dec1["requested"] == "auto" and dec1["measured"] == 1 and not dec1.get("shared_cache"), dec1
    entries = sorted(p.name for p in folder.iterdir())
    assert len(entries) == 1 and entries[0].endswith(".json"), entries
    assert not lat1["8"].equal(lat1["9"]), "the adapter changed nothing: the comparison below would prove nothing"

    lat2, rep2, wall2 = _run(second, "w2")
    dec2 = rep2["decision"]
    assert dec2["measured"] == 0 and dec2["shared_cache"] == 1 and dec2["cached"], dec2
    assert dec2["adapters"][0]["shared_cache"] is True
    assert (dec2["chosen"], dec2["share_lost"]) == (dec1["chosen"], dec1["share_lost"])
    assert lat2["8"].equal(lat1["8"]), "the second worker's latent differs from the first's"
    assert lat2["9"].equal(lat1["9"])
    print(f"\nfirst use, worker 1 (measured): prompt {wall1:.2f} s, patch {rep1['patch_seconds']:.3f} s; "
          f"worker 2 (shared cache): prompt {wall2:.2f} s, patch {rep2['patch_seconds']:.3f} s")

    # a truncated entry: ignored, measured again, said in the report; the same latent
    (entry,) = folder.iterdir()
    whole = entry.read_bytes()
    entry.write_bytes(whole[: len(whole) // 2])
    second.free()
    lat3, rep3, _ = _run(second, "w3")
    dec3 = rep3["decision"]
    assert dec3["measured"] == 1 and not dec3.get("shared_cache"), dec3
    (note,) = dec3["cache_notes"]
    assert entry.name in note and "truncated" in note and "measured again" in note, note
    assert (dec3["chosen"], dec3["share_lost"]) == (dec1["chosen"], dec1["share_lost"])
    assert lat3["8"].equal(lat1["8"])
    assert json.loads(entry.read_bytes())["value"] == dec1["share_lost"]  # written whole again


def _record(comfy, lora: str, tag: str):
    """(run record, the adapter sampler's latent, its report) of the prompt with `lora`."""
    g = PromptGraph(comfy.helper_cond_class, "shared_decisions", tag, SETTINGS, 0.8)
    g.ours("8", lora, "auto", tier="exact")
    rec = comfy.run(g.p)
    (rep,) = rec["history"]["outputs"]["R8"]["lora_report"]
    return rec, latent_of(comfy, rec, "s8"), rep


def test_the_loaders_identity_follows_the_file(workers):
    _, (first, _) = workers
    original = first.loras_dir.joinpath(LORA).read_bytes()
    rec1, lat1, _ = _record(first, LORA, "rw")
    rec2, lat2, _ = _record(first, LORA, "rw")  # the identical prompt: from ComfyUI's cache
    assert "A8" in rec2["cached"] and "A8" not in rec2["executing"] and "8" not in rec2["executing"], rec2["cached"]
    assert lat2.equal(lat1)
    write_kohya_lora(first.loras_dir / LORA, seed=3602, rank=4, alpha=4)  # rewritten under its name
    assert first.loras_dir.joinpath(LORA).read_bytes() != original
    rec3, lat3, rep3 = _record(first, LORA, "rw")
    assert "A8" in rec3["executing"] and "8" in rec3["executing"], rec3["cached"]
    assert not lat3.equal(lat1) and rep3["decision"]["measured"] == 1
    first.loras_dir.joinpath("renamed_copy.safetensors").write_bytes(original)  # the first bytes, a new name
    rec4, lat4, rep4 = _record(first, "renamed_copy.safetensors", "rw")
    assert "A8" in rec4["executing"] and rep4["decision"]["measured"] == 0, rep4["decision"]
    assert lat4.equal(lat1)
