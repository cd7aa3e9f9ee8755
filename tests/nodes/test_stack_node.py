"""LoRA Stack on the bundled host: the same Intent and bit-identical latents as the chain of
Load LoRA Adapter nodes it stands for; rows off are left out; bad rows fail validation
naming the row; the node shows each row's coverage."""
import json

import pytest
import torch

from comfyui_lora_runtime.standalone.host.executor import execute_prompt
from comfyui_lora_runtime.standalone.host.validation import PromptValidationError, validate_prompt
from comfyui_lora_runtime.nodes import lifecycle
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter
from comfyui_lora_runtime.nodes.stack_node import LoraStack, parse_rows

from testkit.nodes_helpers import CLASSES, Capture, sampling_graph  # noqa: F401

ROWS = [{"on": True, "lora": "style.safetensors", "strength": 0.8},
        {"on": True, "lora": "sub/second.safetensors", "strength": -0.5, "schedule": "0:1, 0.5:0.25",
         "branch": "positive only"}]


def _stack(rows):
    return {"2": {"class_type": "LoraRuntimeStack", "inputs": {"model": ["1", 0], "rows": json.dumps(rows)}}}


def _chain(rows):
    nodes, prev = {}, "1"
    for i, r in enumerate(rows):
        nid = f"2{i}"
        nodes[nid] = {"class_type": "LoraRuntimeLoadAdapter", "inputs": {
            "model": [prev, 0], "lora_name": r["lora"], "strength": r["strength"],
            "strength_schedule": r.get("schedule", ""), "branch": r.get("branch", "both")}}
        prev = nid
    return nodes, prev


def _run(prompt, folders):
    Capture.seen.clear()
    res = execute_prompt(prompt, CLASSES, folders=folders)
    return Capture.seen[-1], res


@pytest.mark.parametrize("mode,tier", [("dynamic", "exact"), ("auto", "lossless"), ("merge", "exact")])
def test_stack_of_two_equals_chain_of_two(folders, mode, tier):
    rows = ROWS if mode != "merge" else [dict(r, schedule="", branch="both") for r in ROWS]  # merge refuses a schedule
    chain, last = _chain(rows)
    y_chain, res_chain = _run(sampling_graph(chain, last, mode, tier), folders)
    y_stack, res_stack = _run(sampling_graph(_stack(rows), "2", mode, tier), folders)
    assert torch.equal(y_stack, y_chain)
    # the report names both rows' adapters, in row order, as the chain's does
    rep_s, rep_c = res_stack.ui["10"]["lora_report"][0], res_chain.ui["10"]["lora_report"][0]
    assert [a["name"] for a in rep_s["adapters"]] == [a["name"] for a in rep_c["adapters"]] == \
        ["style.safetensors", "sub/second.safetensors"]
    assert rep_s["decision"]["chosen"] == rep_c["decision"]["chosen"]
    # the stack node shows each row's coverage, as each loader shows its own
    cov = res_stack.ui["2"]["lora_coverage"]
    assert [c["matched"] for c in cov] == [res_chain.ui["20"]["lora_coverage"][0]["matched"],
                                           res_chain.ui["21"]["lora_coverage"][0]["matched"]] == [20, 4]
    # wrong answers: one adapter only, or the rows in the other order with other strengths, differ
    one, last1 = _chain(rows[:1])
    y_one, _ = _run(sampling_graph(one, last1, mode, tier), folders)
    assert not torch.equal(y_stack, y_one)


def test_same_intent_as_the_chain(base):
    rows = parse_rows(json.dumps(ROWS))
    stacked = LoraStack().load(base, json.dumps(ROWS))["result"][0]
    m = base
    for r in rows:
        m = LoadLoraAdapter().load(m, r["lora"], r["strength"], strength_schedule=r["schedule"],
                                   branch=r["branch"])["result"][0]
    assert lifecycle.read(stacked) == lifecycle.read(m)
    assert len(lifecycle.read(stacked).adapters) == 2
    assert lifecycle.read(base).adapters == ()  # the input is not changed


def test_rows_off_are_left_out(folders, base):
    rows = [dict(ROWS[0]), dict(ROWS[1], on=False)]
    out = LoraStack().load(base, json.dumps(rows))
    assert [a.name for a in lifecycle.read(out["result"][0]).adapters] == ["style.safetensors"]
    assert len(out["ui"]["lora_coverage"]) == 1
    y_off, _ = _run(sampling_graph(_stack(rows), "2"), folders)
    one, last = _chain(rows[:1])
    y_one, _ = _run(sampling_graph(one, last), folders)
    assert torch.equal(y_off, y_one)
    y_both, _ = _run(sampling_graph(_stack(ROWS), "2"), folders)
    assert not torch.equal(y_off, y_both)  # the row that is off would change the result
    # every row off: a clone of the input with no adapter
    none = LoraStack().load(base, json.dumps([dict(r, on=False) for r in ROWS]))["result"][0]
    assert none is not base and lifecycle.read(none).adapters == ()


@pytest.mark.parametrize("rows,text", [
    ("not json", "rows is not JSON"),
    ('{"lora": "style.safetensors"}', "must be a JSON list"),
    ([{"lora": "style.safetensors", "strenght": 1.0}], "row 1: unknown key(s) strenght"),
    ([{"lora": ""}], "row 1: pick a LoRA file"),
    ([ROWS[0], {"lora": "missing.safetensors"}], "row 2 (missing.safetensors)"),
    ([{"lora": "style.safetensors", "strength": 11}], "row 1 (style.safetensors): strength 11"),
    ([{"lora": "style.safetensors", "schedule": "0.5:1, 0.2:0"}], "row 1 (style.safetensors)"),
    ([{"lora": "style.safetensors", "branch": "cond"}], "branch 'cond'"),
    ([{"lora": "style.safetensors", "on": "yes"}], "on must be true or false"),
    ([{"lora": "pickled.safetensors"}], "row 1 (pickled.safetensors)"),
])
def test_bad_rows_fail_validation_naming_the_row(folders, rows, text):
    p = sampling_graph(_stack([]), "2")
    p["2"]["inputs"]["rows"] = rows if isinstance(rows, str) else json.dumps(rows)
    ok, err, outputs, node_errors = validate_prompt(p, CLASSES, folders=folders)
    assert not ok and list(node_errors) == ["2"]
    assert text in str(node_errors["2"]), node_errors["2"]
    with pytest.raises(PromptValidationError):
        execute_prompt(p, CLASSES, folders=folders)


def test_a_row_off_is_not_validated(folders):
    """A row that is off is not loaded, so a missing file there does not stop the prompt."""
    p = sampling_graph(_stack([ROWS[0], {"on": False, "lora": "missing.safetensors"}]), "2")
    ok, err, outputs, node_errors = validate_prompt(p, CLASSES, folders=folders)
    assert ok, node_errors


def test_node_declares_the_choices_the_editor_draws(folders):
    spec = LoraStack.INPUT_TYPES()["required"]["rows"][1]
    assert "style.safetensors" in spec["lora_names"] and "sub/second.safetensors" in spec["lora_names"]
    assert spec["branch_choices"] == ["both", "positive only", "negative only"]
    assert json.loads(spec["default"]) == []
