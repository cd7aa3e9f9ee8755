"""`resolve`: where an adapter key's stem goes in a model (contract: `dialects`)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping

from torch import nn

from .dialect_table import label, shared_naming
from .family_tables import SHARED_NAMES, A, D, N, P, X
from .model_index import Entry, ModelIndex, model_index
from .stem_prefix import split_prefix

@dataclass(frozen=True)
class Target:
    module: str                          # ComfyUI native module (or parameter) name
    rows: tuple[int, int] | None         # output-row slice [start, stop) of its weight; None = whole
    dialect: str                         # DIALECTS name, e.g. "Flux diffusers"
    param: bool = False                  # module names an nn.Parameter, not a module
    swap_halves: bool = False            # adapter rows are the target's halves exchanged



def candidates(stem: str, idx: ModelIndex) -> tuple[str, list[Entry]]:
    prefix, body, underscore = split_prefix(stem)
    found = idx.entries(body, underscore)
    if not found and not underscore and body.startswith("model."):   # a bare "model." prefix, tried last
        found = idx.entries(body[len("model."):], False)
        prefix = prefix or "model."
    if not found and not underscore and "." not in body:             # a dotted path written with '_'
        found = idx.entries(body, True)
    return prefix, found


def _pick(found: list[Entry], prefer: str | None, prefix: str, family: str | None) -> Entry | None:
    if not found:
        return None
    targets = {(e.native, e.rows) for e in found}
    if len(targets) == 1:
        e = found[0]
        if family in SHARED_NAMES and all(x.naming == N for x in found):
            # a name both namings share: the prefix (or the file) says which it is
            return Entry(e.native, e.rows, shared_naming(family, prefix, prefer), e.param)
        if prefer:   # one target under several names (kohya's '_' for '.' of two namings): the file's
            e = next((x for x in found if x.naming == prefer), e)
        return e
    for naming in ((prefer,) if prefer else ()) + (N, D, X, P, A):
        hits = [e for e in found if e.naming == naming]
        if len({(e.native, e.rows) for e in hits}) == 1:
            return hits[0]
    return None   # ambiguous: refuse rather than guess


def resolve(stem: str, modules: Mapping[str, nn.Module], *, prefer: str | None = None,
            family: str | None = None) -> Target | None:
    """Where `stem` goes in the model whose ``named_modules()`` are `modules` (see the module doc).
    ``family``: the model's family as the host knows it (ComfyUI's model class), '' for none of
    the tables; None: read from the module names."""
    idx = model_index(modules, family)
    prefix, found = candidates(stem, idx)
    e = _pick(found, prefer, prefix, idx.family)
    if e is None:
        return None
    rows = e.rows if isinstance(e.rows, tuple) else None
    return Target(e.native, rows, label(idx.family, e.naming, prefix), e.param, e.rows == "swap")


def resolve_all(stems: Iterable[str], modules: Mapping[str, nn.Module], *,
                family: str | None = None) -> dict[str, Target | None]:
    """Resolve one file's stems in the naming the file as a whole uses: a name that two
    namings read differently (Wan diffusers ``norm2``) is read in the naming the file's
    unambiguous stems show. A name no other naming renames (Z-Image ``feed_forward.w1``)
    does not vote. ``family``: as in `resolve`."""
    stems = list(stems)
    idx = model_index(modules, family)
    votes: Counter = Counter()
    for s in stems:
        _, found = candidates(s, idx)
        namings = {e.naming for e in found}
        if len(namings) == 1 and not (namings == {N} and all(e.native in idx.shared for e in found)):
            votes[next(iter(namings))] += 1
    prefer = None
    others = {n: c for n, c in votes.items() if n != N}
    if others:
        best = max(others, key=others.get)
        if others[best] > votes.get(N, 0):
            prefer = best
    return {s: resolve(s, modules, prefer=prefer, family=family) for s in stems}


def overlaps(targets: Iterable[Target | None]) -> list[tuple[Target, Target]]:
    """Pairs of targets whose row ranges on one module intersect (whole-module targets
    overlap everything on that module)."""
    by_mod: dict[str, list[Target]] = {}
    for t in targets:
        if t is not None:
            by_mod.setdefault(t.module, []).append(t)
    out = []
    for ts in by_mod.values():
        for i, a in enumerate(ts):
            for b in ts[i + 1:]:
                if a.rows is None or b.rows is None or (a.rows[0] < b.rows[1] and b.rows[0] < a.rows[1]):
                    out.append((a, b))
    return out

