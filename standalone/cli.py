"""Command line: run a saved workflow on the bundled host, no ComfyUI needed.

    python -m comfyui_lora_runtime run WORKFLOW.json [--output DIR] [--models DIR]
                                      [--set NODE.INPUT=VALUE ...] [--bf16-unet]

--set changes the API prompt and, for a UI-format workflow, the same widget of the
workflow saved in the PNGs, so dropping a PNG into the editor reproduces its image.

Exit codes: 0 done, 2 bad workflow / validation failed / bad arguments,
1 a node failed while running, 130 interrupted (Ctrl-C).
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from typing import Any, Mapping, Sequence

from .host import folder_paths, progress
from .host.executor import NodeExecutionError, execute_prompt
from .host.validation import PromptValidationError, format_validation_errors, normalized_prompt
from .host.workflow_format import WorkflowFormatError, load_workflow, set_widget_value

log = logging.getLogger("comfyui_lora_runtime.cli")

EXIT_OK, EXIT_RUN_ERROR, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 130


def default_node_classes() -> dict[str, type]:
    """The bundled core nodes plus this pack's own nodes (the pack wins on a name clash)."""
    from .host.core_nodes import CORE_NODE_CLASS_MAPPINGS
    from .. import NODE_CLASS_MAPPINGS
    classes = dict(CORE_NODE_CLASS_MAPPINGS)
    for name in NODE_CLASS_MAPPINGS:
        if name in classes:
            log.warning("pack node %r replaces the bundled core node of the same name", name)
    classes.update(NODE_CLASS_MAPPINGS)
    return classes


class CliError(Exception):
    """A user error in the arguments or the workflow file (exit code 2)."""


def parse_set(item: str) -> tuple[str, str, Any]:
    """'NODE.INPUT=VALUE' -> (node, input, value); VALUE is JSON if it parses, else a string."""
    target, sep, raw = item.partition("=")
    node_id, dot, input_name = target.partition(".")
    if not sep or not dot or not node_id or not input_name:
        raise CliError(f"--set {item!r}: expected NODE.INPUT=VALUE (e.g. --set 5.seed=42)")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return node_id, input_name, value


def apply_overrides(prompt: dict, sets: Sequence[str], node_classes: Mapping[str, type]
                    ) -> list[tuple[str, str, str]]:
    """Apply --set items to the API prompt; returns [(item, node_id, input_name)] applied."""
    applied = []
    for item in sets:
        node_id, input_name, value = parse_set(item)
        node = prompt.get(node_id)
        if node is None:
            raise CliError(f"--set {item!r}: no node {node_id!r} in the workflow "
                           f"(node ids: {', '.join(prompt)})")
        cls = node_classes.get(node.get("class_type"))
        declared: list[str] = []
        if cls is not None:
            spec = cls.INPUT_TYPES()
            declared = list(spec.get("required") or {}) + list(spec.get("optional") or {})
        if input_name not in declared and input_name not in node.get("inputs", {}):
            raise CliError(f"--set {item!r}: node {node_id} ({node.get('class_type')}) has no input "
                           f"{input_name!r} (inputs: {', '.join(declared) or 'none'})")
        old = node.setdefault("inputs", {}).get(input_name)
        if isinstance(old, list):
            print(f"note: --set {item} replaces the link from node {old[0]}", file=sys.stderr)
        node["inputs"][input_name] = value
        applied.append((item, node_id, input_name))
    return applied


def apply_overrides_to_ui(ui_workflow: dict, applied: Sequence[tuple[str, str, str]], prompt: Mapping,
                          node_classes: Mapping[str, type]) -> None:
    """Write the --set values into the UI workflow as well (the value as validation converted
    it, `prompt` being the validated prompt), so the PNG's workflow and prompt chunks agree."""
    for item, node_id, input_name in applied:
        value = prompt[node_id]["inputs"][input_name]
        try:
            note = set_widget_value(ui_workflow, node_id, input_name, value, node_classes)
        except WorkflowFormatError as ex:
            raise CliError(f"--set {item!r}: cannot write it into the UI workflow saved with the images "
                           f"({ex}), so dropped into the editor they would not reproduce it. Override "
                           f"it in an API-format workflow (its PNGs carry no workflow) instead.") from None
        if note:
            print(f"note: --set {item}: in the saved workflow, {note}", file=sys.stderr)


class TextProgress:
    """Progress hook printing a bar on stderr (redrawn in place on a terminal)."""

    def __init__(self, stream=None, width: int = 30):
        self.stream = stream or sys.stderr
        self.width = width
        self.names: dict[str, str] = {}
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def node_started(self, node_id: str, class_type: str) -> None:
        self.names[node_id] = class_type
        print(f"[{node_id}] {class_type}", file=self.stream, flush=True)

    def __call__(self, value, total, preview=None, node_id=None) -> None:
        total = max(int(total), 1)
        filled = int(self.width * value / total)
        bar = "#" * filled + "." * (self.width - filled)
        label = f"[{node_id}] {self.names.get(node_id, '')}".rstrip()
        line = f"{label} |{bar}| {value}/{total}"
        if self.tty:
            end = "\n" if value >= total else ""
            print("\r" + line, end=end, file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)


