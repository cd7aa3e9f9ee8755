"""Update types: one file per type, registered by the plain list `registry.UPDATE_TYPES`.

`detect(parts, alpha)` gives each key part of a layer (the suffixes after its stem) to the type
that claims it, and builds the one type the layer's keys describe (wrapped in a wrapping type
such as `DoRA` when its part is present). Adding a type: a file with an `Update` subclass that
sets ``FILE_KEYS``, ``KEY_PARTS``, ``ROLES``, ``FORMATS``, ``SUPPORTED`` and ``from_roles``, and
its name in `UPDATE_TYPES`. Accepted names: docs/engine.md.
"""
from __future__ import annotations

from .base import Update
from .detect import detect
from .dora import DoRA
from .full import BiasOnly, Full
from .loha import LoHa
from .lokr import LoKr
from .lora import LoRA
from .registry import UPDATE_TYPES, classify_part
from .sliced import Sliced

__all__ = ["Update", "LoRA", "LoHa", "LoKr", "Full", "BiasOnly", "DoRA", "Sliced", "UPDATE_TYPES", "detect",
           "classify_part", "row_slices"]


def row_slices(parts, out_features: int, *, stem: str = "") -> Update:
    """One update of a fused weight made of updates on its row slices (``(start, stop, update)``)."""
    return Sliced(parts, out_features, stem=stem)
