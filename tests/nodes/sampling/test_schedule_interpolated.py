"""Linear keyframe schedules and the FLOAT-list strength input, through the bundled host's stock
KSampler: each step's factor is the interpolated value at the step's progress i/n (exact
arithmetic), and the output equals a reference that applies the hand-computed factor per step,
not the output without a schedule (the wrong answer). Never re-merged: auto keeps them dynamic."""
import copy
from fractions import Fraction

import pytest
import torch

from comfyui_lora_runtime.standalone.host import folder_paths, sampling
from comfyui_lora_runtime.standalone.host.core_nodes import KSampler
from comfyui_lora_runtime.lora_runtime import AdapterSpec, ConfigError, LoraRuntimeError, applied, plan
from comfyui_lora_runtime.lora_runtime.layer.runtime_context import runtime_context
from comfyui_lora_runtime.lora_runtime.layer.schedule import (SamplingSchedules, Branch, parse_schedule,
                                                              parse_strength_list)
from comfyui_lora_runtime.nodes import lifecycle
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter, LoraMergeMode, LoraQualityTier

from testkit.nodes_helpers import CondPos, _weights

STEPS, SEED, CFG = 4, 42, 5.0
LINEAR = "linear 0:1, 0.5:0.5, 1:0"
LINEAR_FACTORS = [1.0, 0.75, 0.5, 0.25]   # at progress 0, 1/4, 1/2, 3/4: dyadic, so exact in floats


def _sigmas(steps):
    return torch.linspace(1.0, 0.0, steps + 1)


def _factors(text, steps):
    s = SamplingSchedules({"a": (parse_schedule(text), Branch.BOTH)}, _sigmas(steps), lambda p: 1.0 - p)
    return [s.multiplier("a", float(sig)) for sig in _sigmas(steps)[:-1]]


def test_each_steps_factor_is_the_interpolated_value():
    assert _factors(LINEAR, 4) == LINEAR_FACTORS
    assert _factors("0:1, 0.5:0.5, 1:0", 4) == [1.0, 1.0, 0.5, 0.5]      # the wrong answer: held keyframes
    # a non-dyadic case against exact rational arithmetic, rounded once: within one rounding of each
    # of the formula's three operations (so <= 4 ulp), and the documented formula bit for bit
    kfs = [(0.0, 1.0), (0.3, 0.2), (1.0, 0.9)]
    text = "linear " + ", ".join(f"{p}:{v}" for p, v in kfs)
    got = _factors(text, 7)
    for i, g in enumerate(got):
        p = i / 7
        (p0, v0), (p1, v1) = next((a, b) for a, b in zip(kfs, kfs[1:]) if a[0] <= p < b[0])
        assert g == v0 + (v1 - v0) * ((p - p0) / (p1 - p0))
        exact = Fraction(v0) + (Fraction(v1) - Fraction(v0)) * (Fraction(i, 7) - Fraction(p0)) / (
            Fraction(p1) - Fraction(p0))
        assert abs(Fraction(g) - exact) <= 4 * Fraction(abs(float(exact))) * Fraction(2) ** -52 + Fraction(2) ** -60
    # after the last keyframe the last value holds; a constant linear schedule is a strength
    assert _factors("linear 0:1, 0.5:0", 4) == [1.0, 0.5, 0.0, 0.0]
    assert parse_schedule("linear 0:0.5, 1:0.5").constant() == 0.5


@pytest.mark.parametrize("text,says", [
    ("linear 0.2:1, 1:0", "linear keyframes start at percent 0"),
    ("linear 1, 0.5", "a per-step list needs no 'linear'"),
    ("linear", "needs keyframes after it"),
    ("linear 0:1, 0.5:x", "not a number"),
])
def test_malformed_linear_schedules_name_the_input(text, says):
    with pytest.raises(ConfigError, match="strength_schedule") as ei:
        parse_schedule(text, where="Load LoRA Adapter (a.safetensors)")
    assert says in str(ei.value) and str(ei.value).startswith("Load LoRA Adapter (a.safetensors)")


def test_float_list_values():
    assert parse_strength_list([1, 0.5, 0.25]).per_step == (1.0, 0.5, 0.25)
    assert parse_strength_list(torch.tensor([1.0, 0.5])).per_step == (1.0, 0.5)
    assert parse_strength_list(None) is None
    for bad, says in [(0.5, "single number 0.5, not a list"), ([], "non-empty list"),
                      ([1, "x"], "value 2 ('x') is not a finite number"), ([1, 20], "value 2 (20) is out of range"),
                      (torch.zeros(2, 2), "shape (2, 2)")]:
        with pytest.raises(ConfigError, match="strength_list") as ei:
            parse_strength_list(bad, where="Load LoRA Adapter (a.safetensors)")
        assert says in str(ei.value), str(ei.value)


def _latent():
    return {"samples": torch.zeros(1, 16, 1, 8, 8)}


def _ksampler(model, steps=STEPS):
    pos, neg = CondPos().go("pos")[0], CondPos().go("neg")[0]
    return KSampler().sample(model, SEED, steps, CFG, "euler", "simple", pos, neg, _latent(), 1.0)[0]["samples"]


def _model(base, schedule="", strength_list=None, mode="dynamic", tier="exact"):
    m = LoadLoraAdapter().load(base, "style.safetensors", 0.8, strength_schedule=schedule,
                               strength_list=strength_list)["result"][0]
    return LoraQualityTier().set_tier(LoraMergeMode().set_mode(m, mode)[0], tier)[0]


