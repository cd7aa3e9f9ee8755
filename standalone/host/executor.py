"""Graph executor for API-format prompts (the bundled host's stand-in for ComfyUI's execution.py).

A prompt is {node_id: {"class_type": str, "inputs": {name: value | [src_id, slot]}}}.
`execute_prompt` validates it (`validation`), runs the nodes the OUTPUT_NODEs need in
topological order and returns an `ExecutionResult`. Unlike the ComfyUI server, which runs
whichever outputs validated, it refuses a prompt with any node error (a headless run should
not silently drop half its outputs).

Node classes follow ComfyUI's v1 node API: INPUT_TYPES() (required / optional / hidden),
RETURN_TYPES, FUNCTION, OUTPUT_NODE, optional VALIDATE_INPUTS. Per-call list mapping
(INPUT_IS_LIST / OUTPUT_IS_LIST) and node expansion are not supported.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
from typing import Any, Callable, Mapping

from . import folder_paths, options
from .progress import (InterruptProcessingException, executing_node,
                       throw_exception_if_processing_interrupted)
from .prompt_graph import execution_order, is_link
from .validation import NodeClasses, PromptValidationError, validate

log = logging.getLogger(__name__)


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
        ok, error, outputs, node_errors = validate(work, node_classes)
        if not ok or node_errors:
            raise PromptValidationError(error, node_errors)
        # What the hidden PROMPT input receives (SaveImage stores it in the PNG):
        # the validated prompt, literals converted, as ComfyUI passes it.
        original = copy.deepcopy(work)
        order = execution_order(work, outputs)
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


def _run_node(node_id: str, node: dict, cls: type, results: dict[str, tuple],
              prompt: dict, extra_pnginfo: dict | None) -> tuple[tuple, dict | None]:
    class_type = node["class_type"]
    try:
        if getattr(cls, "INPUT_IS_LIST", False) or any(getattr(cls, "OUTPUT_IS_LIST", ()) or ()):
            raise NotImplementedError("INPUT_IS_LIST / OUTPUT_IS_LIST nodes are not supported "
                                      "by the bundled host")
        kwargs: dict[str, Any] = {}
        for name, val in node["inputs"].items():
            kwargs[name] = results[str(val[0])][val[1]] if is_link(val) else val
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
