"""Quantized bases in real ComfyUI 0.33: our Load LoRA Adapter on checkpoints in ComfyUI's
quantized format (``comfy_quant`` layers, comfy-kitchen ``QuantizedTensor`` weights), against
ComfyUI's own LoRA path and an "ideal float" reference.

Models (testkit.quantized_checkpoints, written by the ComfyUI under test with its own python and
comfy-kitchen), each with its 20 block linears (self_attn / cross_attn q k v o, ffn.0, ffn.2)
quantized: the reference tiny Wan 2.1 (d128, ffn 512, 2 blocks; these layouts' constraints hold
without padding) as float8_e4m3fn, float8_e5m2, int8_tensorwise, mxfp8 and nvfp4 (ComfyUI's
QUANT_ALGOS names) and as a legacy scaled-fp8 file ("scaled_fp8": ``scale_weight`` keys and a
``scaled_fp8`` marker, which ComfyUI 0.33 converts to float8_e4m3fn layers at load); a random Wan
at d256 (ffn 1024, 2 blocks, testkit.random_wan: the 4-bit layouts rotate groups of 256 input
columns) as convrot_w4a4 and asym_w4a8_int8. Per format the "ideal" fp32 model whose linears hold
the dequantized values (dequantized in fp32 by the loaded layer, as ComfyUI reads the file).
Adapters, per model width: a rank-16 kohya LoRA (alpha 16) on the 20 linears, and one on the two
ffn.2 layers only. Strength 1.0; KSampler euler / simple, 3 steps, CFG 5, seed 42, 64x64 one-frame
latent.

Per format (UNETLoader node "1" on the quantized file, cached across the prompts):

- test_references, one prompt: the base alone; ComfyUI's LoraLoaderModelOnly, both LoRAs (it
  merges: dequantize at fp32, add, ``requantize_from_float(scale="recalculate",
  stochastic_rounding=string_to_seed("diffusion_model.<layer>.weight"))``); the ideal: our
  adapter, exact tier, dynamic, on the ideal fp32 model, cross-checked against ComfyUI's
  LoraLoaderModelOnly on that fp32 model (>= MIN_PSNR: an fp32 merge and an fp32 dynamic add
  differ by rounding only, so the ideal does not rest on our pack alone). ComfyUI's LoRA is nearer
  the ideal than the base is. The legacy file: the same stored weights as the float8_e4m3fn file
  after ComfyUI's conversion (hash, keys) and the same base / LoRA latents, bit for bit.
- test_ours_against_comfyui_and_ideal, one prompt per mode (dynamic / auto / merge, exact tier,
  LoRA Runtime Report node): far from the base; at least as close to the ideal as ComfyUI's
  latent (PSNR, no slack); where it merges, bit for bit ComfyUI's merge (the same fp32 sum, the
  same seeded re-quantization); where it does not, within NEAR_COMFY_DB of ComfyUI (see there) and
  nearer ComfyUI than the base; a refused merge must name the layout and advise dynamic;
  ``ran_check`` "applied at cast time" for both ffn.2 layers on int8_tensorwise dynamic (ComfyUI
  0.33's Wan FFN, ``comfy.ops.linear_input_act``, computes an int8 ffn.2 without calling the
  layer), none anywhere else.
- test_ffn2_only_adapter_is_applied (after a fresh load): the ffn.2-only LoRA, dynamic, moves the
  output on every format (int8 included), at least as close to the ideal as ComfyUI's and within
  NEAR_COMFY_DB of ComfyUI; ran_check as above.
- test_later_samplings_on_the_cached_model: a second and third sampling of the same loaded layers
  (lossless tier, the ffn.2-only LoRA) apply the adapters the same way, and their reports still
  say "applied at cast time" on int8.
- After every prompt: the weights' hash (helper probe, after unload_all_models: quantized data,
  scales, comfy_quant, every other tensor) equals a fresh load's, same keys, no module left patched
  (after ComfyUI's own LoRA too: a precondition of the comparisons).

Skipped, with the reason, on a ComfyUI without quantized-checkpoint support (no
``comfy/quant_ops.py``: 0.3.x; 0.3.64 loads these files with the scales dropped as unexpected
keys, the fp8 / int8 codes taken as the weights, and fails on nvfp4 with a size mismatch), and
per format when this ComfyUI's QUANT_ALGOS lacks it (mxfp8 needs a comfy-kitchen with MXFP8).

Measured on ComfyUI 0.33.0 (CPU, torch 2.14.1, comfy-kitchen 0.2.31; pytest -s prints the table): on
the CPU ComfyUI runs fp8 / mxfp8 / nvfp4 "emulated" (dequantize, fp32 matmul), int8 through
comfy-kitchen's int8 kernels and the two 4-bit layouts through their eager kernels, which quantize
the activations (convrot_w4a4 to int4, asym_w4a8_int8 to int8). So ours dynamic equals the ideal bit
for bit on the float formats (the legacy file included) and is 56.4 dB (int8), 30.4 dB
(convrot_w4a4) and 55.2 dB (asym_w4a8_int8) from it; ComfyUI's merge is 41.5 (e4m3 and legacy), 36.6
(e5m2), 48.0 (int8), 41.8 (mxfp8), 28.1 (nvfp4), 25.5 (convrot_w4a4), 30.0 dB (asym_w4a8_int8) from
it, and ours dynamic is 24.3-48.4 dB from ComfyUI's (at most 0.8 dB under the ideal's PSNR against
ComfyUI, on convrot_w4a4). Ours merge, and auto (which merges on all eight: 3-40% of the update
rounded away, <= 50 %), equal ComfyUI's merge bit for bit. ffn.2-only: 7.3% (asym_w4a8_int8) to
17.9% (convrot_w4a4) from the base; on convrot_w4a4 ours is 30.7 dB from the ideal, ComfyUI's 30.6
dB (both carry the int4 activation rounding). Weights identical to a fresh load after every run;
later samplings of the cached int8 model report ffn.2 "applied at cast time" like the first.
"""
from __future__ import annotations

