"""Validation of API-format prompts in ComfyUI's shapes (the bundled host's stand-in for the
validation half of ComfyUI's execution.py).

`validate_prompt` answers (ok, error, good_output_ids, node_errors) with

    node_errors = {node_id: {"errors": [{"type", "message", "details",
                                         "extra_info": {"input_name", ...}}],
                             "dependent_outputs": [output_ids],
                             "class_type": str}}
"""
from __future__ import annotations

import copy
import inspect
import logging
from typing import Any, Mapping

from . import folder_paths
from .prompt_graph import depends_on, is_link, nodes_in_cycles

log = logging.getLogger(__name__)

NodeClasses = Mapping[str, type]

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")


class PromptValidationError(ValueError):
    """The prompt failed validation; `error` and `node_errors` are ComfyUI-shaped."""

    def __init__(self, error: dict | None, node_errors: dict):
        self.error = error or {}
        self.node_errors = node_errors
        super().__init__(format_validation_errors(self.error, node_errors))


def validate_prompt(prompt: Mapping[str, Any], node_classes: NodeClasses, *,
                    folders: folder_paths.ModelFolders | None = None
                    ) -> tuple[bool, dict | None, list[str], dict]:
    """Validate `prompt` without changing it. Returns (ok, error, outputs, node_errors)."""
    with folder_paths.activated(folders):
        return validate(copy.deepcopy(dict(prompt)) if isinstance(prompt, Mapping) else prompt,
                         node_classes)


def normalized_prompt(prompt: Mapping[str, Any], node_classes: NodeClasses, *,
                      folders: folder_paths.ModelFolders | None = None) -> dict:
    """A validated copy of `prompt` with its literal inputs converted (INT, FLOAT, STRING,
    BOOLEAN), i.e. what `execute_prompt` runs and what SaveImage stores in a PNG.
    Raises PromptValidationError."""
    with folder_paths.activated(folders):
        work = copy.deepcopy(dict(prompt)) if isinstance(prompt, Mapping) else prompt
        ok, error, _, node_errors = validate(work, node_classes)
    if not ok or node_errors:
        raise PromptValidationError(error, node_errors)
    return work


def _error(kind: str, message: str, details: str = "", **extra_info) -> dict:
    """One error in ComfyUI's shape."""
    return {"type": kind, "message": message, "details": details, "extra_info": extra_info}


def validate(prompt: Any, node_classes: NodeClasses) -> tuple[bool, dict | None, list[str], dict]:
    """Validation proper; converts literal INT/FLOAT/STRING/BOOLEAN inputs in place."""
    if not isinstance(prompt, dict):
        return (False, _error("invalid_prompt", "Prompt must be a JSON object of nodes",
                                     type(prompt).__name__), [], {})
    outputs = []
    for node_id, node in prompt.items():
        if not isinstance(node, dict) or "class_type" not in node:
            return (False, _error(
                "invalid_prompt", "Cannot execute because a node is missing the class_type property.",
                f"Node ID '#{node_id}'"), [], {})
        cls = node_classes.get(node["class_type"])
        if cls is None:
            return (False, _error(
                "invalid_prompt", f"Cannot execute because node {node['class_type']} does not exist.",
                f"Node ID '#{node_id}'"), [], {})
        if not isinstance(node.get("inputs", {}), dict):
            return (False, _error("invalid_prompt", "Node inputs must be a JSON object",
                                         f"Node ID '#{node_id}'"), [], {})
        node.setdefault("inputs", {})
        if getattr(cls, "OUTPUT_NODE", False) is True:
            outputs.append(node_id)
    if not outputs:
        return (False, _error("prompt_no_outputs", "Prompt has no outputs"), [], {})

    validated: dict[str, tuple[bool, list[dict]]] = {}
    for node_id in nodes_in_cycles(prompt):
        validated[node_id] = (False, [_error(
            "dependency_cycle", "Dependency cycle detected",
            f"node {node_id} ({prompt[node_id]['class_type']}) depends on its own output", input_name=None)])

    good_outputs: list[str] = []
    failed: list[tuple[str, list[dict]]] = []
    node_errors: dict[str, dict] = {}
    for out_id in outputs:
        try:
            ok, reasons = _validate_node(prompt, node_classes, out_id, validated)
        except Exception as ex:  # a bug in a node's INPUT_TYPES etc.
            log.exception("exception while validating node %s", out_id)
            ok, reasons = False, [_error("exception_during_validation", "Exception when validating node", str(ex),
                                         exception_type=type(ex).__name__)]
            validated[out_id] = (ok, reasons)
        if ok:
            good_outputs.append(out_id)
            continue
        failed.append((out_id, reasons))
        for nid, (nok, nreasons) in validated.items():
            # Nodes downstream of a bad node are invalid too but carry no reasons; skip them.
            if nok or not nreasons or not depends_on(prompt, out_id, nid):
                continue
            entry = node_errors.setdefault(nid, {"errors": nreasons, "dependent_outputs": [],
                                                 "class_type": prompt[nid]["class_type"]})
            entry["dependent_outputs"].append(out_id)
    for nid, entry in node_errors.items():
        for r in entry["errors"]:
            log.debug("validation: node %s (%s): %s: %s", nid, entry["class_type"], r["message"], r["details"])

    if not good_outputs:
        details = "\n".join(f"{r['message']}: {r['details']}" for _, rs in failed for r in rs)
        return (False, _error("prompt_outputs_failed_validation",
                                     "Prompt outputs failed validation", details),
                good_outputs, node_errors)
    return (True, None, good_outputs, node_errors)


