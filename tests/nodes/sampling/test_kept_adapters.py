"""Adapters stay on a loaded model between samplings, as the host's own patches do, and come off
bit for bit when the host unloads it, when another MODEL on the same weights loads or runs, on an
error or an interrupt, or when the adapters change (nodes/lifecycle.py, lora_runtime/resident.py;
the bundled host loads and unloads in ComfyUI's order, standalone/host/model_management.py).

Every output is compared bitwise with a fresh sampling of the same MODEL on pristine weights (what
the lifecycle before kept states gave) and with the base model's output (the wrong answer)."""
import pytest
import torch

from comfyui_lora_runtime.standalone.host import model_management, progress
from comfyui_lora_runtime.lora_runtime import resident
from comfyui_lora_runtime.lora_runtime.layer.wrapper import AdaptedLayer, runtime_leftovers
from comfyui_lora_runtime.nodes import lifecycle
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter, LoraMergeMode

from testkit.nodes_helpers import _sample, _weights


def _model(base, name="style.safetensors", strength=0.8, mode="merge"):
    return LoraMergeMode().set_mode(LoadLoraAdapter().load(base, name, strength)["result"][0], mode)[0]


def _fresh(model, **kw):
    """The output of `model` sampled on pristine weights (everything unloaded first)."""
    model_management.unload_all_models()
    out, _ = _sample(model, **kw)
    return out


def _pristine(base, w0) -> bool:
    dm = base.model.diffusion_model
    return runtime_leftovers(dm) == [] and all(torch.equal(w0[k], v) for k, v in _weights(base).items())


@pytest.fixture
def counted_merges(monkeypatch):
    calls = []
    real = AdaptedLayer.merge

    def merge(self, only=None):
        calls.append(self.layer_name)
        return real(self, only)
    monkeypatch.setattr(AdaptedLayer, "merge", merge)
    return calls


@pytest.mark.parametrize("mode", ["merge", "auto", "dynamic"])
def test_a_rerun_resumes_the_kept_adapters_with_the_same_bits_and_an_unload_restores_them(base, mode,
                                                                                          counted_merges):
    w0 = _weights(base)
    m = _model(base, mode=mode)
    first, rep1 = _sample(m, seed=1)
    merged_once = len(counted_merges)
    assert not rep1.get("adapters_kept")
    assert resident.kept(base.model.diffusion_model) is not None          # still on after the sampling
    if mode != "dynamic":
        assert merged_once > 0 and not all(torch.equal(w0[k], v) for k, v in _weights(base).items())
    again, rep2 = _sample(m, seed=1)
    other_seed, rep3 = _sample(m, seed=2)
    assert rep2["adapters_kept"] is True and rep3["adapters_kept"] is True
    assert len(counted_merges) == merged_once                               # nothing merged again
    # the same decision, reported again; this sampling measured nothing
    assert rep2["decision"] == {**rep1["decision"], "measured": 0}
    assert torch.equal(first, again)                                        # the same bits as the first run
    model_management.unload_all_models()                                    # the host unloads the model
    assert _pristine(base, w0)
    assert resident.kept(base.model.diffusion_model) is None
    assert torch.equal(_fresh(m, seed=2), other_seed)                       # a resumed run = a fresh run
    base_out, _ = _sample(base, seed=1)
    assert (first - base_out).abs().mean() > 1e-2                           # the adapter is in it


def test_another_model_on_the_same_weights_sees_them_pristine_and_ours_comes_back(base):
    w0 = _weights(base)
    m = _model(base)
    ours, _ = _sample(m)
    plain = base.clone()                       # a branch of the graph without our adapters
    base_out, _ = _sample(plain)               # its load detaches ours: the adapters come off first
    assert _pristine(base, w0)
    assert torch.equal(base_out, _fresh(plain))
    again, rep = _sample(m)                    # ours again: applied anew, the same bits
    assert not rep.get("adapters_kept") and torch.equal(again, ours)


def test_a_layer_run_outside_any_sampling_takes_the_kept_adapters_off_before_it_computes(base):
    w0 = _weights(base)
    dm = base.model.diffusion_model
    _sample(_model(base))
    lin = dm.blocks[0].self_attn.q
    x = torch.randn(3, lin.in_features)
    with torch.no_grad():
        y = lin(x)                             # e.g. another pack calling the model directly
    assert _pristine(base, w0)
    assert torch.equal(y, torch.nn.functional.linear(x, w0["blocks.0.self_attn.q.weight"],
                                                     w0["blocks.0.self_attn.q.bias"]))