import itertools
import json
import math
import shutil
import time

import pytest
import torch
from testkit.lora_assets import PromptGraph, _wan_modules, psnr, write_kohya_lora
from testkit.quantized_checkpoints import (FORMATS, LEGACY, WIDE_DIMS, WIDE_FORMATS, ideal_name, quantized_name,
                                           write_quantized_checkpoints)
from testkit.random_wan import block_linears, write_random_wan

STRENGTH = 1.0
SETTINGS = {"seed": 42, "steps": 3, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple"}
MODES = ("dynamic", "auto", "merge")
TIER = "exact"
MIN_PSNR = 40.0     # the fp32 ideal: ours (dynamic add) vs ComfyUI (fp32 merge)
MIN_EFFECT = 0.05   # the full LoRA moves the latent by at least this much (relative L2)
MIN_EFFECT_FFN2 = 0.03  # the ffn.2-only LoRA (2 of 20 layers; measured 9.4-10.0 %)
FOLDER = "it_quant"
ALL_FORMATS = FORMATS + (LEGACY,) + WIDE_FORMATS
# the LoRAs per model width: the reference d128 model, and the d256 random Wan of WIDE_FORMATS
LORAS = {128: (f"{FOLDER}/lora_r16.safetensors", f"{FOLDER}/lora_r16_ffn2.safetensors"),
         WIDE_DIMS[0]: (f"{FOLDER}/lora_r16_d{WIDE_DIMS[0]}.safetensors",
                        f"{FOLDER}/lora_r16_d{WIDE_DIMS[0]}_ffn2.safetensors")}
STATE = "ZZLoraRuntimeTestWeightState"
INT8 = "int8_tensorwise"
CAST = "applied at cast time"
FFN2 = ("blocks.0.ffn.2", "blocks.1.ffn.2")
_counter = itertools.count()
_ROWS: dict[tuple[str, str], dict] = {}   # (format, what) -> numbers, for the table at the end


# ---------------------------------------------------------------------------
# assets, prompts, probes
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quant_files(comfy_checkout, reference, tmp_path_factory):
    """The quantized / ideal checkpoints of every format this ComfyUI supports, written by its own python
    (before any server starts: a ComfyUI without quantized checkpoints skips here): FORMATS and the
    legacy scaled-fp8 file from the reference d128 model, WIDE_FORMATS from a d256 random Wan."""
    comfy_dir, python = comfy_checkout
    out = tmp_path_factory.mktemp("quantized-checkpoints")
    report = write_quantized_checkpoints(python, comfy_dir, reference / "tiny_wan_d128_l2.safetensors", out,
                                         formats=FORMATS + (LEGACY,))
    if "unsupported" in report:
        pytest.skip(report["unsupported"])
    src = tmp_path_factory.mktemp("wide-source") / "wan_d256.safetensors"
    write_random_wan(src, *WIDE_DIMS, blocks=2)
    wide = write_quantized_checkpoints(python, comfy_dir, src, out, formats=WIDE_FORMATS)
    report["formats"].update(wide["formats"])
    for fmt, info in report["formats"].items():
        info["width"] = WIDE_DIMS[0] if fmt in WIDE_FORMATS else 128
    return out, report


@pytest.fixture(scope="module")
def quant(quant_files, request):
    """The server, with the checkpoints in its diffusion_models/it_quant and the LoRAs in loras/it_quant.
    (The session's server is asked for here, not as an argument: pytest would start it before quant_files.)"""
    out, report = quant_files
    comfy = request.getfixturevalue("comfy")
    shutil.copytree(out, comfy.diffusion_models_dir / FOLDER, dirs_exist_ok=True)
    for width, modules in ((128, list(_wan_modules())), (WIDE_DIMS[0], block_linears(*WIDE_DIMS, 2))):
        full, ffn2 = LORAS[width]
        write_kohya_lora(comfy.loras_dir / full, seed=3301, rank=16, alpha=16.0, modules=modules)
        write_kohya_lora(comfy.loras_dir / ffn2, seed=3301, rank=16, alpha=16.0,
                         modules=[m for m in modules if m[0].endswith("ffn.2")])
    comfy.quant_report = report
    yield comfy
    _print_table(report.get("version", "?"))


def _format_info(comfy, fmt):
    info = comfy.quant_report["formats"][fmt]
    if "skipped" in info:
        pytest.skip(info["skipped"])
    return info


def loras(comfy, fmt) -> tuple[str, str]:
    """(the full LoRA, the ffn.2-only LoRA) for `fmt`'s model width."""
    return LORAS[comfy.quant_report["formats"][fmt]["width"]]


class Prompt(PromptGraph):
    def __init__(self, comfy, fmt):
        super().__init__(comfy.helper_cond_class, "quant", f"{fmt}-{next(_counter)}", SETTINGS, STRENGTH)
        self.p["1"]["inputs"]["unet_name"] = f"{FOLDER}/{quantized_name(fmt)}"

    def loader(self, nid, unet_name):
        return self.node(nid, "UNETLoader", unet_name=unet_name, weight_dtype="default")

    def comfy_lora_on(self, nid, model, name):
        m = self.node(f"L{nid}", "LoraLoaderModelOnly", model=model, lora_name=name, strength_model=self.strength)
        self.ksampler(nid, m)

    def ours_on(self, nid, model, name, mode, tier=TIER):
        m = self.node(f"A{nid}", "LoraRuntimeLoadAdapter", model=model, lora_name=name, strength=self.strength)
        m = self.node(f"M{nid}", "LoraRuntimeMergeMode", model=m, mode=mode)
        m = self.node(f"Q{nid}", "LoraRuntimeQualityTier", model=m, tier=tier)
        self.ksampler(nid, m)
        self.node(f"R{nid}", "LoraRuntimeReport", model=m, latent=[nid, 0])
        self.reports[nid] = f"R{nid}"


def run(comfy, prompt: Prompt):
    return prompt.run(comfy, require_ran=True)


def weight_state(comfy, fmt, *, must_share_model=True) -> dict:
    """unload_all_models(), then the hash / keys / leftovers of the (cached) quantized model's weights."""
    p = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": f"{FOLDER}/{quantized_name(fmt)}",
                                                      "weight_dtype": "default"}},
         "99": {"class_type": STATE, "inputs": {"model": ["1", 0], "unload_all": True}}}
    rec = comfy.run(p)
    if must_share_model:
        assert "1" in rec["cached"], "the model was reloaded: its weights after the run would not be checked"
    return rec["history"]["outputs"]["99"]["zz_weight_state"][0]


