"""The lifecycle on a MODEL whose host stages every weight itself (ComfyUI's ModelPatcherDynamic, whose
``is_dynamic()`` is True), on the bundled host: the patcher class is told it is dynamic; what a dynamic
loader does to the weights is not simulated here (tests/integration/test_dynamic_vram_real.py runs
ComfyUI 0.33's own).

Checked: every mode runs every layer dynamic and names each layer on the report ('re-staged at every load
(dynamic VRAM): dynamic': no layer of the bundled host carries a virtual-VRAM range), the weights are never
written, and merge mode gives the dynamic output bit for bit (the wrong answer, the same MODEL on a plain
patcher, merges and differs); a re-run resumes the adapters (applied once per load of the model); an
unload in the middle of the sampling (dynamic VRAM frees a model that is in use when another loads) leaves
the adapters on until the sampling ends (the output equals the run without the unload; the wrong answer,
taking them off at once, differs), then takes them off.
"""
import pytest
import torch

from comfyui_lora_runtime.lora_runtime import resident
from comfyui_lora_runtime.lora_runtime.apply import LoraInjector
from comfyui_lora_runtime.lora_runtime.layer.wrapper import runtime_leftovers
from comfyui_lora_runtime.nodes import lifecycle
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter, LoraMergeMode, LoraQualityTier
from comfyui_lora_runtime.standalone.host import model_management, progress
from comfyui_lora_runtime.standalone.host.model_patcher import BundledModelPatcher

from testkit.nodes_helpers import _sample, _weights


@pytest.fixture
def dynamic_host(monkeypatch):
    monkeypatch.setattr(BundledModelPatcher, "is_dynamic", lambda self: True, raising=False)
    yield
    model_management.unload_all_models()


def _ours(base, mode):
    m = LoadLoraAdapter().load(base, "style.safetensors", 0.8)["result"][0]
    m = LoraMergeMode().set_mode(m, mode)[0]
    return LoraQualityTier().set_tier(m, "exact")[0]


@pytest.fixture
def counted_applies(monkeypatch):
    calls = []
    real = LoraInjector.apply

    def apply(self, p, cache=None):
        calls.append(1)
        return real(self, p, cache)
    monkeypatch.setattr(LoraInjector, "apply", apply)
    return calls


def test_every_mode_runs_dynamic_names_each_layer_and_resumes_on_a_rerun(base, dynamic_host, counted_applies):
    w0 = _weights(base)
    out = {}
    for mode in ("merge", "auto", "dynamic"):
        model_management.unload_all_models()
        m = _ours(base, mode)
        y, rep = _sample(m, seed=1)
        assert all(torch.equal(w0[k], v) for k, v in _weights(base).items()), mode   # nothing written
        groups = rep["layers"]
        assert [g["what"] for g in groups] == ["re-staged at every load (dynamic VRAM): dynamic"], groups
        n = rep["adapters"][0]["coverage"]["matched"]
        assert groups[0]["layers"] == n and len(set(groups[0]["names"])) == n
        assert rep["decision"]["chosen"] == "dynamic", rep["decision"]
        applies = len(counted_applies)
        y2, rep2 = _sample(m, seed=1)
        assert rep2["adapters_kept"] is True and len(counted_applies) == applies    # not applied again
        assert torch.equal(y, y2)
        out[mode] = y
    assert torch.equal(out["merge"], out["dynamic"]) and torch.equal(out["auto"], out["dynamic"])
    base_out, _ = _sample(base, seed=1)
    assert (out["dynamic"] - base_out).abs().mean() > 1e-2                          # the adapter is in it


def test_the_wrong_answer_a_plain_patcher_merges_and_differs(base):
    w0 = _weights(base)
    m = _ours(base, "merge")
    y, rep = _sample(m, seed=1)
    assert rep["decision"]["chosen"] == "merge" and [g["what"] for g in rep["layers"]] == ["merged"]
    assert not all(torch.equal(w0[k], v) for k, v in _weights(base).items())
    model_management.unload_all_models()
    dyn, _ = _sample(_ours(base, "dynamic"), seed=1)
    assert not torch.equal(y, dyn)      # a bf16 merge rounds: the merged output is not the dynamic one
    model_management.unload_all_models()


def _unload_at_step(k: int, action):
    def hook(value, total, preview, node_id=None):
        if value == k:
            action()
    return progress.progress_hook(hook)


def test_an_unload_in_the_middle_of_the_sampling_keeps_the_adapters_until_it_ends(base, dynamic_host):
    dm = base.model.diffusion_model
    m = _ours(base, "dynamic")
    ref, _ = _sample(m, seed=3, steps=4)
    model_management.unload_all_models()
    with _unload_at_step(1, model_management.unload_all_models):
        y, rep = _sample(m, seed=3, steps=4)
    assert torch.equal(y, ref)                                   # every step ran with the adapters
    assert resident.kept(dm) is None and runtime_leftovers(dm) == []    # off once the sampling ended
    # the wrong answer: taking them off at the unload (what happens to a model whose weights hold a merge)
    with _unload_at_step(1, lambda: resident.evict(dm, "test: off at once")):
        wrong, _ = _sample(m, seed=3, steps=4)
    assert not torch.equal(wrong, ref) and (wrong - ref).abs().mean() > 1e-3
    base_out, _ = _sample(base, seed=3, steps=4)
    assert not torch.equal(wrong, base_out)                     # the first step still had the adapters
