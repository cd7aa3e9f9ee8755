"""Block filters: a strength per transformer block or layer-name pattern, and layers left out.

Contract
- `parse_blocks(text, where=...)` reads the ``blocks`` text (syntax below); None when empty.
  A mistake raises ConfigError naming `where`, ``blocks``, the entry and the fix (one error,
  the first mistake).
- `BlockFilter.resolve(layer_names)` gives each layer of an adapter its block factor (a
  multiplier of the adapter's strength) and the layers left out. An entry that selects none of
  the adapter's layers is an error naming the blocks the adapter has; so is a filter that
  leaves every layer out. The factor is multiplied into the layer's strength by
  `scaling.layer_strength`, so it follows the factor rules of every tier.

Syntax (entries separated by ``,``, ``;`` or new lines)::

    0-9: 0.5            blocks 0 to 9 at 0.5 (a multiplier of the node's strength)
    double_blocks.0-18: 0.8   one block list of a model with several (Flux)
    cross_attn: 0.5     layers whose name contains "cross_attn"; * and ? are wildcards
    *: 0.5              every layer (later entries override earlier ones)
    !cross_attn         leave these layers out (wherever it stands)
    only 0-9            keep only the layers some "only" entry selects
    ffn: 0              strength 0 leaves the layer out, as "!" does

Layers no entry selects keep 1.0. The block of a layer is the number after the first
``…blocks.N`` / ``layers.N`` part of its name (``blocks.3.self_attn.q`` is block 3).
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from .errors import ConfigError
from .settings import STRENGTH_MAX, STRENGTH_MIN, in_strength_range

INPUT = "blocks"
_RANGE = re.compile(r"^(?:(?P<family>[A-Za-z_]*blocks|layers)\.)?(?P<lo>\d+)(?:\s*-\s*(?P<hi>\d+))?$")
_BLOCK = re.compile(r"(?:^|\.)(?P<family>[A-Za-z_]*blocks|layers)\.(?P<idx>\d+)(?:\.|$)")
_NAME = re.compile(r"^[A-Za-z0-9_.*?\[\]-]+$")
SYNTAX = ("write entries like '0-9: 0.5, !cross_attn' (block range or name pattern, ':' and a strength; "
          "'!' leaves layers out; 'only 0-9' keeps only those)")


def block_of(layer: str) -> tuple[str, int] | None:
    """(block list, index) of a layer name, e.g. ('blocks', 3) for 'blocks.3.self_attn.q'; None outside blocks."""
    m = _BLOCK.search(layer)
    return (m.group("family"), int(m.group("idx"))) if m else None


@dataclass(frozen=True)
class Selector:
    text: str
    family: str = ""          # block list name, '' for any (block selectors only)
    lo: int = -1              # block range; lo < 0: a name pattern
    hi: int = -1

    def selects(self, layer: str) -> bool:
        if self.lo >= 0:
            b = block_of(layer)
            return b is not None and (not self.family or b[0] == self.family) and self.lo <= b[1] <= self.hi
        if self.text == "*":
            return True
        if any(c in self.text for c in "*?["):
            return fnmatch.fnmatchcase(layer, self.text)
        return self.text in layer


@dataclass(frozen=True)
class Entry:
    kind: str                 # "strength", "exclude" or "only"
    selector: Selector
    factor: float = 1.0
    text: str = ""


@dataclass(frozen=True)
class BlockFilter:
    entries: tuple[Entry, ...]
    text: str

    def resolve(self, layers, *, where: str = "Load LoRA Adapter") -> tuple[dict[str, float], list[str]]:
        """({layer: block factor} for the layers kept, [layers left out]) over `layers`."""
        names = list(layers)
        for e in self.entries:
            if not any(e.selector.selects(n) for n in names):
                raise ConfigError(f"{where}: {INPUT} entry {e.text!r} selects none of the {len(names)} layers this "
                                  f"adapter changes ({_summary(names)}); fix the block numbers or the name, or "
                                  "remove the entry")
        onlys = [e.selector for e in self.entries if e.kind == "only"]
        kept: dict[str, float] = {}
        out: list[str] = []
        for n in names:
            if onlys and not any(s.selects(n) for s in onlys):
                out.append(n)
                continue
            if any(e.kind == "exclude" and e.selector.selects(n) for e in self.entries):
                out.append(n)
                continue
            f = 1.0
            for e in self.entries:
                if e.kind == "strength" and e.selector.selects(n):
                    f = e.factor
            if f == 0.0:
                out.append(n)
            else:
                kept[n] = f
        if not kept:
            raise ConfigError(f"{where}: {INPUT} {self.text!r} leaves out every one of the {len(names)} layers this "
                              "adapter changes; keep some (or turn the adapter off)")
        return kept, out

    def describe(self) -> str:
        return self.text


def parse_blocks(text, *, where: str = "Load LoRA Adapter") -> BlockFilter | None:
    """Parse a ``blocks`` text (module docstring); None for an empty one."""
    if text is None:
        return None
    if isinstance(text, BlockFilter):
        return text
    if not isinstance(text, str):
        raise ConfigError(f"{where}: {INPUT} must be text like '0-9: 0.5, !cross_attn', got {text!r}")
    src = text.strip()
    if not src:
        return None
    entries: list[Entry] = []
    for raw in re.split(r"[,;\n]", src):
        part = raw.strip()
        if not part:
            continue
        if part.startswith("!"):
            entries.append(Entry("exclude", _selector(part[1:], part, where), text=part))
        elif part == "only" or re.match(r"^only\s", part):
            entries.append(Entry("only", _selector(part[4:], part, where), text=part))
        elif ":" in part:
            sel_s, _, val_s = part.rpartition(":")
            entries.append(Entry("strength", _selector(sel_s, part, where), _factor(val_s, part, where), part))
        else:
            raise ConfigError(f"{where}: {INPUT} entry {part!r} has no strength; write '{part}: 0.5' for a strength, "
                              f"'!{part}' to leave it out or 'only {part}' to keep only it")
    if not entries:
        return None
    for i, e in enumerate(entries):  # a strength entry that a later '*' overrides entirely does nothing
        later = [x for x in entries[i + 1:] if x.kind == "strength" and x.selector.text == "*"]
        if e.kind == "strength" and later:
            raise ConfigError(f"{where}: {INPUT} entry {e.text!r} has no effect: the later {later[0].text!r} "
                              "overrides every layer (later entries win); put the '*' entry first")
    return BlockFilter(tuple(entries), src)


def _selector(s: str, entry: str, where: str) -> Selector:
    s = s.strip()
    if not s:
        raise ConfigError(f"{where}: {INPUT} entry {entry!r} names no blocks or layers; {SYNTAX}")
    m = _RANGE.match(s)
    if m:
        lo = int(m.group("lo"))
        hi = int(m.group("hi")) if m.group("hi") is not None else lo
        if hi < lo:
            raise ConfigError(f"{where}: {INPUT} entry {entry!r}: the range {lo}-{hi} runs backwards; "
                              f"write {hi}-{lo}")
        return Selector(s, m.group("family") or "", lo, hi)
    if s != "*" and not _NAME.match(s):
        raise ConfigError(f"{where}: {INPUT} entry {entry!r}: {s!r} is neither a block range (0-9, "
                          "double_blocks.0-18) nor a layer-name pattern (letters, digits, _ . and * ? wildcards); "
                          f"{SYNTAX}")
    return Selector(s)


def _factor(s: str, entry: str, where: str) -> float:
    try:
        v = float(s.strip())
    except ValueError:
        raise ConfigError(f"{where}: {INPUT} entry {entry!r}: strength {s.strip()!r} is not a number; "
                          f"{SYNTAX}") from None
    if not in_strength_range(v):
        raise ConfigError(f"{where}: {INPUT} entry {entry!r}: strength {v:g} is out of range; use "
                          f"[{STRENGTH_MIN:g}, {STRENGTH_MAX:g}]")
    return v


def _summary(names) -> str:
    """'blocks 0-29, and 3 other layers such as patch_embedding' for an error message."""
    fams: dict[str, set[int]] = {}
    other = []
    for n in names:
        b = block_of(n)
        if b is None:
            other.append(n)
        else:
            fams.setdefault(b[0], set()).add(b[1])
    parts = [f"{f} {min(ix)}-{max(ix)}" if len(ix) > 1 else f"{f} {min(ix)}" for f, ix in sorted(fams.items())]
    if other:
        parts.append(f"{len(other)} layer(s) outside blocks such as {other[0]}")
    example = next(iter(names), "")
    return "; ".join(parts) + (f"; names look like {example}" if example else "")


def groups(factors: dict[str, float], excluded: list[str]) -> dict:
    """The report's view: layers per block factor (count and the blocks), and the layers left out."""
    by: dict[float, list[str]] = {}
    for n, f in factors.items():
        by.setdefault(f, []).append(n)
    return {"strengths": [{"factor": f, "layers": len(ns), "where": _where(ns)} for f, ns in sorted(by.items())],
            "excluded": len(excluded), "excluded_where": _where(excluded) if excluded else ""}


def _where(names) -> str:
    fams: dict[str, list[int]] = {}
    other = 0
    for n in names:
        b = block_of(n)
        if b is None:
            other += 1
        else:
            fams.setdefault(b[0], []).append(b[1])
    parts = []
    for f, ix in sorted(fams.items()):
        parts.append(f"{f} {_ranges(sorted(set(ix)))}")
    if other:
        parts.append(f"{other} outside blocks")
    return "; ".join(parts)


def _ranges(ix: list[int]) -> str:
    out, start, prev = [], None, None
    for i in ix + [None]:
        if start is None:
            start = prev = i
        elif i is not None and i == prev + 1:
            prev = i
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    return ",".join(out)
