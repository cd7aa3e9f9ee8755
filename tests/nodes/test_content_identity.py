"""The loaders' identity follows the file's content (bundled host).

ComfyUI keys a node's cached output by its inputs and its ``IS_CHANGED`` answer: ours is the
file's content digest (the adapter's ``content_hash``), so a file rewritten under the same
name runs the loader again, and the same bytes under another name are the same adapter to
the decision cache (not measured again). The digest of an unchanged file is computed once
per process (counted through ``content_digest.hash_file``), not on every queue.
"""
import shutil

import pytest

from comfyui_lora_runtime.lora_runtime import load_adapter
from comfyui_lora_runtime.lora_runtime.files import content_digest
from comfyui_lora_runtime.lora_runtime.settings import DECISION_CACHE_DIR_ENV
from comfyui_lora_runtime.nodes import report
from comfyui_lora_runtime.nodes.caches import decision_cache_for
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter, LoraMergeMode
from comfyui_lora_runtime.nodes.stack_node import LoraStack
from comfyui_lora_runtime.standalone.host.core_nodes import UNETLoader

from testkit.nodes_helpers import _sample


@pytest.fixture
def hashes(monkeypatch):
    """Every read of a whole file by the digest's hashing function, by path (the memo starts empty)."""
    content_digest.forget()
    calls = []
    real = content_digest.hash_file
    monkeypatch.setattr(content_digest, "hash_file", lambda path: calls.append(str(path)) or real(path))
    yield calls
    content_digest.forget()


def _auto(base, name, strength=0.8):
    m = LoadLoraAdapter().load(base, name, strength)["result"][0]
    return LoraMergeMode().set_mode(m, "auto")[0]


def test_is_changed_is_the_content_digest(folders, hashes):
    loras = folders.models_dir / "loras"
    digest = LoadLoraAdapter.IS_CHANGED(lora_name="style.safetensors", strength=1.0)
    assert digest == load_adapter(loras / "style.safetensors").content_hash  # one digest for both
    assert digest == content_digest.hash_file(loras / "style.safetensors")
    shutil.copyfile(loras / "style.safetensors", loras / "renamed.safetensors")
    assert LoadLoraAdapter.IS_CHANGED(lora_name="renamed.safetensors") == digest  # same bytes, same identity
    assert LoadLoraAdapter.IS_CHANGED(lora_name="distilled.safetensors") != digest
    shutil.copyfile(loras / "distilled.safetensors", loras / "style.safetensors")  # rewritten under its name
    assert LoadLoraAdapter.IS_CHANGED(lora_name="style.safetensors") == \
        LoadLoraAdapter.IS_CHANGED(lora_name="distilled.safetensors") != digest
    rows = '[{"lora": "renamed.safetensors"}, {"lora": "style.safetensors", "on": false}]'
    assert LoraStack.IS_CHANGED(rows=rows) == digest  # the rows that are on
    assert LoraStack.IS_CHANGED(rows="[{") != LoraStack.IS_CHANGED(rows=rows)
    assert LoadLoraAdapter.IS_CHANGED(lora_name="missing.safetensors").startswith("unreadable")


def test_an_unchanged_file_is_hashed_once_per_process(folders, hashes):
    path = str(folders.models_dir / "loras" / "style.safetensors")
    first = LoadLoraAdapter.IS_CHANGED(lora_name="style.safetensors")
    for _ in range(5):  # five more queues of the same prompt
        assert LoadLoraAdapter.IS_CHANGED(lora_name="style.safetensors") == first
    assert hashes == [path]
    # a file the loader has read needs no hashing at all: the loader's read filed its digest
    load_adapter(folders.models_dir / "loras" / "distilled.safetensors")
    LoadLoraAdapter.IS_CHANGED(lora_name="distilled.safetensors")
    assert hashes == [path]
    # a rewrite is hashed again, once
    shutil.copyfile(folders.models_dir / "loras" / "distilled.safetensors", path)
    assert LoadLoraAdapter.IS_CHANGED(lora_name="style.safetensors") != first
    LoadLoraAdapter.IS_CHANGED(lora_name="style.safetensors")
    assert hashes == [path, path]


def test_same_bytes_renamed_are_not_measured_a_rewrite_is(folders, base, monkeypatch):
    monkeypatch.delenv(DECISION_CACHE_DIR_ENV, raising=False)
    loras = folders.models_dir / "loras"
    cache = decision_cache_for(base.get_model_object("diffusion_model"))
    chain = _auto(base, "style.safetensors")
    y1, r1 = _sample(chain)
    assert cache.measurements == 1 and r1["decision"]["measured"] == 1
    y1b, r1b = _sample(chain)  # the adapters stayed on: resumed, nothing measured for this sampling
    assert r1b.get("adapters_kept") and r1b["decision"]["measured"] == 0 and y1b.equal(y1)
    shutil.copyfile(loras / "style.safetensors", loras / "renamed.safetensors")
    y2, r2 = _sample(_auto(base, "renamed.safetensors"))
    assert cache.measurements == 1 and r2["decision"]["measured"] == 0 and r2["decision"]["cached"]
    assert y2.equal(y1)
    shutil.copyfile(loras / "distilled.safetensors", loras / "style.safetensors")  # new content, old name
    y3, r3 = _sample(_auto(base, "style.safetensors"))
    assert cache.measurements == 2 and r3["decision"]["measured"] == 1 and not r3["decision"]["cached"]
    assert not y3.equal(y1)


def test_a_second_model_reads_the_shared_folder(folders, monkeypatch, tmp_path):
    """Two base models (as two workers would have) with the same folder: the second measures nothing."""
    monkeypatch.setenv(DECISION_CACHE_DIR_ENV, str(tmp_path / "decisions"))
    first = UNETLoader().load_unet("tiny_wan.safetensors", "default")[0]
    y1, r1 = _sample(_auto(first, "style.safetensors"))
    assert r1["decision"]["measured"] == 1 and "shared_cache" not in r1["decision"]
    second = UNETLoader().load_unet("tiny_wan.safetensors", "default")[0]
    assert second.get_model_object("diffusion_model") is not first.get_model_object("diffusion_model")
    y2, r2 = _sample(_auto(second, "style.safetensors"))
    assert r2["decision"]["measured"] == 0 and r2["decision"]["shared_cache"] == 1
    assert decision_cache_for(second.get_model_object("diffusion_model")).measurements == 0
    assert y2.equal(y1) and not y1.equal(_sample(second)[0])  # the same result, not the bare model's
    assert "decision from the shared cache for 1 adapter(s); 0 measured here" in report.text(r2)
