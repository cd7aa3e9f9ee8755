"""An applied adapter owns its bytes: the adapter's file rewritten in place, truncated or
deleted in the middle of a sampling run changes nothing in that run (same latent, bit for
bit) and every weight is bit-identical afterwards, in every merge mode. A later sampling of
the same MODEL uses the content its loader node read (the node's output is what the graph
holds), without touching the file. The wrong answer is checked too: the rewritten file,
read afresh, gives another latent."""
import os

import pytest
import torch

from comfyui_lora_runtime.standalone.host import progress
from comfyui_lora_runtime.lora_runtime.layer.wrapper import runtime_leftovers
from comfyui_lora_runtime.nodes import lifecycle
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter, LoraMergeMode

from testkit.bad_adapter_files import rewrite_data_in_place
from testkit.nodes_helpers import _sample, _weights, _unloaded_weights


def _change(path, how):
    if how == "rewrite":
        rewrite_data_in_place(path, 0.5)
    elif how == "truncate":
        os.truncate(path, 24)
    else:
        os.remove(path)


def _model(base, mode, name="style.safetensors"):
    return LoraMergeMode().set_mode(LoadLoraAdapter().load(base, name, 0.8)["result"][0], mode)[0]


@pytest.mark.parametrize("how", ["rewrite", "truncate", "delete"])
@pytest.mark.parametrize("mode", ["merge", "dynamic", "auto"])
def test_file_changed_mid_run_changes_nothing(base, folders, mode, how):
    path = folders.models_dir / "loras" / "style.safetensors"
    w0 = _weights(base)
    untouched, _ = _sample(_model(base, mode), steps=4)
    m = _model(base, mode)

    def hook(value, total, preview, **kw):
        if value == 2:
            _change(path, how)
    with progress.progress_hook(hook):
        during, rep = _sample(m, steps=4)
    assert torch.equal(during, untouched), (mode, how)
    w1 = _unloaded_weights(base)
    assert runtime_leftovers(base.model.diffusion_model) == []
    assert all(torch.equal(w0[k], w1[k]) for k in w0), (mode, how)
    assert (during - _sample(base, steps=4)[0]).abs().mean() > 1e-2        # the adapter did act

    again, _ = _sample(m, steps=4)                                            # same MODEL, file changed or gone
    assert torch.equal(again, untouched)
    assert all(torch.equal(w0[k], v) for k, v in _unloaded_weights(base).items())
    if how == "rewrite":                                                      # the wrong answer: the new bytes
        fresh, _ = _sample(_model(base, mode), steps=4)
        assert not torch.equal(fresh, untouched)


def test_file_deleted_before_the_sampler_and_not_cached_is_a_clear_error(base, folders, monkeypatch):
    from comfyui_lora_runtime.nodes import caches
    path = folders.models_dir / "loras" / "style.safetensors"
    m = _model(base, "dynamic")
    w0 = _weights(base)
    monkeypatch.setattr(caches, "ADAPTERS", caches.AdapterFileCache())     # evicted meanwhile
    monkeypatch.setattr(lifecycle, "ADAPTERS", caches.ADAPTERS)
    os.remove(path)
    from comfyui_lora_runtime.lora_runtime.errors import AdapterFileError
    with pytest.raises(AdapterFileError, match=r"style\.safetensors was removed or renamed after its loader node"):
        _sample(m)
    assert all(torch.equal(w0[k], v) for k, v in _weights(base).items())
