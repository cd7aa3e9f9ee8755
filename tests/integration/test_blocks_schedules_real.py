"""Block filters, linear keyframes and the FLOAT-list input in a real ComfyUI (CPU, runs with COMFYUI_DIR).

1. A block filter samples as a hand-edited copy of the file (block 0's up tensors x0.5, the
   cross-attention layers removed) loaded without a filter: bit for bit in exact, dynamic and
   merge; the unfiltered file differs. The report lists the layers per strength.
2. 'linear 0:1, 0.5:0.5, 1:0' over 4 steps == the per-step list '1, 0.75, 0.5, 0.25' == that list
   sent as one FLOAT value by another node into strength_list, bit for bit; all differ from no
   schedule.
"""
from __future__ import annotations

import pytest
from safetensors.torch import load_file

from testkit.comfyui.prompts import SETTINGS, Prompt, assert_bitwise, assert_changed, rel_diff, reports_sent, run
from testkit.lora_assets import install_model_and_lora, save_adapter_file

LORA, EDITED = "it_blocks_style.safetensors", "it_blocks_style_edited.safetensors"
FILTER = "0: 0.5, !cross_attn"


@pytest.fixture(scope="module")
def cond_class(comfy):
    return comfy.helper_cond_class


@pytest.fixture(scope="module")
def blocks_assets(comfy, reference):
    install_model_and_lora(comfy, reference, LORA, seed=103)
    sd = load_file(str(comfy.loras_dir / LORA))
    edited = {}
    for k, v in sd.items():
        if "cross_attn" in k:
            continue
        edited[k] = v * 0.5 if k.startswith("diffusion_model.blocks.0.") and k.endswith("lora_up.weight") else v
    save_adapter_file(edited, comfy.loras_dir / EDITED)
    return comfy


def _ours(p: Prompt, nid: str, lora=LORA, mode="dynamic", **inputs) -> list:
    return p.chain(nid, lora, strength=0.8, mode=mode, **inputs)


def test_block_filter_in_comfyui_equals_the_hand_edited_file(blocks_assets, cond_class):
    p = Prompt(cond_class)
    p.ksampler("100", ["1", 0])
    p.ksampler("101", _ours(p, "110", blocks=FILTER))
    p.ksampler("102", _ours(p, "120", lora=EDITED))
    p.ksampler("103", _ours(p, "130"))
    p.ksampler("104", _ours(p, "140", blocks=FILTER, mode="merge"))
    p.ksampler("105", _ours(p, "150", lora=EDITED, mode="merge"))
    record, lat = run(blocks_assets, p)
    assert_bitwise(lat["101"], lat["102"], "blocks filter vs hand-edited file (dynamic)")
    assert_bitwise(lat["104"], lat["105"], "blocks filter vs hand-edited file (merge)")
    assert rel_diff(lat["101"], lat["103"]) > 1e-3, "the filter made no difference (the wrong answer)"
    assert_changed(lat["102"], lat["100"], "edited adapter")
    rep = {r["node"]: r["report"] for r in reports_sent(record)}
    b = rep["101"]["adapters"][0]["blocks"]
    assert b["text"] == FILTER and b["excluded"] > 0 and [g["factor"] for g in b["strengths"]] == [0.5, 1.0], b


def test_linear_keyframes_and_a_float_list_in_comfyui(blocks_assets, cond_class):
    assert SETTINGS["steps"] == 4
    p = Prompt(cond_class)
    p.node("90", "ZZLoraRuntimeTestFloatList", values="1, 0.75, 0.5, 0.25")
    p.ksampler("101", _ours(p, "110", strength_schedule="linear 0:1, 0.5:0.5, 1:0"))
    p.ksampler("102", _ours(p, "120", strength_schedule="1, 0.75, 0.5, 0.25"))
    p.ksampler("103", _ours(p, "130", strength_list=["90", 0]))
    p.ksampler("104", _ours(p, "140"))
    record, lat = run(blocks_assets, p)
    assert_bitwise(lat["101"], lat["102"], "linear keyframes vs the per-step list")
    assert_bitwise(lat["103"], lat["102"], "FLOAT list input vs the per-step list")
    assert rel_diff(lat["101"], lat["104"]) > 1e-3, "the schedule made no difference (the wrong answer)"
    rep = {r["node"]: r["report"] for r in reports_sent(record)}
    assert rep["101"]["adapters"][0]["schedule_applied"] == "step 1 x1, step 2 x0.75, step 3 x0.5, step 4 x0.25"
