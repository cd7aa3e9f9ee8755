"""Any sampler that samples a MODEL our nodes touched applies the adapters (real ComfyUI, CPU).

Graph as in test_workflows_real.py: UNETLoader (tiny Wan 2.1) -> Load LoRA Adapter ->
Merge Mode -> Quality Tier -> a sampler -> SaveLatent, conditioning from the test-only
helper node; the adapters are the files test_workflows_real.py writes (same seeds,
same bytes). A LATENT pass-through with a unique tag (helper node) sits in front of the
samplers so that no sampler output comes from ComfyUI's cache while the model chain does.

1. LoRA Sampler, KSampler, KSamplerAdvanced (whole schedule), SamplerCustomAdvanced
   (RandomNoise + CFGGuider + KSamplerSelect + BasicScheduler), SamplerCustom and a
   two-stage KSamplerAdvanced (0-2 with leftover noise, 2-end), all in one prompt on the
   same MODEL: KSampler == LoRA Sampler == KSamplerAdvanced bit for bit, the others PSNR
   >= 40 dB, all far from the no-adapter latent (which a bare KSampler in the same prompt
   still gives), one lora_runtime.report event per sampler naming it; per mode dynamic /
   merge. Also the repo's embedded_style workflow with the stock samplers beside its own.
2. ComfyUI's LoraLoaderModelOnly before our Load LoRA Adapter, between it and Merge
   Mode, and after Merge Mode: all give ComfyUI's own composition (its LoRA + ours), ours
   still changes the output, the report counts the layers that carry ComfyUI's patch beside
   ours (host_patched: 20 or 5), and the weights after unload_all_models hash like a fresh
   load, with the same state_dict keys. (Core's V3 stack node, LoadLoraModel, is not in
   ComfyUI 0.33: its LoraLoaderModelOnly is the ComfyUI side here.)
3. Two branches of one UNETLoader with different adapters (one also with ComfyUI's LoRA),
   two KSamplers, one prompt: each equals its branch run alone, bit for bit; a third,
   bare branch equals the no-adapter latent.
4. partially_unload / partially_load forced between runs and in the middle of a run
   (DIFFUSION_MODEL wrapper at the 2nd model call, optionally partially_load at the 3rd),
   with and without ComfyUI's LoRA upstream: sampling succeeds with the same latent, the
   state_dict keys while the adapters are attached and after are a fresh load's, the
   weights after unload_all_models hash like a fresh load. An interrupted stock KSampler
   leaves the weights like a fresh load too.
5. A stock KSampler + LoRA Runtime Report: /history has the report node's lora_report
   (decision, coverage) and the websocket event lora_runtime.report names the KSampler.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from testkit.comfyui.prompts import (LORA_A, LORA_B, LORA_PART, MIN_EFFECT, STATE, Prompt, assert_bitwise,
                                     assert_changed, assert_psnr, rel_diff, reports_sent, run)
from testkit.lora_assets import BLOCKS, LATENT_TAG, MODEL

N_LAYERS = 4 * 2 * BLOCKS + 2 * BLOCKS  # 20 Linear layers an adapter covers

PARTIAL = "ZZLoraRuntimeTestPartialLoad"
MIDRUN = "ZZLoraRuntimeTestUnloadMidRun"

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------
# the weights of a fresh load (fixtures assets, cond_class, fresh, no_adapter: tests/integration/conftest.py)
# ---------------------------------------------------------------------------
def weight_state(comfy, *, unload_all=True, must_share_model=True) -> dict:
    """The helper state node on the (cached) UNETLoader output: unload_all_models(), then hash/keys."""
    p = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL, "weight_dtype": "default"}},
         "99": {"class_type": STATE, "inputs": {"model": ["1", 0], "unload_all": unload_all}}}
    rec = comfy.run(p)
    if must_share_model:
        assert "1" in rec["cached"], "the model was reloaded: its weights after the runs would not be checked"
    return rec["history"]["outputs"]["99"]["zz_weight_state"][0]


def assert_weights_fresh(comfy, fresh, what=""):
    st = weight_state(comfy)
    assert st["keys"] == fresh["keys"], (what, sorted(set(st["keys"]) ^ set(fresh["keys"])))
    assert not st["leftovers"], f"{what}: modules still patched after unload_all_models: {st['leftovers']}"
    assert st["hash"] == fresh["hash"], f"{what}: the weights after unload_all_models differ from a fresh load"
    return st


# ---------------------------------------------------------------------------
# 1. every sampler applies the adapters
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["dynamic", "merge"])
def test_every_sampler_applies_the_adapter(assets, cond_class, no_adapter, fresh, mode):
    p = Prompt(cond_class)
    m = p.ours(["1", 0], [(LORA_A, 1.0)], mode, "exact")
    p.ksampler("5", m, "LoraRuntimeSampler")
    p.ksampler("6", m)
    p.ksampler_advanced("50", m)
    p.sampler_custom_advanced("60", m)
    p.sampler_custom("70", m)
    p.ksampler_two_stage("80", m)
    p.ksampler("7", ["1", 0])  # bare model, same prompt: nothing leaks from the adapter runs
    rec, out = run(assets, p)

    assert_bitwise(out["7"], no_adapter, "bare KSampler in the same prompt vs the no-adapter run")
    assert_bitwise(out["6"], out["5"], f"{mode}: KSampler vs LoRA Sampler")
    assert_bitwise(out["50"], out["6"], f"{mode}: KSamplerAdvanced vs KSampler")
    assert_psnr(out["60"], out["6"], f"{mode}: SamplerCustomAdvanced vs KSampler")
    assert_psnr(out["70"], out["6"], f"{mode}: SamplerCustom vs KSampler")
    assert_psnr(out["80"], out["6"], f"{mode}: KSamplerAdvanced steps 0-2 + 2-4 vs KSampler")
    for nid in ("5", "6", "50", "60", "70", "80"):
        assert torch.isfinite(out[nid]).all(), nid
        assert_changed(out[nid], no_adapter, f"{mode}: sampler {nid} ({p.p[nid]['class_type']})")

    # the lora_runtime.report event, once per adapter sampling, names the sampler node
    sent = reports_sent(rec)
    assert sorted(d["node"] for d in sent) == sorted(["5", "6", "50", "60", "70", "81", "80"]), sent
    for d in sent:
        assert d["prompt_id"] == rec["prompt_id"] and d["display_node"] == d["node"], d
        assert d["report"]["decision"]["chosen"] == mode, (d["node"], d["report"]["decision"])
        assert d["report"]["adapters"][0]["coverage"]["matched"] == N_LAYERS, d["report"]["adapters"]
    assert rec["history"]["outputs"]["5"]["lora_report"][0]["decision"]["chosen"] == mode

    assert_weights_fresh(assets, fresh, f"{mode}: after every sampler")


EMBEDDED_WF = REPO / "workflows" / "api" / "embedded_style.api.json"
EMBEDDED_MODEL = REPO / "standalone" / "models" / "diffusion_models" / "tiny_wan_glyphs.safetensors"


@pytest.mark.skipif(not EMBEDDED_MODEL.is_file(), reason="embedded model not present")
@pytest.mark.parametrize("mode", ["dynamic", "merge"])
def test_embedded_style_workflow_with_stock_samplers(assets, mode):
    """workflows/api/embedded_style.api.json (tiny glyph Wan + glyph_outline_style, the pack's tiny
    text encoder) with its LoRA Sampler's MODEL also fed to KSampler / KSamplerAdvanced /
    SamplerCustomAdvanced, and the same graph without the adapter. 6 steps, batch 1 (runtime)."""
    comfy = assets
    shutil.copyfile(EMBEDDED_MODEL, comfy.diffusion_models_dir / EMBEDDED_MODEL.name)
    for f in (REPO / "standalone" / "models" / "loras").glob("*.safetensors"):
        shutil.copyfile(f, comfy.loras_dir / f.name)
    wf = json.loads(EMBEDDED_WF.read_text())
    wf = {k: {"class_type": v["class_type"], "inputs": dict(v["inputs"])} for k, v in wf.items()}
    wf["3"]["inputs"]["mode"] = mode
    wf["7"]["inputs"]["batch_size"] = 1
    s = wf["8"]["inputs"]
    s["steps"] = 6
    for k in ("9", "10"):  # decode/save images: not needed for a latent comparison
        wf.pop(k)
    p = Prompt.wrap(wf)
    p.node("40", LATENT_TAG, samples=["7", 0], tag=f"embedded-{p.tag}")
    s["latent_image"] = ["40", 0]
    p._save("8", ["8", 0])
    m = s["model"]
    common = dict(positive=s["positive"], negative=s["negative"], latent_image=["40", 0])
    p.node("21", "KSampler", model=m, seed=s["seed"], steps=s["steps"], cfg=s["cfg"], sampler_name=s["sampler_name"],
           scheduler=s["scheduler"], denoise=1.0, **common)
    p._save("21", ["21", 0])
    p.node("22", "KSamplerAdvanced", model=m, add_noise="enable", noise_seed=s["seed"], steps=s["steps"],
           cfg=s["cfg"], sampler_name=s["sampler_name"], scheduler=s["scheduler"], start_at_step=0,
           end_at_step=10000, return_with_leftover_noise="disable", **common)
    p._save("22", ["22", 0])
    p.node("31", "KSamplerSelect", sampler_name=s["sampler_name"])
    p.node("32", "BasicScheduler", model=m, scheduler=s["scheduler"], steps=s["steps"], denoise=1.0)
    p.node("33", "RandomNoise", noise_seed=s["seed"])
    p.node("34", "CFGGuider", model=m, positive=s["positive"], negative=s["negative"], cfg=s["cfg"])
    p.node("35", "SamplerCustomAdvanced", noise=["33", 0], guider=["34", 0], sampler=["31", 0], sigmas=["32", 0],
           latent_image=["40", 0])
    p._save("35", ["35", 0])
    p.node("23", "KSampler", model=["1", 0], seed=s["seed"], steps=s["steps"], cfg=s["cfg"],
           sampler_name=s["sampler_name"], scheduler=s["scheduler"], denoise=1.0, **common)
    p._save("23", ["23", 0])
    rec, out = run(comfy, p)
    assert_bitwise(out["21"], out["8"], f"embedded_style {mode}: KSampler vs LoRA Sampler")
    assert_bitwise(out["22"], out["21"], f"embedded_style {mode}: KSamplerAdvanced vs KSampler")
    assert_psnr(out["35"], out["21"], f"embedded_style {mode}: SamplerCustomAdvanced vs KSampler")
    for nid in ("8", "21", "22", "35"):
        assert_changed(out[nid], out["23"], f"embedded_style {mode}: sampler {nid}")
    assert sorted(d["node"] for d in reports_sent(rec)) == ["21", "22", "35", "8"], reports_sent(rec)


# ---------------------------------------------------------------------------
# 2. with ComfyUI's own LoraLoaderModelOnly: before, between and after our nodes
# ---------------------------------------------------------------------------
POSITIONS = ("before_adapter", "after_adapter", "after_merge_mode")


def chained_prompt(cond_class, position, comfy_lora, mode):
    """UNETLoader -> [LLMO] -> Load LoRA Adapter(A) -> [LLMO] -> Merge Mode -> [LLMO] -> KSampler 6."""
    p = Prompt(cond_class)
    m = ["1", 0]
    if position == "before_adapter":
        m = p.comfy_lora("30", m, comfy_lora)
    m = p.node("11", "LoraRuntimeLoadAdapter", model=m, lora_name=LORA_A, strength=1.0)
    if position == "after_adapter":
        m = p.comfy_lora("30", m, comfy_lora)
    m = p.node("20", "LoraRuntimeMergeMode", model=m, mode=mode)
    if position == "after_merge_mode":
        m = p.comfy_lora("30", m, comfy_lora)
    p.ksampler("6", m)
    return p


def comfy_only_prompt(cond_class, loras):
    p = Prompt(cond_class)
    m = ["1", 0]
    for i, name in enumerate(loras):
        m = p.comfy_lora(str(30 + i), m, name)
    p.ksampler("6", m)
    return p


@pytest.fixture(scope="module")
def comfy_refs(assets, cond_class, no_adapter):
    """ComfyUI alone: its LoRA only, and its LoRA + LORA_A both through LoraLoaderModelOnly."""
    refs = {}
    for comfy_lora in (LORA_B, LORA_PART):
        refs[(comfy_lora,)] = run(assets, comfy_only_prompt(cond_class, [comfy_lora]))[1]["6"]
        refs[(comfy_lora, LORA_A)] = run(assets, comfy_only_prompt(cond_class, [comfy_lora, LORA_A]))[1]["6"]
        assert_changed(refs[(comfy_lora,)], no_adapter, f"ComfyUI's LoRA {comfy_lora}")
    return refs


@pytest.mark.parametrize("comfy_lora", [LORA_B, LORA_PART], ids=["comfy_lora_all_layers", "comfy_lora_5_layers"])
@pytest.mark.parametrize("mode", ["dynamic", "merge"])
def test_comfyui_lora_before_between_and_after_ours(assets, cond_class, comfy_refs, fresh, mode, comfy_lora):
    comfy_alone, expected = comfy_refs[(comfy_lora,)], comfy_refs[(comfy_lora, LORA_A)]
    out = {}
    for position in POSITIONS:
        rec, lat = run(assets, chained_prompt(cond_class, position, comfy_lora, mode))
        out[position] = lat["6"]
        what = f"{mode}, ComfyUI LoRA {comfy_lora} {position}"
        assert_changed(out[position], comfy_alone, f"{what}: ours on top of ComfyUI's LoRA")
        assert_psnr(out[position], expected, f"{what} vs ComfyUI's own LoRA + LoRA composition")
        (sent,) = reports_sent(rec)
        dec = sent["report"]["decision"]
        assert sent["node"] == "6", sent
        # every layer ComfyUI patches itself stays dynamic; the others follow the mode
        overlap = N_LAYERS if comfy_lora == LORA_B else 5
        # the report counts the layers that carry ComfyUI's patch beside ours, in every mode and position
        hp = sent["report"].get("host_patched") or {}
        assert hp.get("layers") == overlap and len(hp["examples"]) == min(4, overlap), (what, hp)
        assert sent["report"]["adapters"][0].get("host_patched") == overlap, (what, sent["report"]["adapters"])
        if mode == "merge" and overlap < N_LAYERS:
            assert dec["chosen"] == "merge" and dec["kept_dynamic"] == overlap, (what, dec)
        else:  # dynamic, or merge with every layer patched by ComfyUI too
            assert dec["chosen"] == "dynamic", (what, dec)
    for position in POSITIONS[1:]:  # both are additive deltas: the order does not matter
        assert_psnr(out[position], out[POSITIONS[0]], f"{mode}: {position} vs {POSITIONS[0]}")
    assert_weights_fresh(assets, fresh, f"{mode}, ComfyUI LoRA {comfy_lora}")


BYPASS_MODEL = "bypass_copy_" + MODEL


def bypass_reference_prompt(comfy, cond_class, comfy_lora):
    """ComfyUI alone: its LoRA merged (LoraLoaderModelOnly), then LORA_A through its bypass loader (an
    unmerged LoRA added to each layer's output, the ops of our dynamic mode). On a copy of the model
    file (a model object of its own): ComfyUI's bypass leaves an instance ``forward`` on every layer it
    ejected from, which the weight-state checks of the shared model would count."""
    if not (comfy.diffusion_models_dir / BYPASS_MODEL).exists():
        shutil.copy(comfy.diffusion_models_dir / MODEL, comfy.diffusion_models_dir / BYPASS_MODEL)
    p = Prompt(cond_class)
    p.p["1"]["inputs"]["unet_name"] = BYPASS_MODEL
    m = p.comfy_lora("30", ["1", 0], comfy_lora)
    m = p.node("31", "LoraLoaderBypassModelOnly", model=m, lora_name=LORA_A, strength_model=1.0)
    p.ksampler("6", m)
    return p


@pytest.mark.parametrize("comfy_lora", [LORA_B, LORA_PART], ids=["comfy_lora_all_layers", "comfy_lora_5_layers"])
def test_dynamic_beside_comfyuis_lora_is_comfyuis_own_bypass_result(assets, cond_class, object_info, comfy_refs,
                                                                     fresh, comfy_lora):
    """Both orders on the same model, dynamic mode: ComfyUI's LoRA + ours equals bit for bit ComfyUI's
    LoRA + its own bypass loader with our file (ComfyUI's result for both parts), not its LoRA alone."""
    if "LoraLoaderBypassModelOnly" not in object_info:
        pytest.skip("this ComfyUI has no LoraLoaderBypassModelOnly (0.3.64)")
    expected = run(assets, bypass_reference_prompt(assets, cond_class, comfy_lora))[1]["6"]
    assert_changed(expected, comfy_refs[(comfy_lora,)], f"ComfyUI's bypass LoRA on top of {comfy_lora}")
    for position in ("before_adapter", "after_merge_mode"):
        p = chained_prompt(cond_class, position, comfy_lora, "dynamic")
        p.node("21", "LoraRuntimeQualityTier", model=p.p["6"]["inputs"]["model"], tier="exact")
        p.p["6"]["inputs"]["model"] = ["21", 0]
        rec, lat = run(assets, p)
        assert_bitwise(lat["6"], expected, f"{comfy_lora} {position}: ours dynamic vs ComfyUI's LoRA + bypass")
        (sent,) = reports_sent(rec)
        assert sent["report"]["host_patched"]["layers"] == (N_LAYERS if comfy_lora == LORA_B else 5), sent
    assert_weights_fresh(assets, fresh, f"dynamic beside {comfy_lora}")


# ---------------------------------------------------------------------------
# 3. two branches of one model, different adapters, one prompt
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("comfy_on_a", [False, True], ids=["ours_only", "comfyui_lora_on_branch_a"])
@pytest.mark.parametrize("mode", ["dynamic", "merge"])
def test_two_branches_equal_their_runs_alone(assets, cond_class, no_adapter, fresh, mode, comfy_on_a):
    def branch(p, which):
        if which == "a":  # optionally ComfyUI's LoRA first: this branch's patcher has other weight patches
            m = p.comfy_lora("30", ["1", 0], LORA_PART) if comfy_on_a else ["1", 0]
            p.ksampler("6", p.ours(m, [(LORA_A, 1.0)], mode, "exact", base=11))
        else:
            p.ksampler("7", p.ours(["1", 0], [(LORA_B, -0.8)], mode, "exact", base=51))

    alone = {}
    for which, nid in (("a", "6"), ("b", "7")):
        p = Prompt(cond_class)
        branch(p, which)
        alone[nid] = run(assets, p)[1][nid]
        assert_changed(alone[nid], no_adapter, f"{mode}: branch {which} alone")
    assert rel_diff(alone["6"], alone["7"]) > MIN_EFFECT, "the two adapters give the same latent: test is void"

    p = Prompt(cond_class)
    branch(p, "a")
    branch(p, "b")
    p.ksampler("8", ["1", 0])
    rec, both = run(assets, p)
    assert_bitwise(both["6"], alone["6"], f"{mode}: branch A (LORA_A) in the two-branch prompt vs alone")
    assert_bitwise(both["7"], alone["7"], f"{mode}: branch B (LORA_B) in the two-branch prompt vs alone")
    assert_bitwise(both["8"], no_adapter, f"{mode}: bare branch in the two-branch prompt vs no adapter")
    sent = {d["node"]: d["report"] for d in reports_sent(rec)}
    assert sorted(sent) == ["6", "7"], sent
    assert [a["name"] for a in sent["6"]["adapters"]] == [LORA_A], sent["6"]["adapters"]
    assert [a["name"] for a in sent["7"]["adapters"]] == [LORA_B], sent["7"]["adapters"]
    assert_weights_fresh(assets, fresh, f"{mode}, comfy_on_a={comfy_on_a}: two branches")


# ---------------------------------------------------------------------------
# 4. partially_unload / partially_load between runs and during a run
# ---------------------------------------------------------------------------
def partial_prompt(cond_class, mode, *, comfy_lora=None, probe=None, **probe_inputs):
    """UNETLoader -> [LLMO(comfy_lora)] -> Load LoRA Adapter(A) -> Merge Mode -> [probe] -> KSampler 6."""
    p = Prompt(cond_class)
    m = ["1", 0]
    if comfy_lora is not None:
        m = p.comfy_lora("30", m, comfy_lora)
    m = p.ours(m, [(LORA_A, 1.0)], mode, "exact")
    if probe is not None:
        m = p.node("45", probe, model=m, **probe_inputs)
    p.ksampler("6", m)
    return p


@pytest.mark.parametrize("comfy_lora", [None, LORA_PART], ids=["ours_only", "with_comfyui_lora"])
@pytest.mark.parametrize("mode", ["dynamic", "merge"])
def test_partial_unload_and_load_between_runs(assets, cond_class, no_adapter, fresh, mode, comfy_lora):
    _, ref = run(assets, partial_prompt(cond_class, mode, comfy_lora=comfy_lora))
    ref = ref["6"]
    assert_changed(ref, no_adapter, f"{mode}: reference run")
    for reload in (True, False):
        what = f"{mode}, comfy_lora={comfy_lora}, partial unload{' + load' if reload else ''} before the sampler"
        rec, out = run(assets, partial_prompt(cond_class, mode, comfy_lora=comfy_lora, probe=PARTIAL,
                                              fraction=0.5, reload=reload))
        info = rec["history"]["outputs"]["45"]["zz_partial"][0]
        assert info["freed"] > 0 and info["after_unload"]["model_lowvram"], (what, info)
        assert_bitwise(out["6"], ref, what)
        # and a plain run right after gives the reference again
        _, again = run(assets, partial_prompt(cond_class, mode, comfy_lora=comfy_lora))
        assert_bitwise(again["6"], ref, f"{what}: the run after it")
    st = assert_weights_fresh(assets, fresh, f"{mode}, comfy_lora={comfy_lora}: partial unload/load between runs")
    assert not [k for k in st["keys"] if "base_layer" in k or "lora" in k.lower()], st["keys"]


def want_ops(reload_at):
    return [("partially_unload", 2)] + ([("partially_load", reload_at)] if reload_at else [])


@pytest.mark.parametrize("reload_at", [0, 3], ids=["unload_at_call_2", "unload_2_reload_3"])
@pytest.mark.parametrize("comfy_lora", [None, LORA_PART], ids=["ours_only", "with_comfyui_lora"])
@pytest.mark.parametrize("mode", ["dynamic", "merge"])
def test_partial_unload_during_a_run(assets, cond_class, no_adapter, fresh, mode, comfy_lora, reload_at):
    weight_state(assets, unload_all=False)  # drains events left by earlier tests
    _, ref = run(assets, partial_prompt(cond_class, mode, comfy_lora=comfy_lora))
    ref = ref["6"]
    what = f"{mode}, comfy_lora={comfy_lora}, partially_unload at model call 2" + (
        f", partially_load at call {reload_at}" if reload_at else "")
    rec, out = run(assets, partial_prompt(cond_class, mode, comfy_lora=comfy_lora, probe=MIDRUN, unload_at=2,
                                          reload_at=reload_at, fraction=0.5))
    (sent,) = reports_sent(rec)
    assert sent["node"] == "6" and sent["report"]["decision"]["chosen"] == mode, sent["report"]["decision"]
    st = assert_weights_fresh(assets, fresh, what)
    ops = [(e.get("op"), e.get("call")) for e in st["events"] if e.get("node") == "mid_run" and "op" in e]
    during = [e for e in st["events"] if "keys" in e]
    assert [e["call"] for e in during] == [c for _, c in want_ops(reload_at)], st["events"]
    for e in during:  # adapters attached to the 20 real Linears, no key renamed or added
        assert e["keys"] == fresh["keys"], (what, e["call"], sorted(set(e["keys"]) ^ set(fresh["keys"])))
        assert len(e["attached"]) == N_LAYERS, (what, e["call"], e["attached"])
    assert [e for e in st["events"] if e.get("error")] == [], st["events"]
    assert ops == want_ops(reload_at), (what, st["events"])
    unload = next(e for e in st["events"] if e.get("op") == "partially_unload")
    assert unload["freed"] > 0 and unload["state"]["model_lowvram"], (what, unload)
    assert_changed(out["6"], no_adapter, what)
    if comfy_lora is None:
        # nothing of ComfyUI's is patched: its unload only switches layers to the cast path
        assert_bitwise(out["6"], ref, what)
    else:
        # ComfyUI puts its backup back into the layers it unloads and applies its LoRA per
        # call (LowVramPatch) from then on: the same sum, possibly rounded differently
        # (fp32 on the CPU: observed identical in 0.3.64 and 0.33.0)
        assert_psnr(out["6"], ref, what)


@pytest.mark.parametrize("mode", ["dynamic", "merge"])
def test_interrupted_stock_ksampler_restores_the_weights(assets, cond_class, no_adapter, fresh, mode):
    """An interrupt while ComfyUI's KSampler samples our MODEL (with ComfyUI's LoRA upstream):
    weights afterwards == a fresh load, and the next runs give the right answers."""
    p = partial_prompt(cond_class, mode, comfy_lora=LORA_PART)
    p.p["6"]["inputs"]["steps"] = 3000
    pid = assets.queue(p.p)
    assets.wait_for_event(pid, lambda e: e["type"] == "progress" and e["data"].get("node") == "6"
                          and e["data"].get("value", 0) >= 1, timeout=120)
    assets.interrupt(pid)
    with pytest.raises(AssertionError) as ei:
        assets.wait(pid, timeout=120)
    assert getattr(ei.value, "kind", None) == "execution_interrupted", str(ei.value)
    p = Prompt(cond_class)
    p.ksampler("6", ["1", 0])
    assert_bitwise(run(assets, p)[1]["6"], no_adapter, f"{mode}: bare model after the interrupt")
    assert_weights_fresh(assets, fresh, f"{mode}: after an interrupted KSampler")


# ---------------------------------------------------------------------------
# 5. the report of a stock sampler: history + websocket
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["dynamic", "merge"])
def test_report_node_and_event_for_a_stock_ksampler(assets, cond_class, mode):
    p = Prompt(cond_class)
    m = p.ours(["1", 0], [(LORA_A, 0.9)], mode, "exact")
    p.ksampler("6", m)
    p.node("90", "LoraRuntimeReport", model=m, latent=["6", 0])
    rec, _ = run(assets, p)

    outputs = rec["history"]["outputs"]
    assert "90" in outputs, sorted(outputs)
    (rep,) = outputs["90"]["lora_report"]
    assert rep["host"] == "comfyui" and rep["mode_requested"] == mode and rep["tier"] == "exact", rep
    assert rep["decision"]["chosen"] == mode, rep["decision"]
    (ad,) = rep["adapters"]
    assert ad["name"] == LORA_A and ad["strength"] == pytest.approx(0.9), ad
    assert ad["coverage"]["matched"] == N_LAYERS, ad["coverage"]
    assert rec["executed"].get("90", {}).get("lora_report") == [rep], "executed event and history differ"

    sent = reports_sent(rec)
    assert len(sent) == 1, sent
    (ev,) = sent
    assert ev["node"] == "6" and ev["display_node"] == "6" and ev["prompt_id"] == rec["prompt_id"], ev
    assert ev["report"]["decision"] == rep["decision"] and ev["report"]["adapters"] == rep["adapters"], ev
    # the event arrives while the KSampler runs: after its "executing" message, before the report node's
    types = [(e["type"], (e.get("data") or {}).get("node")) for e in rec["events"]]
    i_ks = types.index(("executing", "6"))
    i_ev = types.index(("lora_runtime.report", "6"))
    i_rep = types.index(("executing", "90"))
    assert i_ks < i_ev < i_rep, types


# ---------------------------------------------------------------------------
# 6. re-runs: the adapters stay on while the model stays loaded
# ---------------------------------------------------------------------------
def _ours_prompt(cond_class, strength, mode):
    p = Prompt(cond_class)
    p.ksampler("6", p.ours(["1", 0], [(LORA_A, strength)], mode, "exact"))
    return p


@pytest.mark.parametrize("mode", ["dynamic", "merge"])
def test_a_rerun_keeps_the_adapters_and_another_model_or_an_unload_takes_them_off(assets, cond_class, no_adapter,
                                                                                 fresh, mode):
    """The same graph queued again (our nodes cached, a new latent tag makes the sampler run): the
    adapters the first run left on are resumed (the report says so) with the same bits; a bare
    KSampler on the base between two runs sees the file's weights; a changed strength takes the old
    adapter fully off; unload_all_models leaves the weights of a fresh load."""
    weight_state(assets)                                                      # unloaded: nothing kept yet
    rec1, out1 = run(assets, _ours_prompt(cond_class, 0.8, mode))
    assert_changed(out1["6"], no_adapter, f"{mode}: first run")
    (first,) = reports_sent(rec1)
    assert not first["report"].get("adapters_kept"), first["report"]
    rec2, out2 = run(assets, _ours_prompt(cond_class, 0.8, mode))
    assert {"11", "20", "21"} <= set(rec2["cached"]), rec2["cached"]          # the very same MODEL object
    (again,) = reports_sent(rec2)
    assert again["report"].get("adapters_kept") is True, again["report"]
    assert_bitwise(out2["6"], out1["6"], f"{mode}: a re-run on the kept adapters vs the first run")

    p = Prompt(cond_class)
    p.ksampler("6", ["1", 0])
    _, bare = run(assets, p)                                                  # another MODEL on the same weights
    assert_bitwise(bare["6"], no_adapter, f"{mode}: a bare KSampler after our run")
    rec3, out3 = run(assets, _ours_prompt(cond_class, 0.8, mode))
    (third,) = reports_sent(rec3)
    assert not third["report"].get("adapters_kept"), third["report"]          # applied anew after the bare run
    assert_bitwise(out3["6"], out1["6"], f"{mode}: ours after the bare run vs the first run")

    _, changed = run(assets, _ours_prompt(cond_class, -0.4, mode))           # the strength changed
    assert_weights_fresh(assets, fresh, f"{mode}: after re-runs")
    _, alone = run(assets, _ours_prompt(cond_class, -0.4, mode))             # -0.4 on freshly unloaded weights
    assert_bitwise(changed["6"], alone["6"], f"{mode}: -0.4 after 0.8 vs -0.4 alone")
    assert_weights_fresh(assets, fresh, f"{mode}: after the changed strength")
