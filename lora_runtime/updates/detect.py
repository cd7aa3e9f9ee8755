"""`detect`: the one update a layer's key parts describe, built from the registered types."""
from __future__ import annotations

from typing import Mapping

from torch import Tensor

from ..errors import AdapterFormatError
from .base import Update
from .full import BiasOnly
from .registry import REFUSED_WHY, UPDATE_TYPES, classify_part


def detect(parts: Mapping[str, Tensor], alpha: float | None = None, *, stem: str = "", rslora: bool = False,
           comfy_quirk: bool = False, eps: float | None = None, expect: type[Update] | None = None) -> Update:
    """Pick and build the update the key parts describe.

    `alpha` wins over an ``alpha`` part. `rslora` applies to LoRA only; `comfy_quirk`
    and `eps` to DoRA only. Refused types raise NotImplementedError naming the key; unknown
    parts, two names for one role, an incomplete type or two types on one layer raise
    `AdapterFormatError`. `expect`: the keys must describe that type (or a subclass).
    """
    v = _detect(parts, alpha, stem=stem, rslora=rslora, comfy_quirk=comfy_quirk, eps=eps)
    if expect is not None and expect is not Update and not isinstance(v, expect):
        raise AdapterFormatError(f"{v.stem}: the keys {sorted(parts)} describe a {type(v).__name__}, "
                                 f"not a {expect.__name__}")
    return v


def _detect(parts, alpha, *, stem, rslora, comfy_quirk, eps) -> Update:
    stem = stem or "<layer>"
    roles, names = _roles(parts, stem)
    if "alpha" in roles:
        a = roles.pop("alpha")
        if alpha is None:
            if isinstance(a, Tensor) and a.numel() != 1:
                raise AdapterFormatError(f"{stem}.{names['alpha']}: alpha must be a scalar, "
                                         f"got shape {tuple(a.shape)}")
            alpha = float(a.item() if isinstance(a, Tensor) else a)
    wrapper, wrapped_by = _wrapper(roles)
    diff_b = roles.pop("diff_b", None)

    types = [cls for cls in UPDATE_TYPES if not cls.wraps]
    claimed = {cls: [r for r in roles if cls.claims(r)] for cls in types}
    present = [cls for cls, rs in claimed.items() if rs]
    if len(present) > 1:
        raise AdapterFormatError(
            f"{stem}: keys of several adapter types on one layer ({', '.join(c.label for c in present)}: "
            f"{sorted(names[r] for c in present for r in claimed[c])}); save one type per layer")
    if not present:
        if wrapper is not None:
            raise AdapterFormatError(f"{stem}: {names[wrapper.ROLES[0]]} {wrapper.alone_refusal}")
        if diff_b is not None:
            return BiasOnly(diff_b, alpha, stem=stem)
        raise AdapterFormatError(f"{stem}: no adapter weights among {sorted(parts)}")

    cls = present[0]
    if wrapper is not None and not cls.takes_dora:
        raise AdapterFormatError(f"{stem}: {names[wrapper.ROLES[0]]} {cls.dora_refusal}")
    v = cls.from_roles(roles, names, alpha, stem=stem, diff_b=diff_b, rslora=rslora)
    if wrapper is not None:
        return wrapper(v, wrapped_by, stem=stem, comfy_quirk=comfy_quirk, eps=eps, diff_b=diff_b)
    if diff_b is not None and v.diff_b is None:
        v.diff_b = diff_b.reshape(-1)
        v.check_bias()
    return v


def _roles(parts, stem) -> tuple[dict[str, Tensor], dict[str, str]]:
    """role -> tensor and role -> key part; refused and unknown parts raise."""
    roles: dict[str, Tensor] = {}
    names: dict[str, str] = {}
    for part, t in parts.items():
        if part in REFUSED_WHY:
            raise NotImplementedError(f"{stem}.{part}: {REFUSED_WHY[part]} is not supported")
        role = classify_part(part)
        if role is None:
            raise AdapterFormatError(f"{stem}.{part}: unknown adapter key part")
        if role in roles:
            raise AdapterFormatError(f"{stem}: {names[role]!r} and {part!r} both give the {role!r} tensor")
        roles[role], names[role] = t, part
    return roles, names


def _wrapper(roles: dict) -> tuple[type[Update] | None, Tensor | None]:
    """The wrapping type whose role is among `roles` (popped), and its tensor."""
    for cls in UPDATE_TYPES:
        if cls.wraps and cls.ROLES[0] in roles:
            return cls, roles.pop(cls.ROLES[0])
    return None, None
