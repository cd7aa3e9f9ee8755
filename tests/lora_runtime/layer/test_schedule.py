"""Strength schedules and branches (issue 12): parsing, validation, which step a model call
belongs to, keyframes in ComfyUI's start_percent convention, per-row branch masks, and the
merge decision for an adapter whose strength varies."""
import pytest
import torch

from comfyui_lora_runtime.standalone.host.model_patcher import ModelSamplingFlow
from comfyui_lora_runtime.standalone.host.sampling import flow_sigmas
from comfyui_lora_runtime.lora_runtime import AdapterSpec, ConfigError, LoraInjector, MergeMode, plan
from comfyui_lora_runtime.lora_runtime.layer.runtime_context import current_context
from comfyui_lora_runtime.lora_runtime.layer.schedule import (Branch, SamplingSchedules, model_call_context, parse_branch,
                                                        parse_schedule, sampling_schedules, varies)

from testkit.fixtures import TinyWanLike, make_adapter_tensors, write_kohya


# --- formats ---------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["1, 1, 0.5, 0", "[1, 1, 0.5, 0]", "1 1 0.5 0", "1;1;0.5;0", "1,1,0.5,0,",
                                  [1, 1, 0.5, 0]])
def test_per_step_forms(text):
    s = parse_schedule(text)
    assert s.per_step == (1.0, 1.0, 0.5, 0.0) and not s.keyframes


def test_keyframes_and_empty():
    s = parse_schedule(" 0:1, 0.5 : 0.25 ,1:0 ")
    assert s.keyframes == ((0.0, 1.0), (0.5, 0.25), (1.0, 0.0)) and not s.per_step
    assert parse_schedule("") is None and parse_schedule("  ") is None and parse_schedule(None) is None


@pytest.mark.parametrize("text, says", [
    ("1, a, 0", "'a' is not a number"),
    ("1, inf", "not finite"),
    ("1, 11", "out of range"),
    ("0:1, 2", "mixes per-step values and keyframes"),
    ("0:1, 1.5:0", "outside [0, 1]"),
    ("0.5:1, 0.2:0", "strictly increasing"),   # non-monotone
    ("0.5:1, 0.5:0", "strictly increasing"),   # duplicate percent
    ("0:x", "is not a number"),
    ("0:1, 0.5:-20", "out of range"),
])
def test_malformed_schedules_name_the_node_and_the_fix(text, says):
    with pytest.raises(ConfigError) as e:
        parse_schedule(text, where="Load LoRA Adapter (x.safetensors)")
    msg = str(e.value)
    assert says in msg and "Load LoRA Adapter (x.safetensors)" in msg, msg


def test_length_must_match_the_steps_the_sampler_runs():
    sigmas = flow_sigmas(8, "simple", shift=8.0)
    SamplingSchedules({"a": (parse_schedule("1,1,1,1,0,0,0,0"), Branch.BOTH)}, sigmas)  # fits
    with pytest.raises(ConfigError) as e:
        SamplingSchedules({"a": (parse_schedule("1,1,0"), Branch.BOTH)}, sigmas, where={"a": "Load LoRA Adapter 'a'"})
    assert "has 3 values but this sampler runs 8 steps" in str(e.value) and "keyframes" in str(e.value)


# --- which step a model call belongs to ------------------------------------------------
def test_step_of_a_model_call():
    sigmas = flow_sigmas(6, "simple", shift=8.0)
    s = SamplingSchedules({"a": (parse_schedule("0,1,2,3,4,5"), Branch.BOTH)}, sigmas)
    sig = [float(v) for v in sigmas]
    for i in range(6):
        assert s.step_of(sig[i]) == i                              # Euler & co: the step's own sigma
        assert s.multiplier("a", sig[i]) == float(i)
        assert s.step_of((sig[i] + sig[i + 1]) / 2) == i           # DPM++ 2S midpoint, adaptive trials
    for i in range(5):
        assert s.step_of(sig[i + 1]) == i + 1                      # Heun's 2nd call: at step i+1's sigma
    assert s.step_of(sig[0] * 1.5) == 0                            # ancestral churn above sigma_0
    assert s.step_of(0.0) == 5                                     # at sigma 0: the last step


def test_keyframes_follow_comfyui_start_percent_convention():
    ms = ModelSamplingFlow(shift=8.0)
    sigmas = flow_sigmas(10, "simple", shift=8.0)
    s = SamplingSchedules({"a": (parse_schedule("0:1, 0.5:0"), Branch.BOTH)}, sigmas, ms.percent_to_sigma)
    start = ms.percent_to_sigma(0.5)  # ComfyUI: a keyframe applies where start_sigma >= sigma (fp32 tensor)
    got = [s.multiplier("a", float(v)) for v in sigmas[:-1]]
    want = [0.0 if bool(start >= v) else 1.0 for v in sigmas[:-1]]
    assert got == want and 0 < got.count(0.0) < 10
    # "simple" is uniform in model time, so percent 0.5 is the second half of the steps
    assert got == [1.0] * 5 + [0.0] * 5
    # before the first keyframe the multiplier is 1.0 (ComfyUI's rule)
    late = SamplingSchedules({"a": (parse_schedule("0.3:0.5"), Branch.BOTH)}, sigmas, ms.percent_to_sigma)
    assert late.multiplier("a", float(sigmas[0])) == 1.0 and late.multiplier("a", float(sigmas[-2])) == 0.5
    assert ms.percent_to_sigma(0.0) == 1.0 and ms.percent_to_sigma(1.0) == 0.0


