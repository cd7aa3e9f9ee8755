"""Strength schedules and branches end to end (issue 12), through the host's stock KSampler:
the step and the branch come from the sampler's own model calls (APPLY_MODEL hook: the call's
sigma against the SAMPLER_SAMPLE sigmas, and cond_or_uncond), never from the node.

Each result is compared with a hand-built reference (the bundled sampler driven by a
model function that switches adapters itself) and with the wrong answer (schedule ignored)."""
import copy
import math

import pytest
import torch

from comfyui_lora_runtime.standalone.host import folder_paths, sampling
from comfyui_lora_runtime.standalone.host.core_nodes import KSampler
from comfyui_lora_runtime.lora_runtime import AdapterSpec, LoraRuntimeError, applied, plan
from comfyui_lora_runtime.lora_runtime.layer.wrapper import runtime_leftovers
from comfyui_lora_runtime.nodes import lifecycle, report
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter, LoraMergeMode, LoraQualityTier

from testkit.nodes_helpers import CondPos, _weights
from comfyui_lora_runtime.standalone.host import model_management

STEPS, SEED, CFG = 6, 42, 5.0


def _latent():
    return {"samples": torch.zeros(1, 16, 1, 8, 8)}


def _conds():
    return CondPos().go("pos")[0], CondPos().go("neg")[0]


def _ksampler(model, steps=STEPS, cfg=CFG):
    pos, neg = _conds()
    return KSampler().sample(model, SEED, steps, cfg, "euler", "simple", pos, neg, _latent(), 1.0)[0]["samples"]


def _model(base, strength=0.8, schedule="", branch="both", mode="dynamic", tier="exact", lora="style.safetensors"):
    m = LoadLoraAdapter().load(base, lora, strength, strength_schedule=schedule, branch=branch)["result"][0]
    return LoraQualityTier().set_tier(LoraMergeMode().set_mode(m, mode)[0], tier)[0]


def _reference(base, pick, tier="exact", steps=STEPS, cfg=CFG, lora="style.safetensors", strength=0.8):
    """The bundled KSampler on a model function that decides itself, per call, what each row gets:
    pick(call_index, with_adapter(x,t,c), without(x,t,c), x, t, c) -> output. `with` is the DiT with
    the adapter applied dynamically at constant strength, `without` a copy with no adapter at all."""
    dm = base.model.diffusion_model
    bare = copy.deepcopy(dm)
    path = folder_paths.get_full_path_or_raise("loras", lora)
    p = plan(dm, [AdapterSpec(path, strength, lora)], "dynamic", tier)
    pos, neg = _conds()
    calls = {"n": 0}
    with torch.no_grad(), applied(dm, p):
        def fn(x, t, c):
            i = calls["n"]
            calls["n"] += 1
            return pick(i, dm, bare, x, t, c)
        out = sampling.ksampler(fn, seed=SEED, steps=steps, cfg=cfg, sampler_name="euler", scheduler="simple",
                                positive=pos, negative=neg if cfg != 1.0 else None, latent=_latent(),
                                shift=float(base.get_model_object("model_sampling").shift))
    assert runtime_leftovers(dm) == []
    return out["samples"]


def _psnr(a, ref):
    peak = float(ref.max() - ref.min())
    mse = float((a.double() - ref.double()).pow(2).mean())
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


def test_all_ones_schedule_equals_no_schedule_bitwise(base):
    plain = _ksampler(_model(base))
    assert torch.equal(_ksampler(_model(base, schedule=", ".join(["1"] * STEPS))), plain)
    assert torch.equal(_ksampler(_model(base, schedule="0:1")), plain)                   # keyframe form
    # the schedule is live: one step at 0 changes the result; and the adapter itself is on
    assert not torch.equal(_ksampler(_model(base, schedule=", ".join(["1"] * (STEPS - 1) + ["0"]))), plain)
    assert (plain - _ksampler(base)).abs().mean() > 1e-2


