"""Sampled outputs of ComfyUI's own model classes with a LoRA: our Load LoRA Adapter against ComfyUI's
LoraLoaderModelOnly (a merge) and LoraLoaderBypassModelOnly (its unmerged LoRA), per model family.

The models are ComfyUI's classes at tiny configs with seeded bf16 weights (`testkit.comfy_tiny_models`:
LTX-2 = ``LTXAV``, Lumina 2, Z-Image, HunyuanImage 2.1, HunyuanVideo 1.0 / 1.5, Cosmos Predict 2,
Chroma, Flux.1, Flux 2, Qwen-Image, Wan 2.1, HiDream, Kandinsky 5, ERNIE-Image, AuraFlow, Mochi), sampled
by ComfyUI's KSampler code in ComfyUI's python, one process for all (`testkit.comfy_family_probe`,
which says what is run). Each family's LoRA is a native file (ComfyUI's own key names) on every
Linear; LTX-2 has a second one on its text connectors only.

Asserted per family:
- keys: ComfyUI's loader loads every layer of the file, and so do we (strict mode);
- weights: every weight ComfyUI's merge writes, ours writes bit for bit;
- merge mode: our sampled output is ComfyUI's LoraLoaderModelOnly output bit for bit;
- dynamic mode: bit for bit ComfyUI's LoraLoaderBypassModelOnly output (the same ops: x A^T, then B^T,
  then the scale, in the compute dtype, added to the layer's output), and >= MIN_DB from its merge;
  no farther from the fp32 result than ComfyUI's merge is, but for IDEAL_SLACK_DB;
- both modes are far from the base (the wrong answer: adapter off), <= MAX_DB_FROM_BASE;
- the base model samples bit for bit the same after every run (both loaders restored the weights).

Why dynamic is not bit for bit ComfyUI's merge, and what sets the dB (the 59.1 dB once reported for
Chroma): an unmerged add and a merge are two bf16 roundings of the same sum. Their distance is the
model's bf16 noise: ComfyUI's own bypass is exactly as far from its merge (it is our bits), and it
follows how far ComfyUI's merge itself is from the fp32 result. Chroma at this config, every weight
N(0, s^2), seeds varied: s = 0.05: 64.0-66.0 dB (ComfyUI's merge 64.7-65.8 dB from fp32); s = 0.1: 56.5
(58.2); s = 0.05 with LoRA factors 3x: 53.3 (56.9). Per part of Chroma (s = 0.05), dynamic vs merge:
approximator alone 67.6, double blocks 69.8, single blocks 69.1, img_in / txt_in / final layer 65.8, all
66.0 dB: no part is off. An fp32 LoRA branch added with one rounding moves it by -0.5..+0.5 dB.
Z-Image at width 256 with s = 0.05: 59.1 dB, ComfyUI's merge 60.5 dB from fp32. So the tiny models here
give a layer the gain of a 64-wide one (`comfy_tiny_models`): every family's bf16 noise is then
62.8-83.7 dB.

LTX-2: its text connectors run in ``extra_conds`` (condition processing), before the sampler's loop.
The sampling window puts our adapters on in PREPARE_SAMPLING, before that, so a connector-only LoRA
reaches the output: bit for bit ComfyUI's (merge). Without the window (OUTER_SAMPLE /
PREPARE_SAMPLING wrappers removed: the lifecycle of a host without them) the same file gives the
base output bit for bit, and the first-call check names the 12 connector layers "did not run"
(dynamic); the whole file's output is then 51.8 dB from ComfyUI's (its weights still bit for bit):
the earlier "weights bitwise, output 57 dB" of LTX-2.

Measured on ComfyUI 0.33.0 (CPU, torch 2.14.1): every family merge bitwise, dynamic bitwise ComfyUI's
bypass; dynamic vs ComfyUI's merge (dB): LTX-2 64.4, Lumina 2 67.1, Z-Image 65.7, HunyuanImage 2.1
65.9, HunyuanVideo 65.1, HunyuanVideo 1.5 67.3, Cosmos Predict 2 68.4, Chroma 65.3, Flux 64.3, Flux 2
74.7, Qwen-Image 72.1, Wan 2.1 67.0, HiDream 67.7, Kandinsky 5 64.2, ERNIE-Image 76.1, AuraFlow 84.1,
Mochi 63.7; the base 30.6-48.0 dB away. LTX-2 connectors only: 34.7 dB from the base, merge bitwise,
dynamic 64.5 dB from ComfyUI's merge (bitwise its bypass). On 0.3.64: the classes it has, merge
bitwise (no bypass loader there); LTX-2, Z-Image, HunyuanVideo 1.5, Flux 2, Kandinsky 5 and
ERNIE-Image are skipped (no such class).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from testkit.comfyui.probe import run_probe

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "tests" / "testkit" / "comfy_family_probe.py"

KINDS = ["LTXAV", "Lumina2", "ZImage", "HunyuanImage21", "HunyuanVideo", "HunyuanVideo15", "CosmosT2IPredict2",
         "Chroma", "Flux", "Flux2", "QwenImage", "WAN21_T2V", "HiDream", "Kandinsky5", "ErnieImage", "AuraFlow",
         "GenmoMochi"]
# dynamic vs ComfyUI's merge: the target; two bf16 roundings of the same sum, with these models' bf16
# noise (ComfyUI's merge is 62.8-83.7 dB from the fp32 result) measured 63.7-84.1 dB apart
MIN_DB = 60.0
# the wrong answer: every adapter here moves the output 30.6-48.0 dB from the base (measured); 50 dB is
# 10 dB clear of the agreement above
MAX_DB_FROM_BASE = 50.0
# an unmerged add rounds the base output and the delta apart where a merge rounds the weight once:
# measured 0.0-1.0 dB farther from the fp32 result than ComfyUI's merge (ComfyUI's bypass: the same bits)
IDEAL_SLACK_DB = 1.5
CONNECTORS = 12   # video_ and audio_embeddings_connector: one block each, attn1 q/k/v/out + ff in/out


@pytest.fixture(scope="module")
def results(tmp_path_factory, comfy_checkout):
    comfy, python = comfy_checkout
    work = tmp_path_factory.mktemp("family-outputs")
    lines = run_probe(python, comfy, PROBE, [work, *KINDS], work, timeout=1800)
    head = lines[0]
    assert head["host"] == "comfyui", head
    return head, {r["kind"]: r for r in lines[1:]}


def row(results, kind) -> dict:
    r = results[1].get(kind)
    assert r is not None, kind
    if r.get("absent"):
        pytest.skip(f"this ComfyUI has no comfy.supported_models.{kind}")
    assert "error" not in r, r.get("trace", r)
    return r


def db(v) -> float:
    return float("inf") if v == "bitwise" else float(v)


def check_outputs(o: dict, bypass: bool, what: str) -> None:
    assert o["merge_vs_comfy"] == "bitwise", (what, o)
    if bypass:
        assert o["dynamic_vs_bypass"] == "bitwise", (what, o)
    assert db(o["dynamic_vs_comfy"]) >= MIN_DB, (what, o)
    assert db(o["dynamic_vs_ideal"]) >= db(o["comfy_vs_ideal"]) - IDEAL_SLACK_DB, (what, o)
    for k in ("comfy_vs_base", "merge_vs_base", "dynamic_vs_base"):
        assert db(o[k]) <= MAX_DB_FROM_BASE, (what, k, o)
    assert o["merge_ran_check"] == [] and o["dynamic_ran_check"] == [], (what, o)


@pytest.mark.parametrize("kind", KINDS)
def test_keys_weights_and_outputs_against_comfyuis_loaders(results, kind):
    r = row(results, kind)
    o = r["outputs"]
    print(f"\n{kind:18s} layers {r['file_layers']} ComfyUI {r['comfy_loaded']} ours {r['ours']}  merge "
          f"{o['merge_vs_comfy']}  dynamic {o['dynamic_vs_comfy']} dB (bypass {o.get('dynamic_vs_bypass', '-')})  "
          f"ComfyUI vs fp32 {o['comfy_vs_ideal']}  base {o['comfy_vs_base']} dB  ({r['seconds']} s)")
    assert r["restored"] and r["base_again"] == "bitwise", r
    assert r["comfy_loaded"] == r["file_layers"] == r["ours"] and r["ours_unmatched"] == 0, r
    assert r["written_by_comfy_not_ours"] == [] and r["unequal"] == [] and r["comfy_written"] == r["file_layers"], r
    check_outputs(o, results[0]["bypass_loader"], kind)


def test_ltx2_connector_only_lora_reaches_the_output(results):
    r = row(results, "LTXAV")
    assert len(r["connector_layers"]) == CONNECTORS, r["connector_layers"]
    c = r["connectors"]
    print(f"\nLTX-2 connectors only: ComfyUI vs base {c['comfy_vs_base']} dB, merge {c['merge_vs_comfy']}, dynamic "
          f"{c['dynamic_vs_comfy']} dB from ComfyUI's merge; without the window: merge vs base "
          f"{c['merge_no_window_vs_base']}, dynamic ran check {len(c['dynamic_no_window_ran_check'])} layers")
    check_outputs(c, results[0]["bypass_loader"], "connectors")
    # the lifecycle without the window: the adapters go on after the connectors ran; nothing of them
    # reaches the output, and in dynamic mode the first-call check names every connector layer
    assert c["merge_no_window_vs_base"] == "bitwise" and c["dynamic_no_window_vs_base"] == "bitwise", c
    assert sorted(c["dynamic_no_window_ran_check"]) == sorted([n, "did not run"] for n in r["connector_layers"]), c
    assert c["merge_no_window_ran_check"] == [], c   # merged weights are not watched: the window is what helps


def test_ltx2_whole_file_needs_the_window(results):
    """The earlier measurement (weights bit for bit, output some 50 dB from ComfyUI's): the connector
    layers' share of the file was missing from the output; with the window the output is ComfyUI's."""
    o = row(results, "LTXAV")["outputs"]
    print(f"\nLTX-2 whole file: with the window {o['merge_vs_comfy']}, without {o['merge_no_window_vs_comfy']} dB")
    assert o["merge_vs_comfy"] == "bitwise"
    assert db(o["merge_no_window_vs_comfy"]) < MIN_DB, o
    assert len(o["dynamic_no_window_ran_check"]) == CONNECTORS, o
