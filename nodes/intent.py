"""What our nodes record on a MODEL clone: plain data only, never tensors.

Stored under ``model_options["lora_runtime"]`` (ComfyUI deep-copies model_options on
clone, so each branch of a graph keeps its own intent and nothing leaks upstream):

    {"adapters": [{"name", "path", "strength"}...], "mode": "auto", "tier": "lossless"}
"""
from __future__ import annotations

import copy

from ..lora_runtime.settings import DEFAULT_MERGE_MODE, DEFAULT_TIER

KEY = "lora_runtime"


def read(model) -> dict:
    intent = (getattr(model, "model_options", None) or {}).get(KEY) or {}
    return {
        "adapters": list(intent.get("adapters", [])),
        "mode": intent.get("mode", DEFAULT_MERGE_MODE.value),
        "tier": intent.get("tier", DEFAULT_TIER.value),
    }


def with_changes(model, **changes):
    """A clone of `model` whose intent has `changes` applied; `model` is untouched."""
    clone = model.clone()
    intent = copy.deepcopy(read(model))
    intent.update(changes)
    clone.model_options[KEY] = intent
    return clone
