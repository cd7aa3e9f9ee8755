"""Graph executor for API-format prompts (the bundled host's stand-in for
ComfyUI's execution.py).

A prompt is {node_id: {"class_type": str, "inputs": {name: value | [src_id, slot]}}}.
`validate_prompt` checks it and answers in ComfyUI's shapes:
(ok, error, good_output_ids, node_errors) with

    node_errors = {node_id: {"errors": [{"type", "message", "details",
                                         "extra_info": {"input_name", ...}}],
                             "dependent_outputs": [output_ids],
                             "class_type": str}}

`execute_prompt` runs the nodes the OUTPUT_NODEs need, in topological order, and
returns an `ExecutionResult`. Unlike the ComfyUI server, which runs whichever
outputs validated, it refuses a prompt with any node error (a headless run
should not silently drop half its outputs).

Node classes follow ComfyUI's v1 node API: INPUT_TYPES() (required / optional /
hidden), RETURN_TYPES, FUNCTION, OUTPUT_NODE, optional VALIDATE_INPUTS.
Per-call list mapping (INPUT_IS_LIST / OUTPUT_IS_LIST) and node expansion are
not supported.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import os
from typing import Any, Callable, Mapping

from . import folder_paths, options
from .progress import (InterruptProcessingException, executing_node,
                       throw_exception_if_processing_interrupted)

log = logging.getLogger(__name__)

NodeClasses = Mapping[str, type]

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")


class PromptValidationError(ValueError):
    """The prompt failed validation; `error` and `node_errors` are ComfyUI-shaped."""

    def __init__(self, error: dict | None, node_errors: dict):
        self.error = error or {}
        self.node_errors = node_errors
        super().__init__(format_validation_errors(self.error, node_errors))


class NodeExecutionError(RuntimeError):
    """A node raised while running; the original exception is chained (__cause__)."""

    def __init__(self, node_id: str, class_type: str, original: BaseException):
        self.node_id = node_id
        self.class_type = class_type
        self.original = original
        self.exception_message = str(original)
        self.exception_type = type(original).__name__
        super().__init__(f"node {node_id} ({class_type}) failed: "
                         f"{self.exception_type}: {self.exception_message}")


@dataclasses.dataclass
class ExecutionResult:
    outputs: dict[str, tuple]          # node id -> its output tuple (every executed node)
    ui: dict[str, dict]                # node id -> its "ui" dict (nodes that returned one)
    executed: list[str]                # node ids in execution order
    output_dir: str                    # the output directory of the run

    def saved_files(self) -> list[str]:
        """Absolute paths of the images that "output"-type ui entries point to."""
        files = []
        for ui in self.ui.values():
            for item in ui.get("images", []) or []:
                if isinstance(item, dict) and item.get("type") == "output" and "filename" in item:
                    files.append(os.path.join(self.output_dir, item.get("subfolder", ""), item["filename"]))
        return files


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------
def validate_prompt(prompt: Mapping[str, Any], node_classes: NodeClasses, *,
                    folders: folder_paths.ModelFolders | None = None
                    ) -> tuple[bool, dict | None, list[str], dict]:
    """Validate `prompt` without changing it. Returns (ok, error, outputs, node_errors)."""
    with folder_paths.activated(folders):
        return _validate(copy.deepcopy(dict(prompt)) if isinstance(prompt, Mapping) else prompt,
                         node_classes)


def normalized_prompt(prompt: Mapping[str, Any], node_classes: NodeClasses, *,
                      folders: folder_paths.ModelFolders | None = None) -> dict:
    """A validated copy of `prompt` with its literal inputs converted (INT, FLOAT, STRING,
    BOOLEAN), i.e. what `execute_prompt` runs and what SaveImage stores in a PNG.
    Raises PromptValidationError."""
    with folder_paths.activated(folders):
        work = copy.deepcopy(dict(prompt)) if isinstance(prompt, Mapping) else prompt
        ok, error, _, node_errors = _validate(work, node_classes)
    if not ok or node_errors:
        raise PromptValidationError(error, node_errors)
    return work


def _prompt_error(kind: str, message: str, details: str = "") -> dict:
    return {"type": kind, "message": message, "details": details, "extra_info": {}}


def _validate(prompt: Any, node_classes: NodeClasses) -> tuple[bool, dict | None, list[str], dict]:
    """Validation proper; converts literal INT/FLOAT/STRING/BOOLEAN inputs in place."""
    if not isinstance(prompt, dict):
        return (False, _prompt_error("invalid_prompt", "Prompt must be a JSON object of nodes",
                                     type(prompt).__name__), [], {})
    outputs = []
    for node_id, node in prompt.items():
        if not isinstance(node, dict) or "class_type" not in node:
            return (False, _prompt_error(
                "invalid_prompt", "Cannot execute because a node is missing the class_type property.",
                f"Node ID '#{node_id}'"), [], {})
        cls = node_classes.get(node["class_type"])
        if cls is None:
            return (False, _prompt_error(
                "invalid_prompt", f"Cannot execute because node {node['class_type']} does not exist.",
                f"Node ID '#{node_id}'"), [], {})
        if not isinstance(node.get("inputs", {}), dict):
            return (False, _prompt_error("invalid_prompt", "Node inputs must be a JSON object",
                                         f"Node ID '#{node_id}'"), [], {})
        node.setdefault("inputs", {})
        if getattr(cls, "OUTPUT_NODE", False) is True:
            outputs.append(node_id)
    if not outputs:
        return (False, _prompt_error("prompt_no_outputs", "Prompt has no outputs"), [], {})

    validated: dict[str, tuple[bool, list[dict]]] = {}
    for node_id in _nodes_in_cycles(prompt):
        validated[node_id] = (False, [{
            "type": "dependency_cycle",
            "message": "Dependency cycle detected",
            "details": f"node {node_id} ({prompt[node_id]['class_type']}) depends on its own output",
            "extra_info": {"input_name": None},
        }])

    good_outputs: list[str] = []
    failed: list[tuple[str, list[dict]]] = []
    node_errors: dict[str, dict] = {}
    for out_id in outputs:
        try:
            ok, reasons = _validate_node(prompt, node_classes, out_id, validated)
        except Exception as ex:  # a bug in a node's INPUT_TYPES etc.
            log.exception("exception while validating node %s", out_id)
            ok, reasons = False, [{
                "type": "exception_during_validation",
                "message": "Exception when validating node",
                "details": str(ex),
                "extra_info": {"exception_type": type(ex).__name__},
            }]
            validated[out_id] = (ok, reasons)
        if ok:
            good_outputs.append(out_id)
            continue
        failed.append((out_id, reasons))
        for nid, (nok, nreasons) in validated.items():
            # Nodes downstream of a bad node are invalid too but carry no reasons; skip them.
            if nok or not nreasons or not _depends_on(prompt, out_id, nid):
                continue
            entry = node_errors.setdefault(nid, {"errors": nreasons, "dependent_outputs": [],
                                                 "class_type": prompt[nid]["class_type"]})
            entry["dependent_outputs"].append(out_id)
    for nid, entry in node_errors.items():
        for r in entry["errors"]:
            log.debug("validation: node %s (%s): %s: %s", nid, entry["class_type"], r["message"], r["details"])

    if not good_outputs:
        details = "\n".join(f"{r['message']}: {r['details']}" for _, rs in failed for r in rs)
        return (False, _prompt_error("prompt_outputs_failed_validation",
                                     "Prompt outputs failed validation", details),
                good_outputs, node_errors)
    return (True, None, good_outputs, node_errors)


def _is_link(value: Any) -> bool:
    return isinstance(value, list)


def _links(node: dict) -> list[tuple[str, Any]]:
    return [(name, v) for name, v in node.get("inputs", {}).items() if _is_link(v)]


def _depends_on(prompt: dict, out_id: str, node_id: str) -> bool:
    """Whether node_id is out_id or upstream of it (following well-formed links only)."""
    seen, stack = set(), [out_id]
    while stack:
        nid = stack.pop()
        if nid == node_id:
            return True
        if nid in seen or nid not in prompt:
            continue
        seen.add(nid)
        for _, v in _links(prompt[nid]):
            if len(v) == 2 and str(v[0]) in prompt:
                stack.append(str(v[0]))
    return False


def _nodes_in_cycles(prompt: dict) -> list[str]:
    """Nodes that can reach themselves through links (cycle members, not their dependants)."""
    deps = {nid: {str(v[0]) for _, v in _links(n) if len(v) == 2 and str(v[0]) in prompt}
            for nid, n in prompt.items()}
    # Kahn: whatever cannot be ordered is in a cycle or downstream of one.
    indeg = {nid: len(d) for nid, d in deps.items()}
    users: dict[str, list[str]] = {nid: [] for nid in prompt}
    for nid, d in deps.items():
        for src in d:
            users[src].append(nid)
    ready = [nid for nid, k in indeg.items() if k == 0]
    while ready:
        nid = ready.pop()
        for u in users[nid]:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    stuck = [nid for nid, k in indeg.items() if k > 0]
    in_cycle = []
    for start in stuck:
        seen, stack = set(), list(deps[start])
        while stack:
            nid = stack.pop()
            if nid == start:
                in_cycle.append(start)
                break
            if nid not in seen:
                seen.add(nid)
                stack.extend(deps[nid])
    return in_cycle


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
                errors.append({"type": "required_input_missing", "message": "Required input is missing",
                               "details": name, "extra_info": {"input_name": name}})
            continue
        val = inputs[name]
        if _is_link(val):
            if len(val) != 2:
                errors.append({"type": "bad_linked_input",
                               "message": "Bad linked input, must be a length-2 list of [node_id, slot_index]",
                               "details": name,
                               "extra_info": {"input_name": name, "input_config": info, "received_value": val}})
                continue
            src_id, slot = str(val[0]), val[1]
            if src_id not in prompt:
                errors.append({"type": "bad_linked_input",
                               "message": f"Linked node {src_id} does not exist",
                               "details": f"{name} <- node {src_id}",
                               "extra_info": {"input_name": name, "input_config": info, "linked_node": val}})
                continue
            src_types = tuple(node_classes[prompt[src_id]["class_type"]].RETURN_TYPES)
            if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < len(src_types):
                errors.append({"type": "bad_linked_input",
                               "message": f"Linked node {src_id} ({prompt[src_id]['class_type']}) has no "
                                          f"output {slot!r} (it has {len(src_types)})",
                               "details": f"{name} <- node {src_id} output {slot!r}",
                               "extra_info": {"input_name": name, "input_config": info, "linked_node": val}})
                continue
            received = src_types[slot]
            received_types[name] = received
            if "input_types" not in fn_args and not types_compatible(received, input_type):
                errors.append({"type": "return_type_mismatch",
                               "message": "Return type mismatch between linked nodes",
                               "details": f"{name}, received_type({received}) mismatch input_type({input_type})",
                               "extra_info": {"input_name": name, "input_config": info,
                                              "received_type": received, "linked_node": val}})
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
            errors.append({"type": "invalid_input_type",
                           "message": f"Input of type {input_type} must be linked to a node output, "
                                      f"got a literal value",
                           "details": f"{name}, {val!r}",
                           "extra_info": {"input_name": name, "input_config": info, "received_value": val}})
            continue
        try:
            val = _convert_literal(input_type, val)
            inputs[name] = val
        except (TypeError, ValueError) as ex:
            errors.append({"type": "invalid_input_type",
                           "message": f"Failed to convert an input value to a {input_type} value",
                           "details": f"{name}, {val!r}, {ex}",
                           "extra_info": {"input_name": name, "input_config": info,
                                          "received_value": val, "exception_message": str(ex)}})
            continue
        if name in fn_args or fn_kwargs:
            continue  # the node validates this input itself (ComfyUI's rule)
        if "min" in opts and val < opts["min"]:
            errors.append({"type": "value_smaller_than_min",
                           "message": f"Value {val} smaller than min of {opts['min']}", "details": name,
                           "extra_info": {"input_name": name, "input_config": info, "received_value": val}})
            continue
        if "max" in opts and val > opts["max"]:
            errors.append({"type": "value_bigger_than_max",
                           "message": f"Value {val} bigger than max of {opts['max']}", "details": name,
                           "extra_info": {"input_name": name, "input_config": info, "received_value": val}})
            continue
        if isinstance(input_type, (list, tuple)) and val not in input_type:
            shown = f"(list of length {len(input_type)})" if len(input_type) > 20 else str(list(input_type))
            errors.append({"type": "value_not_in_list", "message": "Value not in list",
                           "details": f"{name}: '{val}' not in {shown}",
                           "extra_info": {"input_name": name,
                                          "input_config": None if len(input_type) > 20 else info,
                                          "received_value": val}})
            continue

    # Like ComfyUI, the node's own check runs when a built-in check failed on another input
    # (two mistakes, two errors), and its answer is attached to every input it declares.
    # Unlike ComfyUI, it is not called with an input that already has an error (missing,
    # wrong type): that mistake is reported once.
    flagged = {e["extra_info"].get("input_name") for e in errors}
    if validate_fn is not None and (fn_args or fn_kwargs) and not (flagged & set(fn_args)) \
            and not (fn_kwargs and errors):
        call_args = {k: v for k, v in inputs.items()
                     if not _is_link(v) and (k in fn_args or fn_kwargs)}
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
                errors.append({"type": "custom_validation_failed",
                               "message": "Custom validation failed for node",
                               "details": details, "extra_info": {"input_name": name}})

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


# ---------------------------------------------------------------------------
# execution
# ---------------------------------------------------------------------------
def execute_prompt(prompt: Mapping[str, Any], node_classes: NodeClasses, *,
                   extra_pnginfo: dict | None = None, output_dir: str | os.PathLike | None = None,
                   folders: folder_paths.ModelFolders | None = None,
                   on_node_start: Callable[[str, str], None] | None = None,
                   unet_dtype: str | None = None) -> ExecutionResult:
    """Validate and run `prompt`. Raises PromptValidationError, NodeExecutionError,
    or InterruptProcessingException (interrupt requested while running).

    unet_dtype: the host's weight dtype for this run ("fp32", "bf16", "fp16"; see
    `options`); None: the one in effect, by default $LORA_RUNTIME_UNET_DTYPE or fp32."""
    base = folders or folder_paths.active_folders()
    run_folders = base.with_output_directory(output_dir) if output_dir is not None else base
    with folder_paths.activated(run_folders), options.using(unet_dtype=unet_dtype):
        work = copy.deepcopy(dict(prompt))
        ok, error, outputs, node_errors = _validate(work, node_classes)
        if not ok or node_errors:
            raise PromptValidationError(error, node_errors)
        # What the hidden PROMPT input receives (SaveImage stores it in the PNG):
        # the validated prompt, literals converted, as ComfyUI passes it.
        original = copy.deepcopy(work)
        order = _execution_order(work, outputs)
        log.info("executing %d nodes: %s", len(order), ", ".join(order))
        results: dict[str, tuple] = {}
        ui: dict[str, dict] = {}
        for node_id in order:
            throw_exception_if_processing_interrupted()
            node = work[node_id]
            class_type = node["class_type"]
            if on_node_start is not None:
                on_node_start(node_id, class_type)
            with executing_node(node_id):
                out, node_ui = _run_node(node_id, node, node_classes[class_type], results,
                                         original, extra_pnginfo)
            results[node_id] = out
            if node_ui is not None:
                ui[node_id] = node_ui
    return ExecutionResult(outputs=results, ui=ui, executed=order,
                           output_dir=run_folders.get_output_directory())


def _execution_order(prompt: dict, outputs: list[str]) -> list[str]:
    """Topological order of the nodes the outputs need (dependencies first, stable)."""
    order: list[str] = []
    done: set[str] = set()
    for out_id in outputs:
        stack: list[tuple[str, bool]] = [(out_id, False)]
        while stack:
            nid, expanded = stack.pop()
            if nid in done:
                continue
            if expanded:
                done.add(nid)
                order.append(nid)
                continue
            stack.append((nid, True))
            # Reversed so the first-declared input runs first.
            for _, v in reversed(_links(prompt[nid])):
                if str(v[0]) not in done:
                    stack.append((str(v[0]), False))
    return order


def _run_node(node_id: str, node: dict, cls: type, results: dict[str, tuple],
              prompt: dict, extra_pnginfo: dict | None) -> tuple[tuple, dict | None]:
    class_type = node["class_type"]
    try:
        if getattr(cls, "INPUT_IS_LIST", False) or any(getattr(cls, "OUTPUT_IS_LIST", ()) or ()):
            raise NotImplementedError("INPUT_IS_LIST / OUTPUT_IS_LIST nodes are not supported "
                                      "by the bundled host")
        kwargs: dict[str, Any] = {}
        for name, val in node["inputs"].items():
            kwargs[name] = results[str(val[0])][val[1]] if _is_link(val) else val
        class_inputs = cls.INPUT_TYPES()
        declared = set(class_inputs.get("required") or {}) | set(class_inputs.get("optional") or {})
        kwargs = {k: v for k, v in kwargs.items() if k in declared}  # ComfyUI ignores extras
        for name, kind in (class_inputs.get("hidden") or {}).items():
            kind = kind[0] if isinstance(kind, (tuple, list)) else kind
            if kind == "PROMPT":
                kwargs[name] = prompt
            elif kind == "EXTRA_PNGINFO":
                kwargs[name] = extra_pnginfo
            elif kind == "UNIQUE_ID":
                kwargs[name] = node_id
            else:
                kwargs[name] = None
        obj = cls()
        fn = getattr(obj, cls.FUNCTION)
        raw = fn(**kwargs)
        return _split_result(cls, raw)
    except InterruptProcessingException:
        raise
    except Exception as ex:
        log.debug("node %s (%s) raised", node_id, class_type, exc_info=True)
        raise NodeExecutionError(node_id, class_type, ex) from ex


def _split_result(cls: type, raw: Any) -> tuple[tuple, dict | None]:
    return_types = tuple(getattr(cls, "RETURN_TYPES", ()))
    node_ui = None
    if isinstance(raw, dict):
        node_ui = raw.get("ui")
        raw = raw.get("result", ())
    if raw is None:
        raw = ()
    if not isinstance(raw, (tuple, list)):
        raise TypeError(f"{cls.__name__}.{cls.FUNCTION} returned {type(raw).__name__}; "
                        f"a node must return a tuple (or a dict with 'ui'/'result')")
    out = tuple(raw)
    if len(out) < len(return_types):
        raise TypeError(f"{cls.__name__}.{cls.FUNCTION} returned {len(out)} values but "
                        f"RETURN_TYPES declares {len(return_types)} {return_types}")
    return out, node_ui