# --- branches -----------------------------------------------------------------------------
def test_branch_rows_follow_cond_or_uncond():
    sigmas = flow_sigmas(4, "simple", shift=8.0)
    s = SamplingSchedules({"pos": (None, Branch.POSITIVE), "neg": (None, Branch.NEGATIVE),
                           "both": (parse_schedule("1,0.5,0,0"), Branch.BOTH)}, sigmas)
    sig0 = float(sigmas[1])
    out = s.call_scales(sig0, [1, 0], 4, "cpu")  # bundled/ComfyUI CFG batch: negative rows first here
    assert out["pos"][0] == 1.0 and out["pos"][1].tolist() == [0, 0, 1, 1]
    assert out["neg"][1].tolist() == [1, 1, 0, 0]
    assert out["both"] == (0.5, None)
    one = s.call_scales(sig0, [0], 2, "cpu")     # a call of the positive rows only: no mask, a scalar
    assert one["pos"] == (1.0, None) and one["neg"] == (0.0, None)
    assert s.call_scales(sig0, [1], 2, "cpu")["pos"] == (0.0, None)
    with pytest.raises(ConfigError, match="equal cond/uncond"):
        s.call_scales(float(sigmas[0]), [1, 0], 3, "cpu")


def test_model_call_context_sets_the_factors_only_inside_a_sampling():
    sigmas = flow_sigmas(2, "simple", shift=8.0)
    s = SamplingSchedules({"a": (parse_schedule("0.25, 0"), Branch.POSITIVE)}, sigmas)
    x = torch.zeros(4, 3)
    with model_call_context(x, sigmas[0].expand(2), [1, 0]):
        assert current_context() is None  # no sampling: nothing set
    with sampling_schedules(s), model_call_context(x, sigmas[0].expand(2), [1, 0]) as ctx:
        m, mask = ctx.adapter_factor("a")
        assert m == 0.25 and mask.tolist() == [0, 0, 1, 1]
        assert ctx.adapter_factor("other") == (1.0, None)
    assert s.applied("a") == "step 1 x0.25"


# --- the merge decision ---------------------------------------------------------------------
def _model_and_file(tmp_path, dtype=torch.bfloat16):
    m = TinyWanLike(dtype=dtype)
    write_kohya(tmp_path / "a.safetensors", make_adapter_tensors(m, scale=0.3), alpha=4.0)
    return m, str(tmp_path / "a.safetensors")


def test_auto_keeps_a_varying_adapter_dynamic_and_says_why(tmp_path):
    m, f = _model_and_file(tmp_path)
    const = plan(m, [AdapterSpec(f, 1.0, "a")], "auto", "exact")
    inj = LoraInjector(m)
    try:
        assert inj.apply(const).decision.adapters[0].chosen == "merge"  # this adapter merges when constant
        inj.clear()
        for spec in (AdapterSpec(f, 1.0, "a", schedule=parse_schedule("1,1,0,0")),
                     AdapterSpec(f, 1.0, "a", schedule=parse_schedule("0:1, 0.5:0.5")),
                     AdapterSpec(f, 1.0, "a", branch="positive only")):
            d = inj.apply(plan(m, [spec], "auto", "exact")).decision.adapters[0]
            assert d.chosen == "dynamic" and d.share_lost is None, spec
            assert "stays unmerged" in d.reason and "re-merge" in d.reason, d.reason
            inj.clear()
        # constant schedules do not vary: all 1.0 keeps today's decision
        d = inj.apply(plan(m, [AdapterSpec(f, 1.0, "a", schedule=parse_schedule("1,1,1"))], "auto")).decision
        assert d.adapters[0].chosen == "merge"
    finally:
        inj.clear()


def test_a_constant_schedule_is_a_strength(tmp_path):
    m, f = _model_and_file(tmp_path)
    p = plan(m, [AdapterSpec(f, 0.8, "a", schedule=parse_schedule("0.5, 0.5, 0.5"))], "auto")
    assert p.adapters[0].spec.strength == 0.8 * 0.5 and p.adapters[0].spec.schedule is None
    p = plan(m, [AdapterSpec(f, 0.8, "a", schedule=parse_schedule("1, 1"))], "auto")
    assert p.adapters[0].spec.strength == 0.8 and p.adapters[0].spec.schedule is not None  # kept, unit


def test_merge_mode_refuses_a_varying_adapter(tmp_path):
    m, f = _model_and_file(tmp_path)
    inj = LoraInjector(m)
    w0 = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ConfigError) as e:
        inj.apply(plan(m, [AdapterSpec(f, 1.0, "a", schedule=parse_schedule("1, 0"))], MergeMode.MERGE))
    inj.clear()
    assert "'auto'" in str(e.value) and "'dynamic'" in str(e.value) and "'a'" in str(e.value)
    assert all(torch.equal(w0[k], v) for k, v in m.state_dict().items())


def test_varies():
    assert varies(None, Branch.BOTH) == "" and varies(parse_schedule("1,1"), Branch.BOTH) == ""
    assert "schedule" in varies(parse_schedule("1,0"), Branch.BOTH)
    assert "positive branch only" in varies(None, Branch.POSITIVE)


def test_a_branch_is_parsed_once_at_the_boundary():
    """The node and `plan` parse the text; the sampling schedules take the typed value only, so a
    string reaching them is a programming error, not a branch silently read as 'negative'."""
    sigmas = flow_sigmas(2, "simple", shift=8.0)
    with pytest.raises(TypeError, match="parse_branch"):
        SamplingSchedules({"a": (None, "positive only")}, sigmas)
    assert SamplingSchedules({"a": (None, parse_branch("positive only"))}, sigmas).entries["a"][1] is Branch.POSITIVE
