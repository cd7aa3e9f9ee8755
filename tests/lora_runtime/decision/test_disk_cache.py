"""The decision cache's disk level, shared by processes: stable names, atomic writes, bad entries.

Every entry a process writes must be found under the same name by another process (the
key is the content, never a Python hash or an address); several writers at once never
leave half a file; an entry that is truncated, corrupt, of another format version or of
another key is ignored, measured again (the same decision as a fresh measurement) and
said in the decision's ``cache_notes``.
"""
import json
import os
import shutil

import pytest
import torch

from comfyui_lora_runtime.lora_runtime import AdapterSpec, DecisionCache, applied, plan
from comfyui_lora_runtime.lora_runtime.decision import disk_cache
from comfyui_lora_runtime.lora_runtime.decision.disk_cache import DiskDecisionStore, entry_name
from comfyui_lora_runtime.lora_runtime.settings import DECISION_CACHE_DIR_ENV
from comfyui_lora_runtime.nodes import report

from testkit import decision_worker
from testkit.fixtures import TinyWanLike, make_adapter_tensors, write_kohya, write_peft


@pytest.fixture
def files(tmp_path):
    ref = TinyWanLike(dtype=torch.bfloat16)
    return {
        "style": write_kohya(tmp_path / "style.safetensors", make_adapter_tensors(ref, r=4, seed=1, scale=0.25),
                             alpha=4.0),
        "distilled": write_peft(tmp_path / "distilled.safetensors",
                                make_adapter_tensors(ref, r=4, seed=2, scale=0.004), alpha=4.0),
    }


def _auto(folder, *paths, strength=0.8):
    """(decision, cache) of a fresh cache on `folder` (a new process's view of the folder)."""
    model = TinyWanLike(dtype=torch.bfloat16)
    cache = DecisionCache(disk=DiskDecisionStore(folder) if folder is not None else None)
    specs = [AdapterSpec(str(p), strength) for p in paths]
    with torch.no_grad(), applied(model, plan(model, specs, "auto"), cache) as rep:
        return rep.decision, cache


def _entries(folder):
    return sorted(n for n in os.listdir(folder) if n.endswith(".json"))


def _run(args):
    proc = decision_worker.spawn(args)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_a_second_cache_on_the_folder_measures_nothing_and_decides_the_same(files, tmp_path):
    folder = tmp_path / "shared"
    d1, c1 = _auto(folder, files["style"], files["distilled"])
    assert c1.measurements == 2 and d1.measured == 2 and len(_entries(folder)) == 2
    assert {a.chosen for a in d1.adapters} == {"merge", "dynamic"}  # both outcomes travel through the disk
    d2, c2 = _auto(folder, files["style"], files["distilled"])
    assert c2.measurements == 0 and d2.measured == 0 and c2.disk_hits == 2 and d2.cached
    assert [(a.name, a.chosen, a.share_lost) for a in d2.adapters] == \
        [(a.name, a.chosen, a.share_lost) for a in d1.adapters]  # floats through JSON: the same bits
    assert all(a.shared for a in d2.adapters) and d2.to_dict()["shared_cache"] == 2
    assert "decision from the shared cache for 2 adapter(s); 0 measured here" in report.text(
        report.build(None, mode="auto", tier="exact", host="test", sample_seconds=0.0, steps=1)
        | {"decision": d2.to_dict()})
    # the wrong answer: without the folder a fresh cache measures again
    _, c3 = _auto(None, files["style"], files["distilled"])
    assert c3.measurements == 2


