"""The bundled host's graph executor: validation in ComfyUI's shapes, execution
order, hidden inputs, ui/result outputs, error wrapping, interruption."""
import copy

import pytest

from comfyui_lora_runtime.standalone.host import progress
from comfyui_lora_runtime.standalone.host.executor import NodeExecutionError, execute_prompt
from comfyui_lora_runtime.standalone.host.validation import PromptValidationError, validate_prompt

CALLS: list = []


class Number:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 1, "min": -100, "max": 100})}}
    RETURN_TYPES = ("INT",)
    FUNCTION = "make"
    CATEGORY = "test"

    def make(self, value):
        CALLS.append(("Number", value))
        return (value,)


class Add:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"a": ("INT", {"default": 0}), "b": ("INT", {"default": 0})},
                "optional": {"scale": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 10.0})}}
    RETURN_TYPES = ("INT",)
    FUNCTION = "add"
    CATEGORY = "test"

    def add(self, a, b, scale=1.0):
        CALLS.append(("Add", a, b))
        return (int((a + b) * scale),)


class Pick:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"mode": (["first", "second"],), "a": ("INT",), "b": ("INT",)}}
    RETURN_TYPES = ("INT",)
    FUNCTION = "pick"
    CATEGORY = "test"

    def pick(self, mode, a, b):
        return (a if mode == "first" else b,)


class Show:
    """Output node: returns ui and result, reads the hidden inputs."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT",)},
                "hidden": {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO", "unique_id": "UNIQUE_ID"}}
    RETURN_TYPES = ("INT",)
    FUNCTION = "show"
    OUTPUT_NODE = True
    CATEGORY = "test"

    def show(self, value, prompt=None, extra_pnginfo=None, unique_id=None):
        CALLS.append(("Show", value))
        return {"ui": {"value": [value], "unique_id": unique_id, "prompt": prompt,
                       "extra": extra_pnginfo}, "result": (value,)}


class Fail:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT",)}}
    RETURN_TYPES = ("INT",)
    FUNCTION = "go"
    CATEGORY = "test"

    def go(self, value):
        raise ZeroDivisionError(f"cannot handle {value}")


class Even:
    """Validates its own input: VALIDATE_INPUTS returns a string on failure."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 0, "min": 0, "max": 10})}}
    RETURN_TYPES = ("INT",)
    FUNCTION = "go"
    CATEGORY = "test"

    @classmethod
    def VALIDATE_INPUTS(cls, value):
        return True if value % 2 == 0 else f"value {value} is odd"

    def go(self, value):
        return (value,)


class Interrupter:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT",)}}
    RETURN_TYPES = ("INT",)
    FUNCTION = "go"
    CATEGORY = "test"

    def go(self, value):
        progress.interrupt_current_processing()  # as a Ctrl-C handler would
        return (value,)


NODES = {c.__name__: c for c in (Number, Add, Pick, Show, Fail, Even, Interrupter)}


def graph():
    # 1 -> 3 <- 2 ; 3 -> 4 (output); 5 is unused by any output
    return {
        "1": {"class_type": "Number", "inputs": {"value": 2}},
        "2": {"class_type": "Number", "inputs": {"value": 5}},
        "3": {"class_type": "Add", "inputs": {"a": ["1", 0], "b": ["2", 0]}},
        "4": {"class_type": "Show", "inputs": {"value": ["3", 0]}},
        "5": {"class_type": "Number", "inputs": {"value": 99}},
    }


@pytest.fixture(autouse=True)
def _clear():
    CALLS.clear()
    progress.interrupt_current_processing(False)
    yield
    progress.interrupt_current_processing(False)


def errors_of(prompt, node_id):
    ok, error, outputs, node_errors = validate_prompt(prompt, NODES)
    assert not ok
    assert node_id in node_errors, node_errors
    entry = node_errors[node_id]
    assert set(entry) == {"errors", "dependent_outputs", "class_type"}
    assert entry["class_type"] == prompt[node_id]["class_type"]
    for e in entry["errors"]:
        assert set(e) >= {"type", "message", "details", "extra_info"}
    return error, entry


# -- validation ---------------------------------------------------------------
def test_valid_prompt_ok_and_not_mutated():
    p = graph()
    p["1"]["inputs"]["value"] = "2"  # converted to INT by validation, on a copy
    before = copy.deepcopy(p)
    assert validate_prompt(p, NODES) == (True, None, ["4"], {})
    assert p == before