def test_changed_adapters_take_the_old_ones_fully_off(base):
    w0 = _weights(base)
    _sample(_model(base, strength=0.8))
    changed, rep = _sample(_model(base, strength=-0.4))                     # a new strength
    assert not rep.get("adapters_kept")
    swapped, _ = _sample(_model(base, name="sub/second.safetensors", strength=1.0))   # another file
    assert torch.equal(changed, _fresh(_model(base, strength=-0.4)))
    assert torch.equal(swapped, _fresh(_model(base, name="sub/second.safetensors", strength=1.0)))
    model_management.unload_all_models()
    assert _pristine(base, w0)


def test_two_branches_of_one_base_alternate_with_their_own_adapters(base):
    w0 = _weights(base)
    a, b = _model(base, strength=0.8), _model(base, name="sub/second.safetensors", strength=-0.5, mode="dynamic")
    outs = [_sample(x)[0] for x in (a, b, a, b)]
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    assert torch.equal(outs[0], _fresh(a)) and torch.equal(outs[1], _fresh(b))
    assert (outs[0] - outs[1]).abs().mean() > 1e-2
    model_management.unload_all_models()
    assert _pristine(base, w0)


def test_an_interrupt_or_error_in_a_resumed_sampling_leaves_the_weights_pristine(base, monkeypatch):
    w0 = _weights(base)
    m = _model(base)
    _sample(m)

    def hook(value, total, preview, **kw):
        if value == 2:
            progress.interrupt_current_processing(True)
    with progress.progress_hook(hook), pytest.raises(progress.InterruptProcessingException):
        _sample(m, steps=4)
    progress.interrupt_current_processing(False)
    assert _pristine(base, w0) and resident.kept(base.model.diffusion_model) is None

    _sample(m)
    dm = base.model.diffusion_model
    real_forward = type(dm).forward

    def boom(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    monkeypatch.setattr(type(dm), "forward", boom)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        _sample(m)
    monkeypatch.setattr(type(dm), "forward", real_forward)
    assert _pristine(base, w0) and resident.kept(dm) is None


def test_a_weight_replaced_while_kept_is_restored_by_value_and_the_adapters_applied_again(base):
    """A host that moves a weight (a new tensor, the same values) between samplings: the kept state
    is not trusted; it comes off by value (fingerprint-checked) and goes on again."""
    w0 = _weights(base)
    m = _model(base)
    first, _ = _sample(m)
    lin = base.model.diffusion_model.blocks[0].self_attn.q
    lin.weight = torch.nn.Parameter(lin.weight.detach().clone(), requires_grad=False)
    again, rep = _sample(m)
    assert not rep.get("adapters_kept") and torch.equal(first, again)
    model_management.unload_all_models()
    assert _pristine(base, w0)


def test_the_report_text_says_the_adapters_were_kept(base):
    m = _model(base)
    _sample(m)
    _, rep = _sample(m)
    from comfyui_lora_runtime.nodes import report as report_mod
    assert "kept on from the last sampling" in report_mod.text(rep)
    assert lifecycle.last_report(m)["adapters_kept"] is True


def test_the_kept_state_holds_its_model_weakly_and_comes_off_when_the_host_frees_it(base):
    """ComfyUI's free_memory walks its loaded-model list while our detach callback runs: freeing a
    patcher there runs its finalizers, which edit that list. So a kept state never holds the MODEL
    (taking it off frees no host object), and a MODEL the host drops takes its adapters off."""
    import gc
    import sys
    w0 = _weights(base)
    m = _model(base)
    _sample(m)
    refs = sys.getrefcount(m)
    model_management.unload_all_models()
    assert sys.getrefcount(m) == refs                      # taking the state off released no reference to it
    _sample(m)
    assert resident.kept(base.model.diffusion_model) is not None
    del m
    gc.collect()
    assert resident.kept(base.model.diffusion_model) is None and _pristine(base, w0)


def test_weights_held_as_inference_tensors_come_off_when_the_host_unloads_outside_inference_mode(base):
    """ComfyUI loads and samples under inference mode (its weights can be inference tensors) and
    unloads from its worker loop outside it: the restore must still write them back."""
    dm = base.model.diffusion_model
    with torch.inference_mode():
        for p in dm.parameters():
            p.data = p.data.clone()      # an inference tensor now
    w0 = _weights(base)
    assert dm.blocks[0].self_attn.q.weight.is_inference()
    m = _model(base)
    with torch.inference_mode():
        _sample(m)
    model_management.unload_all_models()
    assert _pristine(base, w0)


def test_a_failed_take_off_is_said_on_the_next_sampling_of_that_model(base, monkeypatch):
    from comfyui_lora_runtime.lora_runtime import LoraInjector, RestoreError
    m = _model(base)
    _sample(m)

    def broken(self):
        raise RuntimeError("simulated restore failure")
    monkeypatch.setattr(LoraInjector, "clear", broken)
    model_management.unload_all_models()           # the host's unload: logged, never raised into its loop
    monkeypatch.undo()
    with pytest.raises(RestoreError, match="simulated restore failure.*free the model and node cache"):
        _sample(m)
