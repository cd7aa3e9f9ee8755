"""Update types: one file per type, registered by the plain list below.

`detect(parts, alpha)` gives each key part of a layer (the suffixes after its stem) to the type
that claims it, and builds the one type the layer's keys describe (wrapped in `DoRA` when a
magnitude is present). Adding a type: a file with an `Update` subclass that sets ``KEY_PARTS``,
``ROLES`` and ``from_roles``, and its name in `UPDATE_TYPES`. Accepted names: docs/engine.md.
"""
from __future__ import annotations

import re
from typing import Mapping

from torch import Tensor

from ..errors import AdapterFormatError
from .base import Update
from .dora import DoRA
from .full import BiasOnly, Full
from .loha import LoHa
from .lokr import LoKr
from .lora import LoRA
from .param_delta import ParamDelta, ParamPatch
from .sliced import Sliced

__all__ = ["Update", "LoRA", "LoHa", "LoKr", "Full", "BiasOnly", "DoRA", "Sliced", "ParamDelta", "ParamPatch",
           "UPDATE_TYPES", "detect", "classify_part"]

# The types a layer's keys may describe: exactly one per layer.
UPDATE_TYPES: list[type[Update]] = [LoRA, LoHa, LoKr, Full]

# Parts every layer may carry beside its type's: alpha (scale source), diff_b (output offset).
_COMMON_PARTS = ((re.compile(r"^(?:alpha|diff_b)$"), ""),)

_UNSUPPORTED: dict[str, str] = {
    "lora_mid.weight": "LoCon Tucker mid factor (convolutions only)",
    "oft_blocks": "OFT/BOFT", "oft_diag": "OFT", "rescale": "OFT/BOFT",
    "a1.weight": "GLoRA", "a2.weight": "GLoRA", "b1.weight": "GLoRA", "b2.weight": "GLoRA",
    "reshape_weight": "weight reshaping", "w_norm": "norm-layer diff", "b_norm": "norm-layer diff",
    "set_weight": "weight replacement ('set')",
}


def _key_parts():
    for cls in (*UPDATE_TYPES, DoRA):
        yield from cls.KEY_PARTS
    yield from _COMMON_PARTS


def classify_part(part: str) -> str | None:
    """The role of a key part: 'down', 'up', 'dora', or the canonical name (alpha,
    hada_*, lokr_*, diff, diff_b); None when unknown."""
    for pattern, role in _key_parts():
        if pattern.match(part):
            return role or part
    return None


def detect(parts: Mapping[str, Tensor], alpha: float | None = None, *, stem: str = "", rslora: bool = False,
           comfy_quirk: bool = False, eps: float | None = None) -> Update:
    """Pick and build the update the key parts describe.

    `alpha` wins over an ``alpha`` part. `rslora` applies to LoRA only; `comfy_quirk`
    and `eps` to DoRA only. Refused types raise NotImplementedError naming the key; unknown
    parts, two names for one role, an incomplete type or two types on one layer raise
    `AdapterFormatError`.
    """
    stem = stem or "<layer>"
    roles: dict[str, Tensor] = {}
    names: dict[str, str] = {}
    for part, t in parts.items():
        if part in _UNSUPPORTED:
            raise NotImplementedError(f"{stem}.{part}: {_UNSUPPORTED[part]} is not supported")
        role = classify_part(part)
        if role is None:
            raise AdapterFormatError(f"{stem}.{part}: unknown adapter key part")
        if role in roles:
            raise AdapterFormatError(f"{stem}: {names[role]!r} and {part!r} both give the {role!r} tensor")
        roles[role], names[role] = t, part

    if "alpha" in roles:
        a = roles.pop("alpha")
        if alpha is None:
            if isinstance(a, Tensor) and a.numel() != 1:
                raise AdapterFormatError(f"{stem}.{names['alpha']}: alpha must be a scalar, "
                                         f"got shape {tuple(a.shape)}")
            alpha = float(a.item() if isinstance(a, Tensor) else a)
    dora = roles.pop("dora", None)
    diff_b = roles.pop("diff_b", None)

    claimed = {cls: [r for r in roles if cls.claims(r)] for cls in UPDATE_TYPES}
    present = [cls for cls, rs in claimed.items() if rs]
    if len(present) > 1:
        raise AdapterFormatError(
            f"{stem}: keys of several adapter types on one layer ({', '.join(c.label for c in present)}: "
            f"{sorted(names[r] for c in present for r in claimed[c])}); save one type per layer")
    if not present:
        if dora is not None:
            raise AdapterFormatError(f"{stem}: {names['dora']} without LoRA/LoHa/LoKr weights")
        if diff_b is not None:
            return BiasOnly(diff_b, alpha, stem=stem)
        raise AdapterFormatError(f"{stem}: no adapter weights among {sorted(parts)}")

    cls = present[0]
    if dora is not None and not cls.takes_dora:
        raise AdapterFormatError(f"{stem}: {names['dora']} {cls.dora_refusal}")
    v = cls.from_roles(roles, names, alpha, stem=stem, diff_b=diff_b, rslora=rslora)
    if dora is not None:
        return DoRA(v, dora, stem=stem, comfy_quirk=comfy_quirk, eps=eps, diff_b=diff_b)
    if diff_b is not None and v.diff_b is None:
        v.diff_b = diff_b.reshape(-1)
        v._check_bias()
    return v