def test_unknown_class_type():
    p = graph()
    p["2"]["class_type"] = "Nope"
    ok, error, outputs, node_errors = validate_prompt(p, NODES)
    assert (ok, outputs, node_errors) == (False, [], {})
    assert error["type"] == "invalid_prompt"
    assert "Nope" in error["message"] and "#2" in error["details"]


def test_missing_class_type_and_no_outputs():
    ok, error, _, _ = validate_prompt({"1": {"inputs": {}}}, NODES)
    assert not ok and error["type"] == "invalid_prompt"
    ok, error, _, _ = validate_prompt({"1": {"class_type": "Number", "inputs": {"value": 1}}}, NODES)
    assert not ok and error["type"] == "prompt_no_outputs"


def test_missing_required_input():
    p = graph()
    del p["3"]["inputs"]["b"]
    error, entry = errors_of(p, "3")
    assert error["type"] == "prompt_outputs_failed_validation"
    assert entry["dependent_outputs"] == ["4"]
    [e] = entry["errors"]
    assert e["type"] == "required_input_missing" and e["extra_info"]["input_name"] == "b"
    # the output depending on it carries no errors of its own, so it is not listed
    assert "4" not in validate_prompt(p, NODES)[3]


def test_min_max_and_bad_literal():
    p = graph()
    p["1"]["inputs"]["value"] = -101
    p["2"]["inputs"]["value"] = 101
    _, e1 = errors_of(p, "1")
    _, e2 = errors_of(p, "2")
    assert e1["errors"][0]["type"] == "value_smaller_than_min"
    assert e2["errors"][0]["type"] == "value_bigger_than_max"
    assert e2["errors"][0]["extra_info"]["received_value"] == 101
    p = graph()
    p["1"]["inputs"]["value"] = 100  # the bound itself is allowed
    p["3"]["inputs"]["scale"] = "lots"
    _, e = errors_of(p, "3")
    assert [x["type"] for x in e["errors"]] == ["invalid_input_type"]
    assert e["errors"][0]["extra_info"]["input_name"] == "scale"


def test_combo_not_in_list():
    p = graph()
    p["6"] = {"class_type": "Pick", "inputs": {"mode": "third", "a": ["1", 0], "b": ["2", 0]}}
    p["4"]["inputs"]["value"] = ["6", 0]
    _, e = errors_of(p, "6")
    [err] = e["errors"]
    assert err["type"] == "value_not_in_list"
    assert "third" in err["details"] and err["extra_info"]["input_name"] == "mode"
    p["6"]["inputs"]["mode"] = "second"
    assert validate_prompt(p, NODES)[0]


def test_links_to_missing_node_or_output_and_type_mismatch():
    p = graph()
    p["3"]["inputs"]["a"] = ["42", 0]
    p["3"]["inputs"]["b"] = ["2", 3]
    _, e = errors_of(p, "3")
    kinds = {x["extra_info"]["input_name"]: x["type"] for x in e["errors"]}
    assert kinds == {"a": "bad_linked_input", "b": "bad_linked_input"}
    assert "42" in e["errors"][0]["message"]
    p = graph()
    p["3"]["inputs"]["a"] = ["2"]
    _, e = errors_of(p, "3")
    assert e["errors"][0]["type"] == "bad_linked_input"


def test_literal_on_a_socket_input():
    p = graph()
    p["4"]["inputs"]["value"] = 7            # fine: INT is a widget type
    assert validate_prompt(p, NODES)[0]
    p["6"] = {"class_type": "Pick", "inputs": {"mode": "first", "a": 1, "b": ["2", 0]}}
    p["4"]["inputs"]["value"] = ["6", 0]
    assert validate_prompt(p, NODES)[0]      # Pick's a/b are INT too
    class NeedsModel:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"model": ("MODEL",)}}
        RETURN_TYPES = ("INT",)
        FUNCTION = "go"
    p["6"] = {"class_type": "NeedsModel", "inputs": {"model": "m.safetensors"}}
    ok, _, _, ne = validate_prompt(p, {**NODES, "NeedsModel": NeedsModel})
    assert not ok and ne["6"]["errors"][0]["type"] == "invalid_input_type"
    assert "must be linked" in ne["6"]["errors"][0]["message"]