def fresh_state(comfy, fmt) -> dict:
    """The weight state of a fresh load of the quantized file (every cache dropped first)."""
    for attempt in range(3):
        comfy.free()
        time.sleep(1.0 + attempt)
        p = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": f"{FOLDER}/{quantized_name(fmt)}",
                                                          "weight_dtype": "default"}},
             "99": {"class_type": STATE, "inputs": {"model": ["1", 0], "unload_all": True}}}
        rec = comfy.run(p)
        if "1" not in rec["cached"]:
            return rec["history"]["outputs"]["99"]["zz_weight_state"][0]
    pytest.fail("could not get a fresh model load after POST /free")


def assert_same_weights(state, fresh, what):
    assert state["keys"] == fresh["keys"], (what, sorted(set(state["keys"]) ^ set(fresh["keys"])))
    assert not state["leftovers"], f"{what}: modules still patched after unload_all_models: {state['leftovers']}"
    assert state["hash"] == fresh["hash"], (f"{what}: the stored bytes / scales after unload_all_models differ "
                                            "from a fresh load")


# ours (dynamic) vs ComfyUI's LoRA, which merges: both are the ideal plus an error, ComfyUI's from
# re-quantizing its merged weight, ours no larger (asserted first: ours vs ideal >= ComfyUI vs ideal)
# and from another source (the host kernel's rounding of the activations, or none). Errors that are
# not anti-correlated add at most in power: ours is at most 2x ComfyUI's MSE from ComfyUI, i.e.
# 3.01 dB under the ideal's PSNR against ComfyUI's latent (the same reference, so the same peak).
NEAR_COMFY_DB = 10 * math.log10(2)


