"""Our adapters and ComfyUI's own LoRA under ComfyUI 0.33's dynamic VRAM (``ModelPatcherDynamic``), on the
CPU: ComfyUI's own patcher, loader, cast path, LoRA patches and unload functions, with comfy-aimdo's native
parts replaced by a stand-in (`testkit.comfy_dynamic_vram_probe` says exactly what is ComfyUI's and what is
simulated; docs/dynamic_vram.md). ComfyUI 0.3.64 has no dynamic VRAM: skipped there.

Asserted, each against a reference and a wrong answer:

- without an adapter the dynamic patcher samples the plain patcher's output bit for bit (the simulation
  changes nothing by itself), with 26 of its cast layers on virtual-VRAM ranges and the small ones pre-loaded;
- ours alone, merge / auto / dynamic, exact: bit for bit ComfyUI's own unmerged LoRA (its bypass loader)
  with our file under dynamic VRAM, and ours on a plain patcher; every layer reported per layer ('streamed
  (dynamic VRAM): dynamic' x 20, 're-staged at every load (dynamic VRAM): dynamic' x 1: the small
  ``text_embedding.0``); the stored weights never written; lossless within 1 % of exact;
- ComfyUI's LoRA (blocks.0) and ours (every block layer) on the same weights: bit for bit ComfyUI's LoRA +
  its bypass loader with our file; the wrong answers (ComfyUI's LoRA alone, ours alone) are 2 % and 6.5 %
  away; a second run of the same graph: ComfyUI loads the model again, we apply nothing (resumed), the same
  bits; a second prompt without our adapter gives ComfyUI's-LoRA-alone output bit for bit and takes ours off;
- mid-sampling, after step 1: a partial VRAM unload (ranges evicted, re-faulted, ComfyUI's patch applied
  again), the pinned host copies given back, a second model loaded and run (its faults evict our ranges),
  a full unload of the device: every output bit for bit the undisturbed one; after the full unload our
  adapters come off at the end of the sampling;
- reads of a base weight: our read of a layer that ComfyUI's LoRA patches equals, bit for bit in fp32, the
  weight ComfyUI's cast computes with (the stored weight is 86 % away); bf16: 0.3 % (our fp32 read is not
  rounded to bf16, ComfyUI's cast is); a DoRA adapter on that layer within fp32 rounding of the fp64
  reference, whose norms include ComfyUI's patch (the norms of the stored weight: 37 % away);
- a norm delta on a LayerNorm the loader streams rides at cast time: bit for bit the reference, the stored
  tensor untouched, gone after the run; the wrong answer, a write into the stored tensor, is never seen
  by the resident copy ComfyUI casts from (the output stays the base's).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from testkit.comfyui.probe import run_probe

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "tests" / "testkit" / "comfy_dynamic_vram_probe.py"
STREAMED, RESTAGED = "streamed (dynamic VRAM): dynamic", "re-staged at every load (dynamic VRAM): dynamic"
# the wrong answers' distance from the right one, measured 0.015-0.86; anything well above bf16 noise shows them
MIN_EFFECT = 5e-3


@pytest.fixture(scope="module")
def results(tmp_path_factory, comfy_checkout):
    comfy, python = comfy_checkout
    work = tmp_path_factory.mktemp("dynamic_vram")
    lines = run_probe(python, comfy, PROBE, [work], work, timeout=900)
    head = lines[0]
    assert head["host"] == "comfyui", head
    if not head["dynamic"]:
        pytest.skip(f"ComfyUI {head['comfyui']} has no dynamic VRAM (ModelPatcherDynamic, comfy-aimdo)")
    errors = [r for r in lines[1:] if "error" in r]
    assert not errors, errors
    return head, lines[1:]


def _cases(results, name):
    return [r for r in results[1] if r["case"] == name]


def test_setup_the_dynamic_patcher_alone_samples_the_plain_patchers_output(results):
    head, _ = results
    assert head["our_layers"] == 21 and head["overlap"] == 10 and head["small_layers"] == ["text_embedding.0"]
    (r,) = _cases(results, "setup")
    assert r["is_dynamic"] and r["dynamic_vs_plain"] == "bitwise", r
    assert r["staged"]["with_range"] == 26 and r["staged"]["lowvram_patches"] == 0 and r["staged"]["backups"] > 0
    assert r["vbar_casts"] > 0 and r["resident_hits"] > 0 and r["weights_fresh"], r
    (c,) = _cases(results, "comfy_only")
    assert c["staged"]["lowvram_patches"] == 10 and c["vs_base_rel"] > MIN_EFFECT and c["weights_fresh"], c


def test_ours_alone_is_comfyuis_own_unmerged_lora_in_every_mode_and_named_per_layer(results):
    rows = _cases(results, "ours")
    assert [(r["mode"], r["tier"]) for r in rows] == [("merge", "exact"), ("auto", "exact"), ("dynamic", "exact"),
                                                      ("dynamic", "lossless")]
    for r in rows:
        what = (r["mode"], r["tier"])
        rep = r["report"]
        assert rep["chosen"] == "dynamic" and rep["layers"] == {STREAMED: 20, RESTAGED: 1}, (what, rep)
        assert rep["host_patched"] == 0 and rep["ran_check"] == [], (what, rep)
        assert r["vs_base_rel"] > MIN_EFFECT and r["weights_untouched"] and r["weights_fresh"], (what, r)
        assert r["bare_after_vs_base"] == "bitwise" and not r["kept_after_bare"], (what, r)
        assert r["leftovers"] == [], (what, r)
        if r["tier"] == "exact":
            assert r["vs_comfy_bypass"] == "bitwise" and r["vs_plain_patcher"] == "bitwise", (what, r)
        else:   # lossless folds the factors: bf16 rounding of the delta apart (0.35 % measured), far from the base
            assert r["vs_exact_rel"] < 0.01 < r["vs_base_rel"] / r["vs_exact_rel"], (what, r)


def test_ours_beside_comfyuis_lora_on_the_same_weights_applied_once_per_load(results):
    rows = _cases(results, "both")
    assert [r["mode"] for r in rows] == ["merge", "auto", "dynamic"]
    for r in rows:
        mode = r["mode"]
        assert r["vs_reference"] == "bitwise", (mode, r)
        assert r["vs_comfy_only_rel"] > MIN_EFFECT and r["vs_ours_only_rel"] > MIN_EFFECT, (mode, r)
        assert r["report"]["layers"] == {STREAMED: 20, RESTAGED: 1} and r["report"]["host_patched"] == 10, r
        assert r["report"]["chosen"] == "dynamic" and not r["report"]["adapters_kept"], (mode, r)
        # the second run of the same graph: ComfyUI's loader ran again, ours applied nothing
        assert r["loads"] == [1, 1] and r["applies"] == [1, 0], (mode, r)
        assert r["report_rerun"]["adapters_kept"] and r["rerun_vs_first"] == "bitwise", (mode, r)
        assert r["without_ours_vs_comfy_only"] == "bitwise", (mode, r)
        assert not r["kept_after_other"] and r["leftovers_after_other"] == [], (mode, r)
        assert r["weights_untouched"] and r["weights_fresh"], (mode, r)


def test_what_comfyui_does_mid_sampling_changes_no_bit(results):
    rows = {r["event"]: r for r in _cases(results, "midrun")}
    assert set(rows) == {"partial_unload", "ram_unload", "second_model", "full_unload"}
    for event, r in rows.items():
        assert r["vs_reference"] == "bitwise" and r["vs_comfy_only_rel"] > MIN_EFFECT, (event, r)
        assert r["report"]["ran_check"] == [] and r["weights_fresh"], (event, r)
        assert r["faults_after"] > r["faults_before"], (event, r)     # the sampling went on after the event
    assert rows["partial_unload"]["freed_bytes"] > 0 and rows["partial_unload"]["stats"]["evictions"] > 0
    assert rows["ram_unload"]["freed_bytes"] > 0
    assert rows["second_model"]["freed_bytes"] > 0                    # the other model's faults evicted ours
    full = rows["full_unload"]
    assert full["loaded_after"] is False and full["stats"]["evictions"] > 0, full
    assert not full["kept_after"] and full["leftovers_after"] == [], full   # off once the sampling ended
    for event in ("partial_unload", "ram_unload", "second_model"):
        assert rows[event]["kept_after"], (event, rows[event])        # a partial unload keeps the model's state


def test_reads_of_a_base_weight_go_through_comfyuis_cast(results):
    (r,) = _cases(results, "reads")
    f32, bf16 = r["float32"], r["bfloat16"]
    for x in (f32, bf16):
        assert x["has_range"] and x["lowvram_patch"] and x["resident_vs_first"] == "bitwise", x
        assert x["stored_vs_cast_rel"] > 0.1, x          # the wrong answer: the stored weight alone
    assert f32["read_vs_cast"] == "bitwise", f32
    assert bf16["read_vs_cast_rel"] < 0.005, bf16        # our read is fp32; ComfyUI's cast rounds to bf16
    dora = r["dora"]
    assert dora["vs_reference_rel"] < 1e-5, dora         # fp32 layer vs fp64 reference: fp32 rounding
    assert dora["wrong_vs_reference_rel"] > 0.1, dora    # norms of the stored weight, ComfyUI's patch beside


def test_a_norm_delta_on_a_streamed_layer_rides_at_cast_time(results):
    (r,) = _cases(results, "param_on_streamed_norm")
    assert r["norm_has_range"] and r["params"] and r["params"][0]["param"] == "norm.weight", r
    assert r["ours_vs_reference"] == "bitwise" and r["ours_again"] == "bitwise", r
    assert r["ours_vs_base_rel"] > MIN_EFFECT and r["after_vs_base"] == "bitwise", r
    assert r["base_resident"] == "bitwise" and r["stored_untouched"], r
    # the wrong answer: a delta written into the stored tensor never reaches the resident copy ComfyUI casts
    assert r["written_vs_base"] == "bitwise" and r["written_vs_reference_rel"] > MIN_EFFECT, r