@pytest.mark.parametrize("k", [2, 4])
def test_zero_after_step_k_equals_k_steps_with_and_the_rest_without(base, k):
    w0 = _weights(base)
    sched = ", ".join(["1"] * k + ["0"] * (STEPS - k))
    # cfg batched: one model call per step, so call i is step i
    ref = _reference(base, lambda i, dm, bare, x, t, c: (dm if i < k else bare)(x, t, c))
    got = _ksampler(_model(base, schedule=sched))
    assert torch.equal(got, ref)                                                         # exact: bitwise
    ignored = _ksampler(_model(base))                                                    # schedule ignored
    assert not torch.equal(got, ignored) and (got - ignored).abs().mean() > 1e-3
    lossless = _ksampler(_model(base, schedule=sched, tier="lossless"))
    assert _psnr(lossless, ref) >= 40.0, _psnr(lossless, ref)
    assert _psnr(ignored, ref) < _psnr(lossless, ref) - 10                               # far from the wrong one
    assert all(torch.equal(w0[key], v) for key, v in _weights(base).items())


def test_keyframes_switch_where_the_sigma_crosses_the_percent(base):
    ms = base.get_model_object("model_sampling")
    sigmas = sampling.flow_sigmas(STEPS, "simple", shift=float(ms.shift))
    start = float(torch.tensor(ms.percent_to_sigma(0.5), dtype=torch.float32))
    k = sum(1 for s in sigmas[:-1] if float(s) > start)   # steps before the keyframe takes effect
    assert 0 < k < STEPS
    got = _ksampler(_model(base, schedule="0:1, 0.5:0"))
    assert torch.equal(got, _ksampler(_model(base, schedule=", ".join(["1"] * k + ["0"] * (STEPS - k)))))
    assert not torch.equal(got, _ksampler(_model(base)))


