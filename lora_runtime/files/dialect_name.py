"""`dialect_name`: the dialect a file's stems are written in, with the model or from the names alone."""
from __future__ import annotations

import re
from collections import Counter
from typing import Iterable, Mapping

from torch import nn

from .dialect_table import DIALECTS, label, shared_naming
from .family_tables import FAMILY_TABLES, SHARED_NAMES, A, D, N, P, X
from .resolve import resolve_all
from .stem_prefix import split_prefix

def _text_patterns() -> list[tuple[str, str, re.Pattern, re.Pattern]]:
    """(family, naming, dotted regex, underscore regex) for every name in the tables."""
    out = []
    for family, table in FAMILY_TABLES.items():
        for pat, alts in table:
            out.append((family, N, pat))
            for naming, template, _ in alts:
                rx = re.escape(template)
                for k in range(4):
                    rx = rx.replace(re.escape("{%d}" % k), r"(\d+|attn[12]|img|txt|layers|noise_refiner|context_refiner)")
                out.append((family, naming, rx))
    return [(f, n, re.compile(p), re.compile(p.replace(r"\.", "_"))) for f, n, p in out]


_TEXT = _text_patterns()


def _text_matches(stem: str) -> tuple[str, set[tuple[str, str]]]:
    prefix, body, underscore = split_prefix(stem)
    hits = set()
    for family, naming, dotted, flat in _TEXT:
        if (flat if underscore else dotted).fullmatch(body):
            hits.add((family, naming))
    return prefix, hits


def dialect_name(stems: Iterable[str], modules: Mapping[str, nn.Module] | None = None, *,
                 family: str | None = None) -> str:
    """The dialect most of these stems are written in (a `DIALECTS` name).

    With the model's modules: the commonest label among the stems that resolve. Without
    (or when none resolves): read from the names alone, by the same family tables.
    ``family``: as in `resolve`."""
    stems = list(stems)
    if not stems:
        return "unknown"
    if modules is not None:
        labels = Counter(t.dialect for t in resolve_all(stems, modules, family=family).values()
                         if t is not None)
        marks = [d.name for d in DIALECTS if d.naming == A and d.name in labels]
        if marks:   # names only that naming has: they name the file (the rest is the usual names)
            return marks[0]
        if labels:
            return labels.most_common(1)[0][0]
    fam_votes: Counter = Counter()
    per_stem = []
    for s in stems:
        prefix, hits = _text_matches(s)
        per_stem.append((prefix, hits))
        for fam in {f for f, _ in hits}:
            fam_votes[fam] += 1
    prefixes = Counter(p for p, _ in per_stem)
    prefix = prefixes.most_common(1)[0][0]
    if not fam_votes:
        return label(None, N, prefix)
    family = max(FAMILY_TABLES, key=lambda f: fam_votes[f])   # ties: the table order (Flux first)
    naming_votes: Counter = Counter()
    for p, hits in per_stem:
        namings = {n for f, n in hits if f == family}
        if len(namings) == 1:
            naming_votes[next(iter(namings))] += 1
    namings = [n for n in (D, X, P) if naming_votes[n]]
    naming = max(namings, key=lambda n: naming_votes[n]) if namings else N
    if naming_votes[A]:   # names only that naming has: they name the file
        naming = A
    if naming == N and family in SHARED_NAMES and not namings:
        naming = shared_naming(family, prefix, None)
    return label(family, naming, prefix)
