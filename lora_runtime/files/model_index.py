"""The per-model index: every name a model's modules and parameters have in any naming of
its family, with the rows of the native weight each name covers."""
from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from .family_tables import FAMILY_MARKS, FAMILY_TABLES, N, whole

@dataclass(frozen=True)
class Entry:
    native: str
    rows: object          # None, (start, stop) or "swap"
    naming: str
    param: bool


def weight_shape(mod: nn.Module) -> tuple[int, ...] | None:
    """[out, in, ...] of the module's weight; a Linear's own in/out_features first (a
    quantized weight's storage shape need not be its logical shape)."""
    o, i = getattr(mod, "out_features", None), getattr(mod, "in_features", None)
    if isinstance(o, int) and isinstance(i, int):
        return (o, i)
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor):
        base = getattr(mod, "base_layer", None)
        w = getattr(base, "weight", None) if base is not None else None
    return tuple(w.shape) if isinstance(w, torch.Tensor) and w.dim() >= 2 else None


def model_family(modules: Mapping[str, nn.Module]) -> str | None:
    for family, mark in FAMILY_MARKS:
        if any(mark.search(n) for n in modules):
            return family
    return None


class ModelIndex:
    def __init__(self, modules: Mapping[str, nn.Module], family: str | None = None):
        # the host's word (ComfyUI's model class) first; the module names only without one
        self.family = (family or None) if family is not None else model_family(modules)
        self.names: dict[str, list[Entry]] = {}
        self.shared: set[str] = set()   # native names no other naming of the family renames
        natives: dict[str, tuple[nn.Module | None, bool]] = {}
        for name, mod in modules.items():
            if not name or name.endswith(".base_layer"):
                continue
            natives[name] = (mod, False)
        for name, mod in modules.items():
            if name.endswith(".base_layer") or ".base_layer." in name:
                continue
            for pname, p in getattr(mod, "_parameters", {}).items():
                if p is None or pname in ("weight", "bias"):
                    continue
                full = f"{name}.{pname}" if name else pname
                natives.setdefault(full, (None, True))
        for name, (mod, is_param) in natives.items():
            self.names.setdefault(name, []).append(Entry(name, None, N, is_param))
        table = FAMILY_TABLES.get(self.family, [])
        compiled = [(re.compile(pat), alts) for pat, alts in table]
        for name, (mod, is_param) in natives.items():
            self.shared.add(name)
            for rx, alts in compiled:
                m = rx.fullmatch(name)
                if not m:
                    continue
                shape = weight_shape(mod) if mod is not None else None
                for naming, template, rule in alts:
                    if rule is whole:
                        rows = None
                    elif shape is None:
                        continue
                    else:
                        rows = rule(shape)
                        if rows is False:
                            continue
                    alias = template.format(*m.groups())
                    self.names.setdefault(alias, []).append(Entry(name, rows, naming, is_param))
                    self.shared.discard(name)
                break
        self.flat: dict[str, list[str]] = {}
        for name in self.names:
            self.flat.setdefault(name.replace(".", "_"), []).append(name)

    def entries(self, body: str, underscore: bool) -> list[Entry]:
        if underscore:
            out: list[Entry] = []
            for name in self.flat.get(body, []):
                out += self.names[name]
            return out
        return list(self.names.get(body, []))


# A few recent indexes, keyed by the mapping's first and last module (weakly: a cached
# index never keeps a model alive) and its length; a fresh dict(model.named_modules())
# of the same model finds its index again.
_CACHE: list[tuple[weakref.ref, weakref.ref, int, str | None, ModelIndex]] = []


def model_index(modules: Mapping[str, nn.Module], family: str | None = None) -> ModelIndex:
    """The index of these modules; ``family``: the host's family for the model ('' = none of the
    tables), None = read it from the module names (`model_family`)."""
    if not modules:
        return ModelIndex(modules, family)
    values = list(modules.values()) if not isinstance(modules, dict) else None
    first = values[0] if values is not None else next(iter(modules.values()))
    last = values[-1] if values is not None else next(reversed(modules.values()))
    for a, b, n, fam, idx in _CACHE:
        if a() is first and b() is last and n == len(modules) and fam == family:
            return idx
    idx = ModelIndex(modules, family)
    try:
        _CACHE.insert(0, (weakref.ref(first), weakref.ref(last), len(modules), family, idx))
        del _CACHE[4:]
    except TypeError:   # not weak-referenceable: no caching
        pass
    return idx