def _reference(base, factors, tier="exact"):
    """The bundled sampler on a model function that applies the hand-computed factor of each step as
    the adapter's runtime scale (cfg batched: call i is step i), the adapter attached dynamically."""
    dm = base.model.diffusion_model
    path = folder_paths.get_full_path_or_raise("loras", "style.safetensors")
    p = plan(dm, [AdapterSpec(path, 0.8, "style.safetensors")], "dynamic", tier)
    pos, neg = CondPos().go("pos")[0], CondPos().go("neg")[0]
    calls = {"n": 0}
    with torch.no_grad(), applied(dm, p):
        def fn(x, t, c):
            m = factors[calls["n"]]
            calls["n"] += 1
            with runtime_context(adapters={"style.safetensors": (m, None)}):
                return dm(x, t, c)
        out = sampling.ksampler(fn, seed=SEED, steps=STEPS, cfg=CFG, sampler_name="euler", scheduler="simple",
                                positive=pos, negative=neg, latent=_latent(),
                                shift=float(base.get_model_object("model_sampling").shift))
    assert calls["n"] == STEPS
    return out["samples"]


@pytest.mark.parametrize("how", ["linear", "float list"])
def test_output_per_step_equals_the_hand_computed_factors(base, how):
    w0 = _weights(base)
    m = _model(base, schedule=LINEAR) if how == "linear" else _model(base, strength_list=list(LINEAR_FACTORS))
    got = _ksampler(m)
    assert torch.equal(got, _reference(base, LINEAR_FACTORS))
    ignored = _ksampler(_model(base))                                     # the wrong answer: no schedule
    assert (got - ignored).abs().mean() > 1e-3
    held = _ksampler(_model(base, schedule="0:1, 0.5:0.5, 1:0"))          # nor the held keyframes
    assert (got - held).abs().mean() > 1e-4
    assert lifecycle.last_report(m)["adapters"][0]["schedule_applied"] == "step 1 x1, step 2 x0.75, step 3 x0.5, " \
                                                                         "step 4 x0.25"
    assert all(torch.equal(w0[k], v) for k, v in _weights(base).items())


def test_auto_keeps_an_interpolated_schedule_dynamic_without_remerging(base):
    m = _model(base, schedule=LINEAR, mode="auto", tier="exact")
    got = _ksampler(m)
    d = lifecycle.last_report(m)["adapters"][0]["decision"]
    assert d["chosen"] == "dynamic" and "linear keyframes" in d["reason"]
    assert torch.equal(got, _ksampler(_model(base, schedule=LINEAR)))
    with pytest.raises(LoraRuntimeError, match="merge mode 'merge' cannot fold"):
        _ksampler(_model(base, strength_list=list(LINEAR_FACTORS), mode="merge"))


def test_a_float_list_and_a_schedule_together_is_an_error(base):
    with pytest.raises(LoraRuntimeError, match="strength_list is connected and strength_schedule is set"):
        LoadLoraAdapter().load(base, "style.safetensors", 1.0, strength_schedule="1, 0", strength_list=[1.0, 0.0])
    with pytest.raises(LoraRuntimeError, match=r"has 3 values but this sampler runs 4 steps"):
        _ksampler(_model(base, strength_list=[1.0, 0.5, 0.0]))


class FloatList:
    """Another pack's node that sends a whole float list as one FLOAT value (as KJNodes' float lists do)."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"text": ("STRING", {"default": ""})}}
    RETURN_TYPES = ("FLOAT",)
    FUNCTION = "go"

    def go(self, text):
        return ([float(v) for v in text.split(",")],)


def test_a_float_list_socket_in_a_workflow(folders):
    from comfyui_lora_runtime.standalone.host.executor import execute_prompt
    from testkit.nodes_helpers import CLASSES, Capture

    def prompt(**loader):
        return {
            "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan.safetensors",
                                                         "weight_dtype": "default"}},
            "11": {"class_type": "FloatList", "inputs": {"text": ", ".join(str(v) for v in LINEAR_FACTORS)}},
            "2": {"class_type": "LoraRuntimeLoadAdapter", "inputs": {
                "model": ["1", 0], "lora_name": "style.safetensors", "strength": 0.8, **loader}},
            "4": {"class_type": "LoraRuntimeQualityTier", "inputs": {"model": ["2", 0], "tier": "exact"}},
            "5": {"class_type": "CondPos", "inputs": {"which": "pos"}},
            "6": {"class_type": "CondPos", "inputs": {"which": "neg"}},
            "7": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1,
                                                                      "batch_size": 1}},
            "8": {"class_type": "KSampler", "inputs": {
                "model": ["4", 0], "seed": SEED, "steps": STEPS, "cfg": CFG, "sampler_name": "euler",
                "scheduler": "simple", "positive": ["5", 0], "negative": ["6", 0], "latent_image": ["7", 0],
                "denoise": 1.0}},
            "9": {"class_type": "Capture", "inputs": {"samples": ["8", 0]}}}

    classes = {**CLASSES, "FloatList": FloatList}
    Capture.seen.clear()
    execute_prompt(prompt(strength_list=["11", 0]), classes, folders=folders)
    execute_prompt(prompt(strength_schedule=LINEAR), classes, folders=folders)
    execute_prompt(prompt(), classes, folders=folders)
    listed, linear, plain = Capture.seen[-3:]
    assert torch.equal(listed, linear) and not torch.equal(listed, plain)