def input_spec(class_inputs: dict, name: str) -> tuple[Any, str | None, dict]:
    """(type, category, options) of input `name`; type is a str or a list of combo values."""
    for category in ("required", "optional", "hidden"):
        section = class_inputs.get(category) or {}
        if name in section:
            spec = section[name]
            if category == "hidden":
                return spec, category, {}
            if isinstance(spec, str):
                return spec, category, {}
            typ = spec[0]
            opts = dict(spec[1]) if len(spec) > 1 and isinstance(spec[1], dict) else {}
            if typ == "COMBO" and "options" in opts:  # newer spec: ("COMBO", {"options": [...]})
                typ = list(opts["options"])
            return typ, category, opts
    return None, None, {}


def types_compatible(received: Any, expected: Any) -> bool:
    """ComfyUI's link type rule: "*" matches anything; "A,B" unions match by subset."""
    if isinstance(expected, (list, tuple)):
        return received == "COMBO" or isinstance(received, (list, tuple)) or received == "*"
    if not isinstance(received, str) or not isinstance(expected, str):
        return False
    if received == "*" or expected == "*" or received == expected:
        return True
    return set(received.split(",")) <= set(expected.split(","))


def _convert_literal(input_type: Any, val: Any) -> Any:
    if input_type == "INT":
        if isinstance(val, bool):
            raise ValueError("a boolean is not an INT")
        return int(val)
    if input_type == "FLOAT":
        if isinstance(val, bool):
            raise ValueError("a boolean is not a FLOAT")
        return float(val)
    if input_type == "STRING":
        return str(val)
    if input_type == "BOOLEAN":
        if isinstance(val, str):
            if val.lower() in ("true", "1"):
                return True
            if val.lower() in ("false", "0"):
                return False
            raise ValueError(f"{val!r} is not a boolean")
        return bool(val)
    return val


