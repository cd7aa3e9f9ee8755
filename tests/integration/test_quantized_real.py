"""Quantized bases in real ComfyUI 0.33: our Load LoRA Adapter on checkpoints in ComfyUI's
quantized format (``comfy_quant`` layers, comfy-kitchen ``QuantizedTensor`` weights), against
ComfyUI's own LoRA path and an "ideal float" reference.

Models (testkit.quantized_checkpoints, written by the ComfyUI under test with its own python and
comfy-kitchen): the reference tiny Wan 2.1 (d128, ffn 512, 2 blocks; every layout's constraints
hold without padding) with its 20 block linears (self_attn / cross_attn q k v o, ffn.0, ffn.2)
quantized as float8_e4m3fn, float8_e5m2, int8_tensorwise, mxfp8 and nvfp4 (ComfyUI's QUANT_ALGOS
names); and per format the "ideal" fp32 model whose linears hold the dequantized values
(dequantized in fp32 by the loaded layer, as ComfyUI reads the file). Adapters: a rank-16 kohya
LoRA (alpha 16) on the 20 linears, and one on the two ffn.2 layers only. Strength 1.0; KSampler
euler / simple, 3 steps, CFG 5, seed 42, 64x64 one-frame latent.

Per format (UNETLoader node "1" on the quantized file, cached across the prompts):

- test_references, one prompt: the base alone; ComfyUI's LoraLoaderModelOnly, both LoRAs (it
  merges: dequantize at fp32, add, ``requantize_from_float(scale="recalculate",
  stochastic_rounding=string_to_seed("diffusion_model.<layer>.weight"))``); the ideal: our
  adapter, exact tier, dynamic, on the ideal fp32 model, cross-checked against ComfyUI's
  LoraLoaderModelOnly on that fp32 model (>= MIN_PSNR: an fp32 merge and an fp32 dynamic add
  differ by rounding only, so the ideal does not rest on our pack alone).
- test_ours_against_comfyui_and_ideal, one prompt per mode (dynamic / auto / merge, exact tier,
  LoRA Runtime Report node): far from the base; at least as close to the ideal as ComfyUI's
  latent (PSNR, no slack); where it merges, bit for bit ComfyUI's merge (the same fp32 sum, the
  same seeded re-quantization); a refused merge must name the layout and advise dynamic;
  ``ran_check`` "applied at cast time" for both ffn.2 layers on int8_tensorwise dynamic (ComfyUI
  0.33's Wan FFN, ``comfy.ops.linear_input_act``, computes an int8 ffn.2 without calling the
  layer), none anywhere else.
- test_ffn2_only_adapter_is_applied (after a fresh load): the ffn.2-only LoRA, dynamic, moves the
  output on every format (int8 included), at least as close to the ideal as ComfyUI's; ran_check
  as above.
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

Measured on ComfyUI 0.33.0 (CPU, torch 2.14.1, comfy-kitchen 0.2.31; pytest -s prints the table):
on the CPU ComfyUI runs fp8 / mxfp8 / nvfp4 "emulated" (dequantize, fp32 matmul) and int8 through
comfy-kitchen's int8 kernels, so ours dynamic equals the ideal bit for bit on the four float
formats and is 56.4 dB from it on int8; ComfyUI's merge is 41.5 (e4m3), 36.6 (e5m2), 48.0 (int8),
41.8 (mxfp8), 28.1 dB (nvfp4) from it. Ours merge, and auto (which merges on all five: 3-38 % of
the update rounded away, <= 50 %), equal ComfyUI's merge bit for bit. ffn.2-only: 9.4-10.0 % from
the base on every format. Weights identical to a fresh load after every run. A later sampling
of the same loaded int8 model applies ffn.2's adapter (bit for bit the first sampling's output) but
its report has no ran_check (the pack's: test_later_samplings_on_the_cached_model[int8_tensorwise]
fails until fixed).
"""
from __future__ import annotations

import itertools
import json
import shutil
import time

import pytest
import torch
from testkit.lora_assets import PromptGraph, _wan_modules, psnr, write_kohya_lora
from testkit.quantized_checkpoints import FORMATS, ideal_name, quantized_name, write_quantized_checkpoints