def test_return_type_mismatch():
    class FloatOut:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {}}
        RETURN_TYPES = ("FLOAT",)
        FUNCTION = "go"
    p = graph()
    p["7"] = {"class_type": "FloatOut", "inputs": {}}
    p["3"]["inputs"]["a"] = ["7", 0]
    ok, _, _, ne = validate_prompt(p, {**NODES, "FloatOut": FloatOut})
    assert not ok and ne["3"]["errors"][0]["type"] == "return_type_mismatch"


def test_cycle_detected():
    p = graph()
    p["1"] = {"class_type": "Add", "inputs": {"a": ["3", 0], "b": ["2", 0]}}
    ok, error, outputs, ne = validate_prompt(p, NODES)
    assert not ok and outputs == []
    assert set(ne) == {"1", "3"}  # the cycle's members, not node 4 that depends on them
    assert all(ne[n]["errors"][0]["type"] == "dependency_cycle" for n in ne)
    with pytest.raises(PromptValidationError) as exc:
        execute_prompt(p, NODES)
    assert set(exc.value.node_errors) == {"1", "3"}


def test_custom_validation():
    p = graph()
    p["6"] = {"class_type": "Even", "inputs": {"value": 3}}
    p["3"]["inputs"]["b"] = ["6", 0]
    _, e = errors_of(p, "6")
    [err] = e["errors"]
    assert err["type"] == "custom_validation_failed"
    assert "odd" in err["details"] and err["extra_info"]["input_name"] == "value"
    p["6"]["inputs"]["value"] = 4
    assert validate_prompt(p, NODES)[0]
    # an input the node validates itself skips the built-in min/max check (ComfyUI's rule)
    p["6"]["inputs"]["value"] = 12
    assert validate_prompt(p, NODES)[0]


def test_partial_validity_reports_failed_and_good_outputs():
    p = graph()
    p["8"] = {"class_type": "Show", "inputs": {"value": ["9", 0]}}
    p["9"] = {"class_type": "Number", "inputs": {"value": 1000}}
    ok, error, outputs, ne = validate_prompt(p, NODES)
    assert ok and outputs == ["4"] and error is None      # ComfyUI: some outputs are good
    assert ne["9"]["dependent_outputs"] == ["8"]
    with pytest.raises(PromptValidationError, match="bigger than max"):
        execute_prompt(p, NODES)                           # the executor runs all or nothing


# -- execution ----------------------------------------------------------------
def test_executes_needed_nodes_in_topological_order():
    p = graph()
    res = execute_prompt(p, NODES, extra_pnginfo={"workflow": {"w": 1}})
    assert res.outputs["4"] == (7,)
    assert "5" not in res.executed and ("Number", 99) not in CALLS  # not needed by any output
    assert res.executed.index("3") > res.executed.index("1")
    assert res.executed.index("3") > res.executed.index("2")
    assert res.executed[-1] == "4"
    assert CALLS == [("Number", 2), ("Number", 5), ("Add", 2, 5), ("Show", 7)]
    ui = res.ui["4"]
    assert ui["value"] == [7]
    assert ui["unique_id"] == "4"
    assert ui["prompt"]["3"]["inputs"] == {"a": ["1", 0], "b": ["2", 0]}
    assert ui["extra"] == {"workflow": {"w": 1}}


def test_shared_upstream_runs_once_and_optional_input():
    p = {
        "1": {"class_type": "Number", "inputs": {"value": 3}},
        "2": {"class_type": "Add", "inputs": {"a": ["1", 0], "b": ["1", 0], "scale": 2.0}},
        "3": {"class_type": "Add", "inputs": {"a": ["2", 0], "b": ["1", 0]}},
        "4": {"class_type": "Show", "inputs": {"value": ["3", 0]}},
        "5": {"class_type": "Show", "inputs": {"value": ["2", 0]}},
    }
    res = execute_prompt(p, NODES)
    assert CALLS.count(("Number", 3)) == 1
    assert res.outputs["5"] == (12,) and res.outputs["4"] == (15,)


def test_literal_values_are_converted():
    p = graph()
    p["1"]["inputs"]["value"] = "40"
    res = execute_prompt(p, NODES)
    assert res.outputs["4"] == (45,)  # 40 + 5, not "40" + 5


def test_node_error_is_wrapped_and_chained():
    p = graph()
    p["6"] = {"class_type": "Fail", "inputs": {"value": ["1", 0]}}
    p["4"]["inputs"]["value"] = ["6", 0]
    with pytest.raises(NodeExecutionError) as exc:
        execute_prompt(p, NODES)
    err = exc.value
    assert (err.node_id, err.class_type) == ("6", "Fail")
    assert "cannot handle 2" in str(err) and "6" in str(err) and "Fail" in str(err)
    assert isinstance(err.__cause__, ZeroDivisionError)


