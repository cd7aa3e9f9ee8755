"""Every sampler honours the adapters: the intent our nodes record is applied by the
host's stock KSampler through the patcher's SAMPLER_SAMPLE wrapper (nodes/lifecycle.py),
with the same numbers as the LoRA Sampler, the report stored, sent for the executing
node and shown by the LoRA Runtime Report node, and everything restored on every exit."""
import pytest
import torch

from comfyui_lora_runtime.standalone.host import progress
from comfyui_lora_runtime.standalone.host.core_nodes import KSampler
from comfyui_lora_runtime.standalone.host.executor import NodeExecutionError, execute_prompt
from comfyui_lora_runtime.lora_runtime.layer.wrapper import runtime_leftovers
from comfyui_lora_runtime.nodes import lifecycle
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter, LoraMergeMode, LoraQualityTier, LoraRuntimeReport

from testkit.nodes_helpers import CLASSES, Capture, CondPos, _sample, _weights


def _ksampler(model, seed=42, steps=3):
    pos, neg = CondPos().go("pos")[0], CondPos().go("neg")[0]
    return KSampler().sample(model, seed, steps, 5.0, "euler", "simple", pos, neg,
                             {"samples": torch.zeros(1, 16, 1, 8, 8)}, 1.0)[0]["samples"]


@pytest.mark.parametrize("mode", ["dynamic", "merge", "auto"])
def test_stock_ksampler_applies_the_adapter_like_the_lora_sampler(base, mode):
    w0 = _weights(base)
    m = LoraQualityTier().set_tier(LoraMergeMode().set_mode(
        LoadLoraAdapter().load(base, "style.safetensors", 0.8)["result"][0], mode)[0], "exact")[0]
    with_stock = _ksampler(m)
    ours, rep = _sample(m)
    assert torch.equal(with_stock, ours), mode                      # same path, same bits
    assert (with_stock - _ksampler(base)).abs().mean() > 1e-2        # not the base model
    assert lifecycle.last_report(m)["decision"]["requested"] == mode
    assert runtime_leftovers(base.model.diffusion_model) == []
    w1 = _weights(base)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_registration_is_idempotent_and_inherited(base):
    a = LoadLoraAdapter().load(base, "style.safetensors", 1.0)["result"][0]
    b = LoraMergeMode().set_mode(a, "dynamic")[0]
    assert not lifecycle.is_registered(base)
    assert len(b.get_wrappers("sampler_sample", lifecycle.WRAPPER_KEY)) == 1
    c = b.clone()  # any other node's clone downstream keeps the runtime
    assert lifecycle.is_registered(c) and torch.equal(_ksampler(c), _ksampler(b))


def test_two_branches_from_one_model(base):
    a = LoadLoraAdapter().load(base, "style.safetensors", 1.0)["result"][0]
    b = LoadLoraAdapter().load(base, "sub/second.safetensors", -0.5)["result"][0]
    ya, yb, y0 = _ksampler(a), _ksampler(b), _ksampler(base)
    assert not torch.equal(ya, yb) and not torch.equal(ya, y0) and not torch.equal(yb, y0)
    assert torch.equal(_ksampler(a), ya) and torch.equal(_ksampler(base), y0)
    assert [x["name"] for x in lifecycle.last_report(a)["adapters"]] == ["style.safetensors"]
    assert [x["name"] for x in lifecycle.last_report(b)["adapters"]] == ["sub/second.safetensors"]


def test_error_and_interrupt_inside_a_stock_sampler_restore_everything(base, monkeypatch):
    w0 = _weights(base)
    m = LoraMergeMode().set_mode(LoadLoraAdapter().load(base, "style.safetensors", 1.0)["result"][0], "merge")[0]
    calls = {"n": 0}

    def hook(value, total, preview, **kw):
        calls["n"] += 1
        if value == 2:
            progress.interrupt_current_processing(True)
    with progress.progress_hook(hook), pytest.raises(progress.InterruptProcessingException):
        _ksampler(m, steps=4)
    progress.interrupt_current_processing(False)
    assert calls["n"] >= 2
    assert runtime_leftovers(base.model.diffusion_model) == []
    assert all(torch.equal(w0[k], v) for k, v in _weights(base).items())

    dm = base.model.diffusion_model
    real_forward = type(dm).forward

    def boom(self, *a, **k):  # an out-of-memory in the middle of a step
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    monkeypatch.setattr(type(dm), "forward", boom)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        _ksampler(m)
    monkeypatch.setattr(type(dm), "forward", real_forward)
    assert runtime_leftovers(dm) == []
    assert all(torch.equal(w0[k], v) for k, v in _weights(base).items())