STRENGTH = 1.0
SETTINGS = {"seed": 42, "steps": 3, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple"}
MODES = ("dynamic", "auto", "merge")
TIER = "exact"
MIN_PSNR = 40.0     # the fp32 ideal: ours (dynamic add) vs ComfyUI (fp32 merge)
MIN_EFFECT = 0.05   # the full LoRA moves the latent by at least this much (relative L2)
MIN_EFFECT_FFN2 = 0.03  # the ffn.2-only LoRA (2 of 20 layers; measured 9.4-10.0 %)
FOLDER = "it_quant"
LORA = f"{FOLDER}/lora_r16.safetensors"
LORA_FFN2 = f"{FOLDER}/lora_r16_ffn2.safetensors"
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
    (before any server starts: a ComfyUI without quantized checkpoints skips here)."""
    comfy_dir, python = comfy_checkout
    out = tmp_path_factory.mktemp("quantized-checkpoints")
    report = write_quantized_checkpoints(python, comfy_dir, reference / "tiny_wan_d128_l2.safetensors", out)
    if "unsupported" in report:
        pytest.skip(report["unsupported"])
    return out, report


@pytest.fixture(scope="module")
def quant(quant_files, request):
    """The server, with the checkpoints in its diffusion_models/it_quant and the LoRAs in loras/it_quant.
    (The session's server is asked for here, not as an argument: pytest would start it before quant_files.)"""
    out, report = quant_files
    comfy = request.getfixturevalue("comfy")
    shutil.copytree(out, comfy.diffusion_models_dir / FOLDER, dirs_exist_ok=True)
    write_kohya_lora(comfy.loras_dir / LORA, seed=3301, rank=16, alpha=16.0)
    write_kohya_lora(comfy.loras_dir / LORA_FFN2, seed=3301, rank=16, alpha=16.0,
                     modules=[m for m in _wan_modules() if m[0].endswith("ffn.2")])
    comfy.quant_report = report
    yield comfy
    _print_table(report.get("version", "?"))


def _format_info(comfy, fmt):
    info = comfy.quant_report["formats"][fmt]
    if "skipped" in info:
        pytest.skip(info["skipped"])
    return info


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

    p = Prompt(comfy, fmt)
    ideal = p.loader("1i", f"{FOLDER}/{ideal_name(fmt)}")
    p.ksampler("base", ["1", 0])
    p.comfy_lora("comfy", LORA)
    p.comfy_lora("comfy_f2", LORA_FFN2)
    p.ours_on("ideal", ideal, LORA, "dynamic")
    p.comfy_lora_on("ideal_comfy", ideal, LORA)
    p.ours_on("ideal_f2", ideal, LORA_FFN2, "dynamic")
    lat, reps = run(comfy, p)
    state = weight_state(comfy, fmt)
    refs = {"fresh": fresh, "lat": lat, "reps": reps}
    assert_same_weights(state, fresh, f"{fmt}: after ComfyUI's own LoraLoaderModelOnly (a precondition)")
    _REFS[fmt] = refs
    return refs


# ---------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_references(quant, fmt):
    """The quantized file loads as ComfyUI's quantized layers; ComfyUI's LoRA moves the latent; the
    ideal (ours, dynamic, fp32 dequantized model) agrees with ComfyUI's own LoRA on that fp32 model."""
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
    assert psnr(lat["ideal"], lat["ideal_comfy"]) >= MIN_PSNR, line
    assert refs["reps"]["ideal"]["decision"]["chosen"] == "dynamic", refs["reps"]["ideal"]["decision"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_ours_against_comfyui_and_ideal(quant, fmt, mode):
    refs = references(quant, fmt)
    ref = refs["lat"]
    p = Prompt(quant, fmt)
    p.ours("ours", LORA, mode, TIER)
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
           "ran_check": {f["layer"]: f["handled"] for f in r.get("ran_check") or []}, "hash_ok": hash_ok}
    _ROWS[(fmt, mode)] = row
    line = (f"{fmt} {mode} (chose {chosen}): vs base {row['effect']:.1%}; vs ComfyUI {fmt_db(y, ref['comfy'])}; "
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
    # ran_check: only the int8 FFN's ffn.2 is computed without calling the layer, and only a dynamic
    # adapter has anything to check
    if fmt == INT8 and chosen == "dynamic":
        assert row["ran_check"] == {n: CAST for n in FFN2}, line
    else:
        assert not row["ran_check"], line
    assert_same_weights(state, refs["fresh"], f"{fmt} {mode}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_ffn2_only_adapter_is_applied(quant, fmt):
    """A LoRA on ffn.2 only, dynamic: the output moves on every format. On int8_tensorwise ComfyUI 0.33's
    Wan FFN computes ffn.2 in linear_input_act without calling the layer: the pack finds it on the first
    model call and applies that layer's adapter at cast time, and says so in the report."""
    refs = references(quant, fmt)
    ref = refs["lat"]
    assert_same_weights(fresh_state(quant, fmt), refs["fresh"], f"{fmt}: a fresh load")  # this sampling is the
    p = Prompt(quant, fmt)                                                         # first on the loaded layers
    p.ours("ours_f2", LORA_FFN2, "dynamic", TIER)
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
    if fmt == INT8:
        assert ran == {n: CAST for n in FFN2}, (line, r.get("ran_check"))
    else:
        assert not ran, line
    assert_same_weights(state, refs["fresh"], f"{fmt} dynamic ffn.2-only")


@pytest.mark.parametrize("fmt", FORMATS)
def test_later_samplings_on_the_cached_model(quant, fmt):
    """Later samplings of the same loaded model (UNETLoader cached): the adapters apply the same way and the
    report still says how. A first prompt samples the full LoRA (exact, dynamic); a second one, on the same
    layers, the full LoRA in the node's default tier (lossless) and the ffn.2-only LoRA (exact). On
    int8_tensorwise the pack remembers the bypassed ffn.2 layers and patches them before the first call:
    every report of the later samplings must still carry ran_check "applied at cast time" for them."""
    refs = references(quant, fmt)
    ref = refs["lat"]
    p = Prompt(quant, fmt)
    p.ours("first", LORA, "dynamic", TIER)
    lat1, reps1 = run(quant, p)
    p = Prompt(quant, fmt)
    p.ours("lossless", LORA, "dynamic", "lossless")
    p.ours("f2", LORA_FFN2, "dynamic", TIER)
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
    for fmt in FORMATS:
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
    later = [(fmt, _ROWS[(fmt, "later samplings")]) for fmt in FORMATS if (fmt, "later samplings") in _ROWS]
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