def assert_near_comfyui(ours, comfy, ideal, base, line):
    """Ours (not merged) against ComfyUI's LoRA: within NEAR_COMFY_DB of the ideal's distance to
    ComfyUI, and nearer ComfyUI than the base alone (the wrong answer) is."""
    assert psnr(ours, comfy) >= psnr(ideal, comfy) - NEAR_COMFY_DB, line
    assert psnr(ours, comfy) > psnr(base, comfy), line


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def fmt_db(a, ref) -> str:
    return "bitwise" if torch.equal(a, ref) else f"{psnr(a, ref):.1f} dB"


# ---------------------------------------------------------------------------
# references per format (computed once, by the first test that needs them)
# ---------------------------------------------------------------------------
_REFS: dict[str, dict] = {}


def references(comfy, fmt) -> dict:
    if fmt in _REFS:
        return _REFS[fmt]
    _format_info(comfy, fmt)
    fresh = fresh_state(comfy, fmt)
    assert fresh["keys"] and not fresh["leftovers"], fresh
    assert sum(k.endswith(".comfy_quant") for k in fresh["keys"]) == 20, "not 20 quantized layers in the state_dict"

    full, ffn2 = loras(comfy, fmt)
    p = Prompt(comfy, fmt)
    ideal = p.loader("1i", f"{FOLDER}/{ideal_name(fmt)}")
    p.ksampler("base", ["1", 0])
    p.comfy_lora("comfy", full)
    p.comfy_lora("comfy_f2", ffn2)
    p.ours_on("ideal", ideal, full, "dynamic")
    p.comfy_lora_on("ideal_comfy", ideal, full)
    p.ours_on("ideal_f2", ideal, ffn2, "dynamic")
    lat, reps = run(comfy, p)
    state = weight_state(comfy, fmt)
    refs = {"fresh": fresh, "lat": lat, "reps": reps}
    assert_same_weights(state, fresh, f"{fmt}: after ComfyUI's own LoraLoaderModelOnly (a precondition)")
    _REFS[fmt] = refs
    return refs


