"""LoRA Stack: several adapters in one node, each row with on/off, strength, schedule and branch.

The rows travel as one JSON STRING input, ``rows``: a list of objects
``{"on": true, "lora": "style.safetensors", "strength": 1.0, "schedule": "", "branch": "both",
"blocks": ""}``
(every key but ``lora`` optional, unknown keys an error). The editor extension
(web/lora_stack.js) draws one line of widgets per row with add / remove buttons and
writes this JSON; API prompts and the command line set it directly.

Each row that is on is applied exactly as a Load LoRA Adapter node with the same inputs
(that node's own validation and `load`, in row order), so a stack emits the same Intent as
the chain of loaders and samples to the same result. Rows that are off are left out, as a
loader that is not in the chain. The node shows each row's coverage.
"""
from __future__ import annotations

import json

from . import host
from ..lora_runtime import LoraRuntimeError
from ..lora_runtime.block_filter import parse_blocks
from ..lora_runtime.layer.schedule import BRANCH_CHOICES, parse_schedule
from ..lora_runtime.settings import STRENGTH_MAX, STRENGTH_MIN, in_strength_range
from .lora_nodes import CATEGORY, UNMATCHED_CHOICES, UNMATCHED_DEFAULT, LoadLoraAdapter, lora_fingerprint

ROW_KEYS = ("on", "lora", "strength", "schedule", "branch", "blocks")
NODE = "LoRA Stack"


def parse_rows(text) -> list[dict]:
    """The ``rows`` JSON as a list of complete rows (defaults filled in); LoraRuntimeError
    naming the row and the fix when it is not of that form. Does not look at files."""
    if isinstance(text, list):
        raw = text
    else:
        try:
            raw = json.loads(text) if str(text).strip() else []
        except ValueError as e:
            raise LoraRuntimeError(f"{NODE}: rows is not JSON ({e}); expected a list like "
                                   '[{"on": true, "lora": "x.safetensors", "strength": 1.0}]') from None
    if not isinstance(raw, list):
        raise LoraRuntimeError(f"{NODE}: rows must be a JSON list of rows, got {type(raw).__name__}")
    rows = []
    for i, r in enumerate(raw, 1):
        where = f"{NODE} row {i}"
        if not isinstance(r, dict):
            raise LoraRuntimeError(f"{where}: a row is an object with keys {', '.join(ROW_KEYS)}, got {r!r}")
        unknown = sorted(set(r) - set(ROW_KEYS))
        if unknown:
            raise LoraRuntimeError(f"{where}: unknown key(s) {', '.join(unknown)}; a row has {', '.join(ROW_KEYS)}")
        on = r.get("on", True)
        if not isinstance(on, bool):
            raise LoraRuntimeError(f"{where}: on must be true or false, got {on!r}")
        lora = r.get("lora")
        if not isinstance(lora, str) or not lora.strip():
            raise LoraRuntimeError(f"{where}: pick a LoRA file (lora is {lora!r})")
        strength = r.get("strength", 1.0)
        if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not in_strength_range(strength):
            raise LoraRuntimeError(f"{where} ({lora}): strength {strength!r} is not a number in "
                                   f"[{STRENGTH_MIN}, {STRENGTH_MAX}]")
        schedule = r.get("schedule", "")
        if not isinstance(schedule, str):
            raise LoraRuntimeError(f"{where} ({lora}): schedule must be text like '0:1, 0.5:0', got {schedule!r}")
        branch = r.get("branch", BRANCH_CHOICES[0])
        if branch not in BRANCH_CHOICES:
            raise LoraRuntimeError(f"{where} ({lora}): branch {branch!r}: use one of {', '.join(BRANCH_CHOICES)}")
        blocks = r.get("blocks", "")
        if not isinstance(blocks, str):
            raise LoraRuntimeError(f"{where} ({lora}): blocks must be text like '0-9: 0.5, !cross_attn', got {blocks!r}")
        rows.append({"on": on, "lora": lora, "strength": float(strength), "schedule": schedule, "branch": branch,
                     "blocks": blocks})
    return rows


