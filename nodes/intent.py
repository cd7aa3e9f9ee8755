"""What our nodes record on a MODEL clone: typed, immutable, never tensors.

Stored under ``model_options["lora_runtime"]`` as an `Intent` (frozen dataclass; the
enums stay enums end to end). ComfyUI copies model_options on clone (0.3.64 deep-copies
it, newer versions copy dicts/lists and share other objects: an immutable Intent is
safe under both), so each branch of a graph keeps its own intent and nothing leaks
upstream. The sampling wrapper (`lifecycle`) reads it from the patcher it samples.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..lora_runtime import AdapterSpec
from ..lora_runtime.layer.schedule import Branch, Schedule
from ..lora_runtime.settings import (DEFAULT_MERGE_MODE, DEFAULT_RESTORE_MEMORY, DEFAULT_TIER, MergeMode, RestoreMemory,
                                     Tier)

KEY = "lora_runtime"


@dataclass(frozen=True)
class AdapterIntent:
    name: str       # the name the user picked (loras folder relative)
    path: str       # resolved absolute path
    strength: float
    lenient: bool = False  # "skip and report" keys that match nothing, instead of failing
    schedule: Schedule | None = None   # strength over the denoising (parsed by the node)
    branch: Branch = Branch.BOTH       # which CFG branch the adapter applies to
    content_hash: str = ""             # the content the node read: the sampler uses that, not whatever the file holds later

    def spec(self) -> AdapterSpec:
        return AdapterSpec(self.path, self.strength, self.name, lenient=self.lenient, schedule=self.schedule,
                           branch=self.branch, content_hash=self.content_hash)


@dataclass(frozen=True)
class Intent:
    adapters: tuple[AdapterIntent, ...] = ()
    mode: MergeMode = DEFAULT_MERGE_MODE
    tier: Tier = DEFAULT_TIER
    restore: RestoreMemory = DEFAULT_RESTORE_MEMORY   # what a merge keeps to restore the weights

    @property
    def touches_model(self) -> bool:
        """Whether sampling this model needs the runtime (adapters, or a non-default tier:
        `exact` keeps fusions off, `high` may mount them)."""
        return bool(self.adapters) or self.tier is not DEFAULT_TIER

    def specs(self) -> list[AdapterSpec]:
        return [a.spec() for a in self.adapters]


def read(model) -> Intent:
    found = (getattr(model, "model_options", None) or {}).get(KEY)
    if found is None:
        return Intent()
    if not isinstance(found, Intent):
        raise TypeError(f"model_options[{KEY!r}] holds a {type(found).__name__}, not a LoRA runtime Intent; "
                        "another node wrote to this key")
    return found


def with_changes(model, **changes) -> "object":
    """A clone of `model` whose intent has `changes` applied and whose sampling runs the
    LoRA runtime (see lifecycle.register); `model` is untouched."""
    from .lifecycle import register  # the wrapper needs this module

    clone = model.clone()
    clone.model_options[KEY] = replace(read(model), **changes)
    register(clone)
    return clone