# ---------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_references(quant, fmt):
    """The quantized file loads as ComfyUI's quantized layers; ComfyUI's LoRA moves the latent and is
    nearer the ideal than the base alone; the ideal (ours, dynamic, fp32 dequantized model) agrees with
    ComfyUI's own LoRA on that fp32 model. The legacy scaled-fp8 file loads as the float8_e4m3fn file
    does: the same stored weights (hash and keys after ComfyUI's conversion), the same latents."""
    refs = references(quant, fmt)
    lat = refs["lat"]
    line = (f"{fmt}: ComfyUI LoRA vs base {rel(lat['comfy'], lat['base']):.1%}; ComfyUI vs ideal "
            f"{fmt_db(lat['comfy'], lat['ideal'])}; ideal (ours on fp32) vs ComfyUI on fp32 "
            f"{fmt_db(lat['ideal'], lat['ideal_comfy'])}; base vs ideal {fmt_db(lat['base'], lat['ideal'])}")
    print(line)
    _ROWS[(fmt, "refs")] = {"comfy_vs_ideal": psnr(lat["comfy"], lat["ideal"]),
                            "ideal_vs_comfy_fp32": psnr(lat["ideal"], lat["ideal_comfy"]),
                            "comfy_effect": rel(lat["comfy"], lat["base"]),
                            "comfy_f2_effect": rel(lat["comfy_f2"], lat["base"])}
    assert rel(lat["comfy"], lat["base"]) > MIN_EFFECT, line
    assert psnr(lat["comfy"], lat["ideal"]) > psnr(lat["base"], lat["ideal"]), line
    assert psnr(lat["ideal"], lat["ideal_comfy"]) >= MIN_PSNR, line
    assert refs["reps"]["ideal"]["decision"]["chosen"] == "dynamic", refs["reps"]["ideal"]["decision"]
    if fmt == LEGACY:
        e4m3 = references(quant, "float8_e4m3fn")
        assert refs["fresh"]["keys"] == e4m3["fresh"]["keys"], "the legacy file loads with other state_dict keys"
        assert refs["fresh"]["hash"] == e4m3["fresh"]["hash"], "the legacy file loads other bytes / scales"
        for nid in ("base", "comfy", "comfy_f2"):
            assert torch.equal(lat[nid], e4m3["lat"][nid]), f"{nid}: the legacy file samples otherwise"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_ours_against_comfyui_and_ideal(quant, fmt, mode):
    refs = references(quant, fmt)
    ref = refs["lat"]
    p = Prompt(quant, fmt)
    p.ours("ours", loras(quant, fmt)[0], mode, TIER)
    failed = None
    try:
        lat, reps = run(quant, p)
    except AssertionError as e:
        if type(e).__name__ != "PromptFailed":  # testkit.comfyui.server.PromptFailed: ComfyUI's execution_error
            raise
        failed = e
    state = weight_state(quant, fmt)
    hash_ok = state["hash"] == refs["fresh"]["hash"] and not state["leftovers"]
    if failed is not None:
        msg = str(failed)
        _ROWS[(fmt, mode)] = {"refused": msg.splitlines()[0][:300], "hash_ok": hash_ok}
        print(f"{fmt} {mode}: failed: {msg[:3000]}")
        assert mode == "merge", f"{fmt} {mode}: our run failed:\n{msg}"
        assert "dynamic" in msg and ("quantiz" in msg.lower() or fmt in msg), f"{fmt} merge refused unclearly:\n{msg}"
        assert_same_weights(state, refs["fresh"], f"{fmt} {mode} (refused)")
        return
    y, r = lat["ours"], reps["ours"]
    chosen = r["decision"]["chosen"]
    row = {"chosen": chosen, "reason": r["decision"].get("reason", ""),
           "effect": rel(y, ref["base"]),
           "ours_vs_comfy": psnr(y, ref["comfy"]), "bitwise_comfy": torch.equal(y, ref["comfy"]),
           "ours_vs_ideal": psnr(y, ref["ideal"]), "comfy_vs_ideal": psnr(ref["comfy"], ref["ideal"]),
           "ideal_vs_comfy": psnr(ref["ideal"], ref["comfy"]),
           "ran_check": {f["layer"]: f["handled"] for f in r.get("ran_check") or []}, "hash_ok": hash_ok}
    _ROWS[(fmt, mode)] = row
    line = (f"{fmt} {mode} (chose {chosen}): vs base {row['effect']:.1%}; vs ComfyUI {fmt_db(y, ref['comfy'])} "
            f"(the ideal vs ComfyUI {row['ideal_vs_comfy']:.1f} dB); "
            f"vs ideal {row['ours_vs_ideal']:.1f} dB (ComfyUI vs ideal {row['comfy_vs_ideal']:.1f} dB); "
            f"ran_check {row['ran_check']}; weights restored {hash_ok}")
    if mode == "auto":
        line += f"; decision: {row['reason']}"
    print(line)
    assert rel(y, ref["base"]) > MIN_EFFECT, line
    assert torch.isfinite(y).all(), line
    if mode != "auto":
        assert chosen == mode, (line, r["decision"])
    # at least as close to the ideal float result as ComfyUI's LoRA path
    assert row["ours_vs_ideal"] >= row["comfy_vs_ideal"], line
    if chosen == "merge":  # the same fp32 sum, the same seeded re-quantization on the layout's grid
        assert torch.equal(y, ref["comfy"]), line
    else:
        assert_near_comfyui(y, ref["comfy"], ref["ideal"], ref["base"], line)
    # ran_check: only the int8 FFN's ffn.2 is computed without calling the layer, and only a dynamic
    # adapter has anything to check
    if fmt == INT8 and chosen == "dynamic":
        assert row["ran_check"] == {n: CAST for n in FFN2}, line
    else:
        assert not row["ran_check"], line
    assert_same_weights(state, refs["fresh"], f"{fmt} {mode}")


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_ffn2_only_adapter_is_applied(quant, fmt):
    """A LoRA on ffn.2 only, dynamic: the output moves on every format. On int8_tensorwise ComfyUI 0.33's
    Wan FFN computes ffn.2 in linear_input_act without calling the layer: the pack finds it on the first
    model call and applies that layer's adapter at cast time, and says so in the report."""
    refs = references(quant, fmt)
    ref = refs["lat"]
    assert_same_weights(fresh_state(quant, fmt), refs["fresh"], f"{fmt}: a fresh load")  # this sampling is the
    p = Prompt(quant, fmt)                                                         # first on the loaded layers
    p.ours("ours_f2", loras(quant, fmt)[1], "dynamic", TIER)
    lat, reps = run(quant, p)
    state = weight_state(quant, fmt)
    y, r = lat["ours_f2"], reps["ours_f2"]
    ran = {f["layer"]: f["handled"] for f in r.get("ran_check") or []}
    row = {"effect": rel(y, ref["base"]), "comfy_effect": rel(ref["comfy_f2"], ref["base"]),
           "ours_vs_comfy": psnr(y, ref["comfy_f2"]), "ours_vs_ideal": psnr(y, ref["ideal_f2"]),
           "comfy_vs_ideal": psnr(ref["comfy_f2"], ref["ideal_f2"]), "ran_check": ran,
           "hash_ok": state["hash"] == refs["fresh"]["hash"] and not state["leftovers"]}
    _ROWS[(fmt, "dynamic ffn.2 only")] = row
    line = (f"{fmt} ffn.2-only dynamic: vs base {row['effect']:.2%} (ComfyUI's {row['comfy_effect']:.2%}); vs ComfyUI "
            f"{fmt_db(y, ref['comfy_f2'])}; vs ideal {row['ours_vs_ideal']:.1f} dB (ComfyUI "
            f"{row['comfy_vs_ideal']:.1f} dB); ran_check {ran}")
    print(line)
    assert row["effect"] > MIN_EFFECT_FFN2, f"the ffn.2 adapter was dropped: {line}"
    assert row["ours_vs_ideal"] >= row["comfy_vs_ideal"], line
    assert_near_comfyui(y, ref["comfy_f2"], ref["ideal_f2"], ref["base"], line)
    if fmt == INT8:
        assert ran == {n: CAST for n in FFN2}, (line, r.get("ran_check"))
    else:
        assert not ran, line
    assert_same_weights(state, refs["fresh"], f"{fmt} dynamic ffn.2-only")


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_later_samplings_on_the_cached_model(quant, fmt):
    """Later samplings of the same loaded model (UNETLoader cached): the adapters apply the same way and the
    report still says how. A first prompt samples the full LoRA (exact, dynamic); a second one, on the same
    layers, the full LoRA in the node's default tier (lossless) and the ffn.2-only LoRA (exact). On
    int8_tensorwise the pack remembers the bypassed ffn.2 layers and patches them before the first call:
    every report of the later samplings must still carry ran_check "applied at cast time" for them."""
    refs = references(quant, fmt)
    ref = refs["lat"]
    full, ffn2 = loras(quant, fmt)
    p = Prompt(quant, fmt)
    p.ours("first", full, "dynamic", TIER)
    lat1, reps1 = run(quant, p)
    p = Prompt(quant, fmt)
    p.ours("lossless", full, "dynamic", "lossless")
    p.ours("f2", ffn2, "dynamic", TIER)
    lat, reps = run(quant, p)
    state = weight_state(quant, fmt)
    ran = {nid: {f["layer"]: f["handled"] for f in r.get("ran_check") or []}
           for nid, r in (("first", reps1["first"]), ("lossless", reps["lossless"]), ("f2", reps["f2"]))}
    row = {"lossless_vs_exact": fmt_db(lat["lossless"], lat1["first"]),
           "lossless_vs_ideal": psnr(lat["lossless"], ref["ideal"]), "comfy_vs_ideal": psnr(ref["comfy"], ref["ideal"]),
           "f2_effect": rel(lat["f2"], ref["base"]), "f2_vs_ideal": psnr(lat["f2"], ref["ideal_f2"]),
           "comfy_f2_vs_ideal": psnr(ref["comfy_f2"], ref["ideal_f2"]), "ran_check": ran,
           "hash_ok": state["hash"] == refs["fresh"]["hash"] and not state["leftovers"]}
    _ROWS[(fmt, "later samplings")] = row
    line = (f"{fmt} later samplings: lossless vs the exact first {row['lossless_vs_exact']}, vs ideal "
            f"{row['lossless_vs_ideal']:.1f} dB (ComfyUI {row['comfy_vs_ideal']:.1f} dB); ffn.2-only vs base "
            f"{row['f2_effect']:.2%}, vs ideal {row['f2_vs_ideal']:.1f} dB "
            f"(ComfyUI {row['comfy_f2_vs_ideal']:.1f} dB); "
            f"ran_check per sampling {ran}")
    print(line)
    for nid in ("lossless", "f2"):
        assert reps[nid]["decision"]["chosen"] == "dynamic", (line, reps[nid]["decision"])
    assert row["lossless_vs_ideal"] >= row["comfy_vs_ideal"], line
    assert row["f2_effect"] > MIN_EFFECT_FFN2, f"the ffn.2 adapter was dropped on a later sampling: {line}"
    assert row["f2_vs_ideal"] >= row["comfy_f2_vs_ideal"], line
    assert_same_weights(state, refs["fresh"], f"{fmt} later samplings")
    want = {n: CAST for n in FFN2} if fmt == INT8 else {}
    assert ran == {"first": want, "lossless": want, "f2": want}, (
        f"{fmt}: the reports of later samplings on the same loaded model must say how ffn.2's adapter ran "
        f"(measured per sampling: {ran})")