def test_interrupt_stops_before_next_node():
    p = graph()
    p["6"] = {"class_type": "Interrupter", "inputs": {"value": ["3", 0]}}
    p["4"]["inputs"]["value"] = ["6", 0]
    with pytest.raises(progress.InterruptProcessingException):
        execute_prompt(p, NODES)
    assert ("Show", 7) not in CALLS
    assert not progress.processing_interrupted()  # the flag is consumed


def test_wrong_return_arity_is_an_error():
    class Bad:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {}}
        RETURN_TYPES = ("INT", "INT")
        FUNCTION = "go"

        def go(self):
            return (1,)
    p = {"1": {"class_type": "Bad", "inputs": {}},
         "2": {"class_type": "Show", "inputs": {"value": ["1", 1]}}}
    with pytest.raises(NodeExecutionError, match="RETURN_TYPES"):
        execute_prompt(p, {**NODES, "Bad": Bad})


def test_progress_hook_gets_node_id():
    seen = []

    class Steps:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"value": ("INT",)}}
        RETURN_TYPES = ("INT",)
        FUNCTION = "go"

        def go(self, value):
            bar = progress.ProgressBar(3)
            for _ in range(3):
                bar.update(1)
            return (value,)

    p = graph()
    p["6"] = {"class_type": "Steps", "inputs": {"value": ["3", 0]}}
    p["4"]["inputs"]["value"] = ["6", 0]
    with progress.progress_hook(lambda v, t, preview, node_id=None: seen.append((node_id, v, t))):
        execute_prompt(p, {**NODES, "Steps": Steps})
    assert seen == [("6", 1, 3), ("6", 2, 3), ("6", 3, 3)]
    assert progress.get_progress_bar_global_hook() is None


class _Pair:
    """A node with a file-like input, a list input and a number, validating some of them itself."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"name": ("STRING",), "mode": (["a", "b"],),
                             "value": ("INT", {"default": 0, "min": 0, "max": 10})}}
    RETURN_TYPES = ("INT",)
    FUNCTION = "go"
    CATEGORY = "test"

    def go(self, name, mode, value):
        return (value,)


class ChecksAll(_Pair):
    @classmethod
    def VALIDATE_INPUTS(cls, name, mode, value):
        return True if name == "good" else f"file {name} is bad"


class ChecksName(_Pair):
    @classmethod
    def VALIDATE_INPUTS(cls, name):
        return True if name == "good" else f"file {name} is bad"


def _shape_errors(cls, **inputs):
    p = {"1": {"class_type": cls.__name__, "inputs": {"name": "good", "mode": "a", "value": 1, **inputs}},
         "2": {"class_type": "Show", "inputs": {"value": ["1", 0]}}}
    ok, _, _, ne = validate_prompt(p, {**NODES, cls.__name__: cls})
    if ok:
        return []
    return sorted((e["extra_info"]["input_name"], e["type"]) for e in ne["1"]["errors"])


def test_validate_inputs_declaring_every_input_blames_each_of_them_as_comfyui_does():
    """ComfyUI appends the node's answer once per declared input: a node that declares all its
    inputs gets its one mistake reported on each of them (the shape our loader avoids)."""
    assert _shape_errors(ChecksAll, name="bad") == [("mode", "custom_validation_failed"),
                                                    ("name", "custom_validation_failed"),
                                                    ("value", "custom_validation_failed")]
    assert _shape_errors(ChecksAll, mode="c") == []  # declared inputs skip the built-in list check
    assert _shape_errors(ChecksAll, value=11) == []  # ... and min/max


def test_validate_inputs_declaring_one_input_leaves_the_rest_to_the_built_in_checks():
    assert _shape_errors(ChecksName, name="bad") == [("name", "custom_validation_failed")]
    assert _shape_errors(ChecksName, mode="c") == [("mode", "value_not_in_list")]
    assert _shape_errors(ChecksName, value=11) == [("value", "value_bigger_than_max")]
    # two mistakes, two errors: the node's own check still runs when another input failed
    assert _shape_errors(ChecksName, name="bad", mode="c") == [("mode", "value_not_in_list"),
                                                               ("name", "custom_validation_failed")]