@pytest.mark.parametrize("tier", ["exact", "lossless"])
def test_positive_only_on_a_cfg_batch(base, tier):
    def pos_rows_only(i, dm, bare, x, t, c):
        # the bundled CFG batch is [negative rows, positive rows]: adapter output on the second half only
        n = x.shape[0] // 2
        return torch.cat([bare(x, t, c)[:n], dm(x, t, c)[n:]])
    ref = _reference(base, pos_rows_only, tier=tier)
    got = _ksampler(_model(base, branch="positive only", tier=tier))
    if tier == "exact":
        assert torch.equal(got, ref)
    else:  # lossless: same path up to the tier's closeness (fp32 model; reordered sums)
        assert _psnr(got, ref) >= 40.0
    both = _ksampler(_model(base, tier=tier))
    off = _ksampler(base)
    assert (got - both).abs().mean() > 1e-3 and (got - off).abs().mean() > 1e-3         # the wrong answers
    neg_ref = _reference(base, lambda i, dm, bare, x, t, c: torch.cat(
        [dm(x, t, c)[:x.shape[0] // 2], bare(x, t, c)[x.shape[0] // 2:]]), tier=tier)
    neg = _ksampler(_model(base, branch="negative only", tier=tier))
    assert (torch.equal(neg, neg_ref) if tier == "exact" else _psnr(neg, neg_ref) >= 40.0)
    assert (neg - got).abs().mean() > 1e-3


def test_positive_only_at_cfg_1_is_the_adapter_and_negative_only_is_nothing(base):
    # cfg 1: only the positive is sampled (one chunk, cond_or_uncond [0])
    assert torch.equal(_ksampler(_model(base, branch="positive only"), cfg=1.0), _ksampler(_model(base), cfg=1.0))
    assert torch.equal(_ksampler(_model(base, branch="negative only"), cfg=1.0), _ksampler(base, cfg=1.0))


def test_auto_keeps_the_scheduled_adapter_dynamic_and_the_report_says_why(base):
    const = _model(base, mode="auto", lora="style.safetensors")
    _ksampler(const)
    assert lifecycle.last_report(const)["adapters"][0]["decision"]["chosen"] == "merge"
    m = _model(base, mode="auto", schedule="1, 1, 1, 0, 0, 0")
    got = _ksampler(m)
    r = lifecycle.last_report(m)
    a = r["adapters"][0]
    assert a["decision"]["chosen"] == "dynamic" and "schedule" in a["decision"]["reason"]
    assert a["schedule_applied"] == "steps 1-3 x1, steps 4-6 x0"
    assert "applied: steps 1-3 x1, steps 4-6 x0" in report.text(r)
    assert torch.equal(got, _ksampler(_model(base, mode="dynamic", schedule="1, 1, 1, 0, 0, 0")))
    b = _model(base, mode="auto", branch="positive only")
    _ksampler(b)
    d = lifecycle.last_report(b)["adapters"][0]["decision"]
    assert d["chosen"] == "dynamic" and "positive branch only" in d["reason"]


def test_malformed_and_mismatched_schedules_fail_clearly_and_touch_nothing(base):
    with pytest.raises(LoraRuntimeError, match=r"Load LoRA Adapter \(style.safetensors\).*strictly increasing"):
        LoadLoraAdapter().load(base, "style.safetensors", 1.0, strength_schedule="0.5:1, 0.2:0")
    with pytest.raises(LoraRuntimeError, match=r"Load LoRA Adapter \(style.safetensors\).*strength_schedule.*not a "
                                                r"number"):  # the form is checked when the node runs
        LoadLoraAdapter().load(base, "style.safetensors", 1.0, strength_schedule="1, x")
    assert LoadLoraAdapter.VALIDATE_INPUTS("style.safetensors") is True
    w0 = _weights(base)
    m = _model(base, schedule="1, 1, 0", mode="auto")
    with pytest.raises(LoraRuntimeError, match="has 3 values but this sampler runs 6 steps"):
        _ksampler(m)
    assert runtime_leftovers(base.model.diffusion_model) == []
    assert all(torch.equal(w0[k], v) for k, v in _weights(base).items())
    with pytest.raises(LoraRuntimeError, match="merge mode 'merge' cannot fold"):
        _ksampler(_model(base, schedule="1, 1, 1, 0, 0, 0", mode="merge"))
    assert all(torch.equal(w0[k], v) for k, v in _weights(base).items())


def test_a_two_call_sampler_maps_each_call_by_its_sigma(base):
    """Heun calls the model at sigmas[i] and again at sigmas[i+1]: the second call is step i+1
    (schedule.py), so with '1,1,1,0,0,0' the corrector of step 2 already runs without the adapter."""
    k = 3
    sched = ", ".join(["1"] * k + ["0"] * (STEPS - k))
    pos, neg = _conds()
    m = _model(base, schedule=sched)
    got = KSampler().sample(m, SEED, STEPS, CFG, "heun", "simple", pos, neg, _latent(), 1.0)[0]["samples"]
    sigmas = sampling.flow_sigmas(STEPS, "simple", shift=float(base.get_model_object("model_sampling").shift))
    t_k = float(sigmas[k] * 1000)  # the DiT's timestep at sigmas[k], the same fp32 product the sampler makes

    def by_sigma(i, dm, bare, x, t, c):  # the documented rule: step < k  <=>  sigma > sigmas[k]
        return (dm if float(t[0]) > t_k else bare)(x, t, c)

    def by_call_count(i, dm, bare, x, t, c):  # the wrong rule: a step's calls share the step's value
        return (dm if i // 2 < k else bare)(x, t, c)

    def heun_reference(pick):
        model_management.unload_all_models()  # the references run on the pristine weights
        dm = base.model.diffusion_model
        bare = copy.deepcopy(dm)
        p = plan(dm, [AdapterSpec(folder_paths.get_full_path_or_raise("loras", "style.safetensors"), 0.8,
                                  "style.safetensors")], "dynamic", "exact")
        calls = {"n": 0}
        with torch.no_grad(), applied(dm, p):
            def fn(x, t, c):
                calls["n"] += 1
                return pick(calls["n"] - 1, dm, bare, x, t, c)
            out = sampling.ksampler(fn, seed=SEED, steps=STEPS, cfg=CFG, sampler_name="heun", scheduler="simple",
                                    positive=pos, negative=neg, latent=_latent(),
                                    shift=float(base.get_model_object("model_sampling").shift))
        assert calls["n"] == 2 * STEPS - 1  # the last step (to sigma 0) is a plain Euler step
        return out["samples"]
    assert torch.equal(got, heun_reference(by_sigma))
    assert not torch.equal(got, heun_reference(by_call_count))
    assert lifecycle.last_report(m)["adapters"][0]["schedule_applied"] == "steps 1-3 x1, steps 4-6 x0"