# ---------------------------------------------------------------------------
# the table (pytest -s)
# ---------------------------------------------------------------------------
def _print_table(version):
    if not _ROWS:
        return
    lines = [f"\nquantized bases on ComfyUI {version} (PSNR of the sampled latent; ideal = ours exact dynamic on "
             "the fp32 dequantized model)",
             "| format | mode | chosen | ours vs ComfyUI | ours vs ideal | ComfyUI vs ideal | vs base | weights "
             "restored | ran_check |", "|---|---|---|---|---|---|---|---|---|"]
    for fmt in ALL_FORMATS:
        for what in MODES + ("dynamic ffn.2 only",):
            row = _ROWS.get((fmt, what))
            if row is None:
                continue
            if "refused" in row:
                lines.append(f"| {fmt} | {what} | refused: {row['refused'][:120]} | | | | | {row['hash_ok']} | |")
                continue
            vs = "bitwise" if row.get("bitwise_comfy") else f"{row['ours_vs_comfy']:.1f} dB"
            lines.append(f"| {fmt} | {what} | {row.get('chosen', 'dynamic')} | {vs} | {row['ours_vs_ideal']:.1f} dB | "
                         f"{row['comfy_vs_ideal']:.1f} dB | {row['effect']:.1%} | {row['hash_ok']} | "
                         f"{json.dumps(row['ran_check']) if row['ran_check'] else '-'} |")
    later = [(fmt, _ROWS[(fmt, "later samplings")]) for fmt in ALL_FORMATS if (fmt, "later samplings") in _ROWS]
    if later:
        lines += ["\nlater samplings on the cached model (dynamic): first = exact full LoRA; then lossless full "
                  "LoRA and exact ffn.2-only in a second prompt",
                  "| format | lossless vs first | lossless vs ideal | ComfyUI vs ideal | ffn.2-only vs base | "
                  "ffn.2-only vs ideal | ComfyUI ffn.2-only vs ideal | weights restored | "
                  "ran_check first / lossless / ffn.2-only |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for fmt, row in later:
            rc = " / ".join(str(len(row["ran_check"][k])) + " cast" if row["ran_check"][k] else "-"
                            for k in ("first", "lossless", "f2"))
            lines.append(f"| {fmt} | {row['lossless_vs_exact']} | {row['lossless_vs_ideal']:.1f} dB | "
                         f"{row['comfy_vs_ideal']:.1f} dB | {row['f2_effect']:.1%} | {row['f2_vs_ideal']:.1f} dB | "
                         f"{row['comfy_f2_vs_ideal']:.1f} dB | {row['hash_ok']} | {rc} |")
    print("\n".join(lines))