def run(args: argparse.Namespace, node_classes: Mapping[str, type] | None = None, *,
        unet_dtype: str | None = None) -> int:
    """unet_dtype: the bundled host's weight dtype for this run (None: its default)."""
    folders = folder_paths.ModelFolders(models_dir=args.models, output_dir=args.output)
    with folder_paths.activated(folders):
        classes = dict(node_classes) if node_classes is not None else default_node_classes()
        try:
            prompt, ui_workflow = load_workflow(args.workflow, classes)
            applied = apply_overrides(prompt, args.set or [], classes)
        except (WorkflowFormatError, CliError) as ex:
            print(f"error: {ex}", file=sys.stderr)
            return EXIT_INVALID

        try:
            checked = normalized_prompt(prompt, classes)
        except PromptValidationError as ex:
            print(f"error: {args.workflow} failed validation:", file=sys.stderr)
            print(format_validation_errors(ex.error, ex.node_errors), file=sys.stderr)
            return EXIT_INVALID
        if ui_workflow is not None:
            try:
                apply_overrides_to_ui(ui_workflow, applied, checked, classes)
            except CliError as ex:
                print(f"error: {ex}", file=sys.stderr)
                return EXIT_INVALID

        bar = TextProgress()
        extra = {"workflow": ui_workflow} if ui_workflow is not None else None
        progress.interrupt_current_processing(False)
        previous_handler = _install_sigint()
        try:
            with progress.progress_hook(bar):
                result = execute_prompt(prompt, classes, extra_pnginfo=extra, folders=folders,
                                        on_node_start=bar.node_started, unet_dtype=unet_dtype)
        except NodeExecutionError as ex:
            print(f"error: node {ex.node_id} ({ex.class_type}) failed: {ex.exception_type}: "
                  f"{ex.exception_message}", file=sys.stderr)
            return EXIT_RUN_ERROR
        except PromptValidationError as ex:
            print(f"error: {ex}", file=sys.stderr)
            return EXIT_INVALID
        except (progress.InterruptProcessingException, KeyboardInterrupt):
            print("\ninterrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        finally:
            progress.interrupt_current_processing(False)
            if previous_handler is not None:
                signal.signal(signal.SIGINT, previous_handler)

    from ..nodes.report import text as report_text
    for node_id, ui in result.ui.items():
        for r in ui.get("lora_report", []):
            print(f"node {node_id}: " + report_text(r))
    files = result.saved_files()
    if files:
        print(f"saved {len(files)} image(s):")
        for f in files:
            print(f"  {f}")
    else:
        print(f"done; no images saved (outputs from nodes: {', '.join(result.ui) or 'none'})")
    return EXIT_OK


def _install_sigint():
    """First Ctrl-C: stop at the next check point (between nodes or sampler steps).
    Second: raise KeyboardInterrupt at once."""
    try:
        def handler(signum, frame):
            if progress.processing_interrupted():
                raise KeyboardInterrupt
            print("\ninterrupt requested; stopping at the next step (Ctrl-C again to abort now)",
                  file=sys.stderr)
            progress.interrupt_current_processing(True)
        return signal.signal(signal.SIGINT, handler)
    except ValueError:  # not in the main thread
        return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m comfyui_lora_runtime",
                                description="Run ComfyUI workflows on the bundled host (no ComfyUI needed).")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a workflow JSON (API or UI format)")
    r.add_argument("workflow", help="workflow JSON file (API format or UI format)")
    r.add_argument("--output", metavar="DIR", default=None,
                   help="output directory (default: $LORA_RUNTIME_OUTPUT_DIR or <pack>/output)")
    r.add_argument("--models", metavar="DIR", default=None,
                   help="models directory with diffusion_models/, loras/, ... "
                        "(default: $LORA_RUNTIME_MODELS_DIR or <pack>/standalone/models)")
    r.add_argument("--set", metavar="NODE.INPUT=VALUE", action="append", default=[],
                   help="override an input of a node (VALUE is parsed as JSON if possible); repeatable")
    r.add_argument("--bf16-unet", action="store_true",
                   help="store and run diffusion models in bfloat16 (as ComfyUI does on a GPU, or with its "
                        "--bf16-unet); default $LORA_RUNTIME_UNET_DTYPE, else float32, what ComfyUI "
                        "uses on the CPU")
    r.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    d = sub.add_parser("demo", help="the main job: run the embedded workflows under every merge mode and tier, "
                                    "write the images, a contact sheet and a table of decisions")
    d.add_argument("--output", metavar="DIR", default="output/demo", help="output directory (default output/demo)")
    d.add_argument("--steps", type=int, default=20,
                   help="sampler steps of the reference runs (default 20; the distilled runs use 4)")
    d.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return p


def main(argv: Sequence[str] | None = None, node_classes: Mapping[str, type] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        from .demo import run_demo
        return run_demo(args.output, steps=args.steps)
    if args.command != "run":
        return EXIT_INVALID
    try:
        return run(args, node_classes, unet_dtype="bf16" if args.bf16_unet else None)
    except KeyboardInterrupt:  # Ctrl-C outside the sampling loop (loading, validating)
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