def _graph(sampler_class: str, with_report: bool):
    g = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "LoraRuntimeLoadAdapter", "inputs": {"model": ["1", 0], "lora_name": "style.safetensors",
                                                                  "strength": 1.0}},
        "3": {"class_type": "LoraRuntimeMergeMode", "inputs": {"model": ["2", 0], "mode": "dynamic"}},
        "5": {"class_type": "CondPos", "inputs": {"which": "pos"}},
        "6": {"class_type": "CondPos", "inputs": {"which": "neg"}},
        "7": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1,
                                                                   "batch_size": 1}},
        "8": {"class_type": sampler_class, "inputs": {"model": ["3", 0], "seed": 42, "steps": 2, "cfg": 5.0,
                                                       "sampler_name": "euler", "scheduler": "simple",
                                                       "positive": ["5", 0], "negative": ["6", 0],
                                                       "latent_image": ["7", 0], "denoise": 1.0}},
        "9": {"class_type": "Capture", "inputs": {"samples": ["8", 0]}},
    }
    if with_report:
        g["10"] = {"class_type": "LoraRuntimeReport", "inputs": {"model": ["3", 0], "latent": ["8", 0]}}
    return g


def test_report_reaches_the_executing_stock_sampler_node_and_the_report_node(folders):
    events = []
    with progress.listening(lambda ev, data: events.append((ev, data))):
        res = execute_prompt(_graph("KSampler", True), CLASSES)
    reports = [d for ev, d in events if ev == "lora_runtime.report"]
    assert len(reports) == 1 and reports[0]["node"] == "8"
    r = reports[0]["report"]
    assert r["decision"]["chosen"] == "dynamic" and r["adapters"][0]["coverage"]["matched"] > 0
    assert res.ui["10"]["lora_report"] == [r]  # the report node's ui output (ComfyUI's history)
    with progress.listening(lambda ev, data: events.append((ev, data))):
        ours = execute_prompt(_graph("LoraRuntimeSampler", False), CLASSES)
    assert torch.equal(Capture.seen[-1], Capture.seen[-2])  # LoRA Sampler and KSampler: same latent
    assert ours.ui["8"]["lora_report"][0]["decision"] == r["decision"]


def test_report_node_without_a_sampled_model_says_what_to_connect(base):
    m = LoadLoraAdapter().load(base, "style.safetensors", 1.0)["result"][0]
    with pytest.raises(Exception, match="has not been sampled.*same MODEL output"):
        LoraRuntimeReport().show(m, {"samples": torch.zeros(1)})


def test_loading_an_adapter_does_not_touch_the_model(base):
    w0 = _weights(base)
    LoadLoraAdapter().load(base, "style.safetensors", 1.0)
    assert runtime_leftovers(base.model.diffusion_model) == []
    assert all(torch.equal(w0[k], v) for k, v in _weights(base).items())


def test_layers_the_host_patches_itself_stay_dynamic(base):
    m = LoraMergeMode().set_mode(LoadLoraAdapter().load(base, "style.safetensors", 1.0)["result"][0], "merge")[0]
    m.patches = {"diffusion_model.blocks.0.ffn.0.weight": ["a ComfyUI LoraLoader patch"]}  # as ComfyUI keeps them
    merged_elsewhere = _ksampler(m)
    r = lifecycle.last_report(m)
    assert r["decision"]["chosen"] == "merge" and r["decision"]["kept_dynamic"] == 1
    assert r["decision"]["kept_dynamic_examples"] == ["blocks.0.ffn.0"]
    assert "ComfyUI patches this weight itself" in r["decision"]["kept_dynamic_reason"]
    dyn = LoraMergeMode().set_mode(m, "dynamic")[0]
    assert (merged_elsewhere - _ksampler(dyn)).abs().max() < 0.05  # same adapter, merge vs dynamic rounding


def test_report_node_on_a_no_adapter_model_the_lora_sampler_sampled(base):
    """The LoRA Sampler samples a clone of a MODEL none of our nodes touched; the report node fed
    the same MODEL output shows that run's report (no adapters), not an error about its wiring."""
    _, shown_on_sampler = _sample(base)
    r = LoraRuntimeReport().show(base, {"samples": torch.zeros(1)})["ui"]["lora_report"][0]
    assert r is shown_on_sampler and r["decision"] is None and r["adapters"] == []
    assert r["sample_seconds"] > 0, "the sampler's own run, not a stand-in"
    # the same through a graph: Load model -> LoRA Sampler -> Report
    g = _graph("LoraRuntimeSampler", True)
    g["10"]["inputs"]["model"] = ["1", 0]
    g["8"]["inputs"]["model"] = ["1", 0]
    res = execute_prompt(g, CLASSES)
    assert res.ui["10"]["lora_report"] == res.ui["8"]["lora_report"]
    assert res.ui["10"]["lora_report"][0]["adapters"] == []


def test_report_node_on_a_no_adapter_model_a_stock_sampler_sampled(base):
    _ksampler(base)
    r = LoraRuntimeReport().show(base, {"samples": torch.zeros(1)})["ui"]["lora_report"][0]
    assert r["decision"] is None and r["adapters"] == [] and "no LoRA adapters on this MODEL" in r["note"]
