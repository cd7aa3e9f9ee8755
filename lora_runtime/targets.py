"""The layers one adapter acts on in one model, and each one's strength: resolved once.

Contract
- `targets_of(adapter, model, spec, where=...)` -> `Targets`: the adapter's layers matched to the
  model's modules (`match_adapter`, lenient as `spec` says) and, under `spec.blocks`, the layers
  the filter keeps, their block factors and the filter's report (errors name `where`).
- `Targets.strengths(strength, where=...)`: {layer: strength x its block factor} for the layers
  whose factor is not 1, each product range-checked once (the run's strength: a constant
  schedule is folded into it first).
- The match and the block resolution are remembered per model object (weakly; the last
  MEMO_ENTRIES per model) for the same adapter object, leniency and filter: the loader node, which
  shows the coverage and fails early, and the plan, which applies it, resolve once. A model's
  modules never change their names or shapes (wrappers are seen through), so the memo holds.
- Every call returns its own dicts and coverage report: callers may name or extend them.
"""
from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field

from torch import nn

from .block_filter import groups as block_groups
from .files.coverage import CoverageReport
from .files.layer_adapter import LayerAdapter, LoraAdapter
from .files.match import match_adapter
from .scaling import layer_strength
from .settings import check_strength

MEMO_ENTRIES = 8


@dataclass
class Targets:
    layers: dict[str, LayerAdapter]          # model module name -> weights (the layers a block filter keeps)
    coverage: CoverageReport
    factors: dict[str, float] = field(default_factory=dict)  # layer -> its block factor; empty without a filter
    blocks: dict | None = None               # the block filter's report (`block_filter.groups`); None without one

    def strengths(self, strength: float, *, where: str) -> dict[str, float]:
        return {t: check_strength(layer_strength(strength, f), what=f"{where}: strength x block factor of {t}")
                for t, f in self.factors.items() if f != 1.0}


@dataclass(frozen=True)
class _Resolved:
    adapter: "weakref.ref[LoraAdapter]"
    layers: dict
    coverage: CoverageReport
    factors: dict[str, float] | None
    excluded: list[str]


_MEMO: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def targets_of(adapter: LoraAdapter, model: nn.Module, spec, *, where: str) -> Targets:
    """See the module doc; `spec` is an `AdapterSpec` (its leniency and block filter are read)."""
    r = _resolved(adapter, model, spec, where)
    coverage = copy.deepcopy(r.coverage)
    if r.factors is None:
        return Targets(dict(r.layers), coverage)
    report = {"text": spec.blocks.describe(), **block_groups(r.factors, r.excluded)}
    layers = {t: la for t, la in r.layers.items() if t in r.factors}
    return Targets(layers, coverage, dict(r.factors), report)


def _resolved(adapter: LoraAdapter, model: nn.Module, spec, where: str) -> _Resolved:
    per_model = _MEMO.setdefault(model, {})
    key = (id(adapter), spec.lenient, spec.blocks)
    hit = per_model.get(key)
    if hit is not None and hit.adapter() is adapter:
        return hit
    layers, coverage = match_adapter(adapter, model, lenient=spec.lenient, log_coverage=False)  # no match raises
    factors, excluded = spec.blocks.resolve(layers, where=where) if spec.blocks is not None else (None, [])
    r = _Resolved(weakref.ref(adapter), layers, coverage, factors, excluded)
    per_model.pop(key, None)
    per_model[key] = r
    while len(per_model) > MEMO_ENTRIES:
        per_model.pop(next(iter(per_model)))
    return r
