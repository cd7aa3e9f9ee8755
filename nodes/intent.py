"""Where our nodes keep their intent: ``model_options["lora_runtime"]`` of a MODEL clone.

The value is the engine's `Intent` (frozen, typed, no tensors). ComfyUI copies model_options
on clone (0.3.64 deep-copies it, newer versions copy dicts/lists and share other objects: an
immutable Intent is safe under both), so each branch of a graph keeps its own intent and
nothing leaks upstream. The sampling wrapper (`lifecycle`) reads it from the patcher it samples.
"""
from __future__ import annotations

from dataclasses import replace

from ..lora_runtime.intent import Intent

KEY = "lora_runtime"


def read(model) -> Intent:
    found = (getattr(model, "model_options", None) or {}).get(KEY)
    if found is None:
        return Intent()
    if not isinstance(found, Intent):
        raise TypeError(f"model_options[{KEY!r}] holds a {type(found).__name__}, not a LoRA runtime Intent; "
                        "another node wrote to this key")
    return found


def with_changes(model, **changes) -> "object":
    """A clone of `model` whose intent has `changes` applied (text settings parsed by `Intent`)
    and whose sampling runs the LoRA runtime (see lifecycle.register); `model` is untouched."""
    from .lifecycle import register  # the wrapper needs this module

    new = replace(read(model), **changes)  # a bad setting raises here, before anything is cloned
    clone = model.clone()
    clone.model_options[KEY] = new
    register(clone)
    return clone
