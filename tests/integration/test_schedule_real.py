"""Strength schedules and branches in a real ComfyUI (issue 12; CPU, runs with COMFYUI_DIR).

The step and the branch come from ComfyUI's own sampler: our APPLY_MODEL wrapper reads each
model call's ``transformer_options["sigmas"]`` and ``["cond_or_uncond"]``. Checked against
what ComfyUI itself can build:

1. schedule '1, 1, 0, 0' on a KSampler == ComfyUI's two-stage KSamplerAdvanced (steps 0-2 on
   the model with the adapter, leftover noise, steps 2-4 on the bare model) within PSNR 40 dB
   (the two-stage split itself costs that much: see test_any_sampler_real), and far from the
   same KSampler with the schedule ignored; '1, 1, 1, 1' == no schedule bit for bit; keyframes
   '0:1, 0.5:0' == '1, 1, 0, 0' bit for bit (simple scheduler: uniform in model time).
2. cfg 1 (ComfyUI samples the positive only: cond_or_uncond [0]): branch 'positive only' ==
   'both' bit for bit, 'negative only' == the bare model bit for bit; at cfg 5 'positive only'
   differs from both 'both' and the bare model.
3. A two-call sampler (heun) and an ancestral one with a mid-step call (dpmpp_2s_ancestral) run
   with the schedule, and the report names the multipliers the model calls used.
"""
from __future__ import annotations

import pytest

from testkit.comfyui.prompts import SETTINGS, Prompt, assert_bitwise, assert_changed, assert_psnr, reports_sent, run
from testkit.lora_assets import install_model_and_lora, psnr

LORA = "it_sched_style.safetensors"


@pytest.fixture(scope="module")
def cond_class(comfy):
    return comfy.helper_cond_class


@pytest.fixture(scope="module")
def sched_assets(comfy, reference):
    return install_model_and_lora(comfy, reference, LORA, seed=101)


def _ours(p: Prompt, nid: str, schedule="", branch="both", strength=1.0, model=("1", 0)) -> list:
    return p.chain(nid, LORA, model=model, strength=strength, strength_schedule=schedule, branch=branch)


def _two_stage_split(p: Prompt, nid: str, first_model, second_model, half: int):
    s = SETTINGS
    first = str(int(nid) + 1)
    common = dict(noise_seed=s["seed"], steps=s["steps"], cfg=s["cfg"], sampler_name=s["sampler_name"],
                  scheduler=s["scheduler"], positive=["2", 0], negative=["3", 0])
    p.node(first, "KSamplerAdvanced", model=first_model, add_noise="enable", latent_image=["40", 0],
           start_at_step=0, end_at_step=half, return_with_leftover_noise="enable", **common)
    p.node(nid, "KSamplerAdvanced", model=second_model, add_noise="disable", latent_image=[first, 0],
           start_at_step=half, end_at_step=10000, return_with_leftover_noise="disable", **common)
    p._save(nid, [nid, 0])


def test_schedule_in_comfyui_matches_a_two_stage_split(sched_assets, cond_class):
    assert SETTINGS["steps"] == 4
    p = Prompt(cond_class)
    p.ksampler("100", ["1", 0])                                        # bare
    p.ksampler("101", _ours(p, "110"))                                 # constant
    p.ksampler("102", _ours(p, "120", schedule="1, 1, 0, 0"))
    p.ksampler("103", _ours(p, "130", schedule="1, 1, 1, 1"))
    p.ksampler("104", _ours(p, "140", schedule="0:1, 0.5:0"))
    _two_stage_split(p, "105", _ours(p, "150"), ["1", 0], half=2)
    record, lat = run(sched_assets, p)
    bare, const, sched = lat["100"], lat["101"], lat["102"]
    assert_bitwise(lat["103"], const, "all-1.0 schedule vs no schedule")
    assert_bitwise(lat["104"], sched, "keyframes 0:1, 0.5:0 vs per-step 1, 1, 0, 0")
    assert_psnr(sched, lat["105"], "schedule 1,1,0,0 vs two-stage split (adapter, then bare)")
    assert psnr(const, lat["105"]) < psnr(sched, lat["105"]) - 6, "the schedule-ignored answer is as close"
    assert_changed(sched, bare, "scheduled")
    rep = {r["node"]: r["report"] for r in reports_sent(record)}
    a = rep["102"]["adapters"][0]
    assert a["schedule_applied"] == "steps 1-2 x1, steps 3-4 x0", a
    assert a["decision"]["chosen"] == "dynamic"


def test_branches_follow_comfyuis_cond_or_uncond(sched_assets, cond_class):
    p = Prompt(cond_class)
    cfg1 = dict(SETTINGS, cfg=1.0)

    def ks(nid, model, settings):
        p.node(nid, "KSampler", model=model, positive=["2", 0], negative=["3", 0], latent_image=["40", 0],
               denoise=1.0, **settings)
        p._save(nid, [nid, 0])
    ks("200", ["1", 0], cfg1)
    ks("201", _ours(p, "210"), cfg1)
    ks("202", _ours(p, "220", branch="positive only"), cfg1)
    ks("203", _ours(p, "230", branch="negative only"), cfg1)
    ks("204", ["1", 0], SETTINGS)
    ks("205", _ours(p, "240"), SETTINGS)
    ks("206", _ours(p, "250", branch="positive only"), SETTINGS)
    _, lat = run(sched_assets, p)
    assert_bitwise(lat["202"], lat["201"], "cfg 1, positive only vs both")
    assert_bitwise(lat["203"], lat["200"], "cfg 1, negative only vs bare")
    assert_changed(lat["206"], lat["204"], "cfg 5, positive only vs bare")
    d = float((lat["206"] - lat["205"]).norm() / lat["205"].norm())
    assert d > 1e-3, f"cfg 5: positive only is {d:.2%} from both (the wrong answer)"


@pytest.mark.parametrize("sampler", ["heun", "dpmpp_2s_ancestral"])
def test_multi_call_samplers_report_the_multipliers_used(sched_assets, cond_class, sampler):
    p = Prompt(cond_class)
    settings = dict(SETTINGS, sampler_name=sampler)
    for nid, model in (("300", _ours(p, "310", schedule="1, 1, 0, 0")), ("301", ["1", 0]),
                       ("302", _ours(p, "320"))):
        p.node(nid, "KSampler", model=model, positive=["2", 0], negative=["3", 0], latent_image=["40", 0],
               denoise=1.0, **settings)
        p._save(nid, [nid, 0])
    record, lat = run(sched_assets, p)
    rep = {r["node"]: r["report"] for r in reports_sent(record)}
    assert rep["300"]["adapters"][0]["schedule_applied"] == "steps 1-2 x1, steps 3-4 x0"
    assert_changed(lat["300"], lat["301"], f"{sampler} scheduled vs bare")
    d = float((lat["300"] - lat["302"]).norm() / lat["302"].norm())
    assert d > 1e-3, f"{sampler}: scheduled is {d:.2%} from constant (the wrong answer)"
