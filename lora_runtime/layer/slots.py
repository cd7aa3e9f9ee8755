"""One adapter on one layer: its update, strength, enabled flag and merge state.

Contract
- `AdapterSlot` is what an adapted layer keeps per adapter, in insertion order; the layer
  changes it only through its slot setters (so its derived caches are dropped).
- `contributes`: enabled with a non-zero strength; `factor`: the update's scale times the
  strength (no runtime scale), a python float product (`scaling.combined_factor`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..scaling import combined_factor
from ..updates import Update

if TYPE_CHECKING:
    from ..files.layer_adapter import LayerAdapter


@dataclass
class AdapterSlot:
    name: str
    layer: "LayerAdapter"
    strength: float = 1.0
    enabled: bool = True
    merged: bool = False
    content_hash: str = ""
    frozen_delta: torch.Tensor | None = field(default=None, repr=False)  # weight-dependent delta while merged

    @property
    def update(self) -> Update:
        return self.layer.update

    @property
    def contributes(self) -> bool:
        return self.enabled and self.strength != 0.0

    @property
    def stackable(self) -> bool:
        """Does the update answer `stack()` (one low-rank pair a stacked GEMM or fused kernel takes)?"""
        return self.layer.update.stack() is not None

    @property
    def has_weight_delta(self) -> bool:
        return self.layer.update.has_weight_delta

    @property
    def factor(self) -> float:
        """The update's scale times this slot's strength (no runtime scale)."""
        return combined_factor(self.layer.update.scale, self.strength)