def test_another_process_computes_the_same_entry_names(files, tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    d1, _ = _auto(here, files["style"], files["distilled"])
    out = _run(["decide", str(there), str(files["style"]), str(files["distilled"])])
    assert out["measurements"] == 2
    assert out["entries"] == _entries(here) and len(out["entries"]) == 2
    for name in out["entries"]:  # the same key, the same value, byte for byte
        assert (here / name).read_bytes() == (there / name).read_bytes(), name
    # and a process finds what this one wrote: nothing to measure
    again = _run(["decide", str(here), str(files["style"]), str(files["distilled"])])
    assert again["measurements"] == 0 and again["decision"]["shared_cache"] == 2
    assert [a["share_lost"] for a in again["decision"]["adapters"]] == [a.share_lost for a in d1.adapters]


def test_concurrent_writers_leave_only_whole_entries(tmp_path):
    folder = tmp_path / "shared"
    workers, rounds = 4, 60
    procs = [decision_worker.spawn(["write", str(folder), str(w), str(rounds)]) for w in range(workers)]
    reader = DiskDecisionStore(folder)
    seen_notes, hits = [], 0
    while any(p.poll() is None for p in procs):  # read the shared entries while they are being replaced
        for i in range(decision_worker.SHARED_KEYS):
            value, note = reader.get("share", decision_worker.shared_key(i))
            seen_notes += [note] if note else []
            hits += value is not None
            assert value in (None, 0.25 + i / 100)
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert seen_notes == [] and all(o["notes"] == [] for o in outs)
    assert sum(o["writes"] for o in outs) == workers * rounds * (decision_worker.SHARED_KEYS + 1)
    names = os.listdir(folder)
    assert not [n for n in names if n.endswith(".tmp")], names  # no temp file left behind
    assert len(names) == decision_worker.SHARED_KEYS + workers * 3
    for i in range(decision_worker.SHARED_KEYS):
        assert reader.get("share", decision_worker.shared_key(i)) == (0.25 + i / 100, "")
    for w in range(workers):
        for r in range(3):
            assert reader.get("share", ("own", w, r)) == (w / 1000, "")
    print(f"reader hits while writing: {hits}")


def _truncate(path):
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _flip_value(path):
    e = json.loads(path.read_bytes())
    e["value"] = 0.0 if e["value"] > 0.25 else 0.99  # the opposite decision, checksum left as it was
    path.write_text(json.dumps(e))


def _other_version(path):
    e = json.loads(path.read_bytes())
    e["version"] = disk_cache.VERSION + 1
    path.write_text(json.dumps(e))


def _garbage(path):
    path.write_bytes(b"\x80\x03}q\x00.")  # a pickle's first bytes: never unpickled


def _not_an_object(path):
    path.write_bytes(b"null")


@pytest.mark.parametrize("damage, why", [
    (_truncate, "not complete JSON"), (_flip_value, "checksum"), (_other_version, "format version"),
    (_garbage, "not complete JSON"), (_not_an_object, "not a JSON object")])
def test_a_damaged_entry_is_measured_again_and_reported(files, tmp_path, damage, why):
    folder = tmp_path / "shared"
    d1, _ = _auto(folder, files["distilled"])
    (name,) = _entries(folder)
    damage(folder / name)
    d2, c2 = _auto(folder, files["distilled"])
    assert c2.measurements == 1 and not d2.cached and not d2.adapters[0].shared
    assert (d2.chosen, d2.share_lost) == (d1.chosen, d1.share_lost)  # never the damaged entry's answer
    (note,) = d2.cache_notes
    assert name in note and why in note and "measured again" in note
    assert d2.to_dict()["cache_notes"] == [note]
    text = report.text(report.build(None, mode="auto", tier="exact", host="test", sample_seconds=0.0, steps=1)
                       | {"decision": d2.to_dict()})
    assert note in text
    # the measurement was written over the damaged entry: the next cache reads it, no note
    d3, c3 = _auto(folder, files["distilled"])
    assert c3.measurements == 0 and d3.cache_notes == [] and d3.adapters[0].shared


def test_a_foreign_entry_under_the_name_is_ignored(files, tmp_path):
    """An entry of another key (another adapter's, copied or collided) under this key's name."""
    folder = tmp_path / "shared"
    d_style, _ = _auto(folder, files["style"])
    (style_name,) = _entries(folder)
    d_dist, _ = _auto(tmp_path / "other", files["distilled"])
    (dist_name,) = _entries(tmp_path / "other")
    shutil.copyfile(folder / style_name, folder / dist_name)  # the style adapter's entry where distilled's goes
    d, cache = _auto(folder, files["distilled"])
    assert cache.measurements == 1 and (d.chosen, d.share_lost) == (d_dist.chosen, d_dist.share_lost)
    assert d.share_lost != d_style.share_lost
    (note,) = d.cache_notes
    assert dist_name in note and "another key" in note


def test_an_unwritable_folder_is_reported_not_raised(files, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    d, cache = _auto(blocker / "cache", files["style"])
    assert cache.measurements == 1 and d.chosen == "merge"
    (note,) = d.cache_notes
    assert "could not be written" in note


def test_entry_names_follow_the_key_only():
    key = (("blocks.0.ffn.0", ("cpu", "torch.bfloat16", (64, 32), 2**64 - 1, 5), None), "abc", 0.8, None, True)
    assert entry_name("share", key) == entry_name("share", tuple(key))
    assert entry_name("share", key) != entry_name("check", key)
    assert entry_name("share", key) != entry_name("share", key[:-1] + (False,))
    assert entry_name("share", (float("nan"),)) is None and entry_name("share", (object(),)) is None


def test_the_folder_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(DECISION_CACHE_DIR_ENV, raising=False)
    assert disk_cache.from_env() is None
    monkeypatch.setenv(DECISION_CACHE_DIR_ENV, str(tmp_path))
    assert disk_cache.from_env().folder == str(tmp_path)