def active(row: dict) -> bool:
    """Whether a row is applied (on); a row at strength 0 is applied as a loader at 0 would be."""
    return row["on"]


class LoraStack:
    # the report on the node comes back on a fully cached re-run too (ComfyUI 0.33+ re-sends the
    # cached UI of such nodes)
    HAS_INTERMEDIATE_OUTPUT = True
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The diffusion model the adapters are for. It is cloned, never changed."}),
            "rows": ("STRING", {
                "default": "[]", "multiline": True,
                # the editor extension reads these to draw a row's choices
                "lora_names": host.lora_names(), "branch_choices": list(BRANCH_CHOICES),
                "tooltip": "The adapters, one row each, applied in order as chained Load LoRA Adapter nodes. "
                           'As text: a JSON list of rows like {"lora": "x.safetensors", "strength": 1.0}.'}),
        }, "optional": {
            "unmatched_keys": (list(UNMATCHED_CHOICES), {
                "default": UNMATCHED_DEFAULT,
                "tooltip": "For every row: error stops the run on a key with no layer; skip and report applies "
                           "the rest and lists the skipped keys."}),
        }}

    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The model with the rows' adapters added; any sampler that samples it applies them.",)
    FUNCTION = "load"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Several LoRA adapters in one node, each row with on/off, strength, optional schedule and "
                   "branch. The same result as chaining one Load LoRA Adapter per row that is on.")

    @classmethod
    def VALIDATE_INPUTS(cls, rows):
        # Checked when the prompt is queued: the rows' form, then each row that is on exactly
        # as a Load LoRA Adapter checks its file (name, header), and each row's schedule and branch.
        try:
            parsed = parse_rows(rows)
        except LoraRuntimeError as e:
            return str(e)
        for i, r in enumerate(parsed, 1):
            if not active(r):
                continue
            ok = LoadLoraAdapter.VALIDATE_INPUTS(lora_name=r["lora"])
            if ok is not True:
                return f"{NODE} row {i} ({r['lora']}): {ok}"
            try:  # the schedule's and blocks' form: every row lives in this one input, so their errors are its
                parse_schedule(r["schedule"], where=f"{NODE} row {i} ({r['lora']})")
                parse_blocks(r["blocks"], where=f"{NODE} row {i} ({r['lora']})")
            except LoraRuntimeError as e:
                return str(e)
        return True

    @classmethod
    def IS_CHANGED(cls, rows, **_):
        # the content of every row's file that is on (see LoadLoraAdapter.IS_CHANGED)
        try:
            parsed = parse_rows(rows)
        except LoraRuntimeError as e:
            return str(e)
        return "|".join(lora_fingerprint(r["lora"]) for r in parsed if active(r))

    def load(self, model, rows, unmatched_keys=UNMATCHED_DEFAULT):
        parsed = parse_rows(rows)
        coverage = []
        loader = LoadLoraAdapter()
        for i, r in enumerate(parsed, 1):
            if not active(r):
                continue
            try:
                out = loader.load(model, r["lora"], r["strength"], unmatched_keys=unmatched_keys,
                                  strength_schedule=r["schedule"], branch=r["branch"], blocks=r["blocks"])
            except (LoraRuntimeError, ValueError, FileNotFoundError) as e:
                raise LoraRuntimeError(f"{NODE} row {i} ({r['lora']}): {e}") from e
            model = out["result"][0]
            coverage += out["ui"]["lora_coverage"]
        if not coverage:  # every row off: the model as it came, still a clone (no node mutates its input)
            model = model.clone()
        return {"ui": {"lora_coverage": coverage}, "result": (model,)}


NODE_CLASS_MAPPINGS = {"LoraRuntimeStack": LoraStack}
NODE_DISPLAY_NAME_MAPPINGS = {"LoraRuntimeStack": "LoRA Stack"}
