"""What a user asks of the engine, parsed and checked once, when it is built.

`AdapterSpec` is one adapter (file, strength, schedule, branch, block filter); `Intent` is
the adapters plus the merge mode, quality tier and restore memory of a run. Both are frozen,
hold no tensors, and take text or typed values: text is parsed on construction (ConfigError
naming the value), so everything past the constructor reads typed values only. The nodes
build them from their inputs; `plan` reads them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .block_filter import BlockFilter
from .scaling import combined_factor
from .layer.schedule import Branch, Schedule, parse_branch, varies
from .settings import (DEFAULT_MERGE_MODE, DEFAULT_RESTORE_MEMORY, DEFAULT_TIER, MergeMode, RestoreMemory, Tier,
                       check_strength, parse_merge_mode, parse_restore_memory, parse_tier)


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter as asked for; `strength` is checked against the strength range and `branch`
    parsed here (errors name `name`, else the file). A schedule that never changes (not 1.0, both
    branches) is folded into `strength` here, once: the spec then has no schedule."""

    path: str
    strength: float = 1.0
    name: str | None = None
    enabled: bool = True
    lenient: bool = False   # apply what matches and list the skipped keys, instead of failing
    schedule: Schedule | None = None   # strength over the steps (dynamic path only)
    branch: Branch = Branch.BOTH       # which CFG branch the adapter acts on
    content_hash: str = ""             # the content a loader already read (a sampler uses exactly that); '' = the file
    blocks: BlockFilter | None = None  # per-block strength and layers left out; None: every layer at `strength`
    clip: str = ""                     # what a model + CLIP loader did with the file's text-encoder layers

    def __post_init__(self):
        label = self.name or os.path.basename(self.path)
        object.__setattr__(self, "strength", check_strength(self.strength, what=f"strength of {label}"))
        object.__setattr__(self, "branch", parse_branch(self.branch, where=f"adapter {label}"))
        c = self.schedule.constant() if self.schedule is not None else None
        if c is not None and c != 1.0 and self.branch is Branch.BOTH:
            # a schedule that never changes is a strength (so auto may merge it); all 1.0 is kept and
            # runs through the scheduled path, where a unit factor is never multiplied
            object.__setattr__(self, "strength", check_strength(combined_factor(self.strength, c),
                                                                what=f"strength x schedule of {label}"))
            object.__setattr__(self, "schedule", None)

    @property
    def varies(self) -> str:
        """Why this adapter's strength is not constant over the run ('' when it is)."""
        return varies(self.schedule, self.branch)


@dataclass(frozen=True)
class Intent:
    """The adapters of a run (in order) and its settings; text settings are parsed here."""

    adapters: tuple[AdapterSpec, ...] = ()
    mode: MergeMode = DEFAULT_MERGE_MODE
    tier: Tier = DEFAULT_TIER
    restore: RestoreMemory = DEFAULT_RESTORE_MEMORY   # what a merge keeps to restore the weights

    def __post_init__(self):
        object.__setattr__(self, "adapters", tuple(self.adapters))
        object.__setattr__(self, "mode", parse_merge_mode(self.mode))
        object.__setattr__(self, "tier", parse_tier(self.tier))
        object.__setattr__(self, "restore", parse_restore_memory(self.restore))

    @property
    def touches_model(self) -> bool:
        """Whether running a model with this intent needs the runtime (adapters, or a non-default
        tier: `exact` keeps fusions off, `high` may mount them)."""
        return bool(self.adapters) or self.tier is not DEFAULT_TIER