def _validate_node(prompt: dict, node_classes: NodeClasses, node_id: str,
                   validated: dict) -> tuple[bool, list[dict]]:
    if node_id in validated:
        return validated[node_id]
    node = prompt[node_id]
    inputs = node["inputs"]
    cls = node_classes[node["class_type"]]
    class_inputs = cls.INPUT_TYPES()
    errors: list[dict] = []
    upstream_ok = True

    validate_fn = getattr(cls, "VALIDATE_INPUTS", None)
    fn_args: list[str] = []
    fn_kwargs = False
    if validate_fn is not None:
        argspec = inspect.getfullargspec(validate_fn)
        fn_args = [a for a in argspec.args if a not in ("cls", "self", "s")] + list(argspec.kwonlyargs)
        fn_kwargs = argspec.varkw is not None
    received_types: dict[str, Any] = {}

    declared = list((class_inputs.get("required") or {})) + list((class_inputs.get("optional") or {}))
    for name in declared:
        input_type, category, opts = input_spec(class_inputs, name)
        info = (input_type, opts)
        if name not in inputs:
            if category == "required":
                errors.append(_error("required_input_missing", "Required input is missing", name, input_name=name))
            continue
        val = inputs[name]
        if is_link(val):
            if len(val) != 2:
                errors.append(_error("bad_linked_input",
                                     "Bad linked input, must be a length-2 list of [node_id, slot_index]", name,
                                     input_name=name, input_config=info, received_value=val))
                continue
            src_id, slot = str(val[0]), val[1]
            if src_id not in prompt:
                errors.append(_error("bad_linked_input", f"Linked node {src_id} does not exist",
                                     f"{name} <- node {src_id}", input_name=name, input_config=info, linked_node=val))
                continue
            src_types = tuple(node_classes[prompt[src_id]["class_type"]].RETURN_TYPES)
            if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < len(src_types):
                errors.append(_error("bad_linked_input",
                                     f"Linked node {src_id} ({prompt[src_id]['class_type']}) has no "
                                     f"output {slot!r} (it has {len(src_types)})",
                                     f"{name} <- node {src_id} output {slot!r}",
                                     input_name=name, input_config=info, linked_node=val))
                continue
            received = src_types[slot]
            received_types[name] = received
            if "input_types" not in fn_args and not types_compatible(received, input_type):
                errors.append(_error("return_type_mismatch", "Return type mismatch between linked nodes",
                                     f"{name}, received_type({received}) mismatch input_type({input_type})",
                                     input_name=name, input_config=info, received_type=received, linked_node=val))
                continue
            ok, _ = _validate_node(prompt, node_classes, src_id, validated)
            if not ok:
                upstream_ok = False
            continue

        if isinstance(val, dict) and "__value__" in val:  # a list widget value, wrapped
            val = val["__value__"]
            inputs[name] = val
        if isinstance(input_type, str) and input_type not in WIDGET_TYPES and input_type != "*":
            # ComfyUI lets this through and the node fails later; say it here instead.
            errors.append(_error("invalid_input_type",
                                 f"Input of type {input_type} must be linked to a node output, got a literal value",
                                 f"{name}, {val!r}", input_name=name, input_config=info, received_value=val))
            continue
        try:
            val = _convert_literal(input_type, val)
            inputs[name] = val
        except (TypeError, ValueError) as ex:
            errors.append(_error("invalid_input_type", f"Failed to convert an input value to a {input_type} value",
                                 f"{name}, {val!r}, {ex}", input_name=name, input_config=info, received_value=val,
                                 exception_message=str(ex)))
            continue
        if name in fn_args or fn_kwargs:
            continue  # the node validates this input itself (ComfyUI's rule)
        if "min" in opts and val < opts["min"]:
            errors.append(_error("value_smaller_than_min", f"Value {val} smaller than min of {opts['min']}", name,
                                 input_name=name, input_config=info, received_value=val))
            continue
        if "max" in opts and val > opts["max"]:
            errors.append(_error("value_bigger_than_max", f"Value {val} bigger than max of {opts['max']}", name,
                                 input_name=name, input_config=info, received_value=val))
            continue
        if isinstance(input_type, (list, tuple)) and val not in input_type:
            shown = f"(list of length {len(input_type)})" if len(input_type) > 20 else str(list(input_type))
            errors.append(_error("value_not_in_list", "Value not in list", f"{name}: '{val}' not in {shown}",
                                 input_name=name, input_config=None if len(input_type) > 20 else info,
                                 received_value=val))
            continue

    # Like ComfyUI, the node's own check runs when a built-in check failed on another input
    # (two mistakes, two errors), and its answer is attached to every input it declares.
    # Unlike ComfyUI, it is not called with an input that already has an error (missing,
    # wrong type): that mistake is reported once.
    flagged = {e["extra_info"].get("input_name") for e in errors}
    if validate_fn is not None and (fn_args or fn_kwargs) and not (flagged & set(fn_args)) \
            and not (fn_kwargs and errors):
        call_args = {k: v for k, v in inputs.items()
                     if not is_link(v) and (k in fn_args or fn_kwargs)}
        if "input_types" in fn_args:
            call_args["input_types"] = received_types
        try:
            result = validate_fn(**call_args)
        except Exception as ex:
            result = f"{type(ex).__name__}: {ex}"
        if result is not True:
            names = [k for k in call_args if k != "input_types"] or [None]
            for name in names:
                details = f"{name}" + ("" if result is False else f" - {result}")
                errors.append(_error("custom_validation_failed", "Custom validation failed for node", details,
                                     input_name=name))

    ret = (not errors and upstream_ok, errors)
    validated[node_id] = ret
    return ret


def format_validation_errors(error: dict | None, node_errors: Mapping[str, dict]) -> str:
    """Human-readable text for a failed validation (used by the CLI and the exception)."""
    lines = []
    if error:
        lines.append(f"{error.get('message', 'invalid prompt')}"
                     + (f" ({error['details']})" if error.get("details") and not node_errors else ""))
    for nid, entry in node_errors.items():
        lines.append(f"  node {nid} ({entry.get('class_type')}):")
        for r in entry.get("errors", []):
            lines.append(f"    - {r.get('message')}: {r.get('details')}")
    return "\n".join(lines) if lines else "prompt failed validation"
