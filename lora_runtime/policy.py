"""The merge decision: measured, cached, explained (contracts.md section 2).

`decide(mode, wrappers, cache)` returns a `MergeDecision` for a set of wrapped layers
carrying the adapter set:

- ``dynamic``: never merge.
- ``merge``: merge every layer; a layer whose weight cannot take a merge (quantized,
  packed, fp8, patched) raises MergeRefusedError naming it.
- ``auto``: layers that cannot take a merge make the whole set dynamic; otherwise
  the share of the update a merge would round away,
  ``sqrt(sum ||round(W+dW)-W-dW||^2 / sum ||dW||^2)`` over all adapted layers, is
  measured (on an even row sample, writing nothing) and the set stays dynamic when it
  exceeds AUTO_MERGE_MAX_ROUNDING_LOSS.

The measurement is cached in a `DecisionCache` keyed by the layers (name, weight
storage, dtype, shape) and each adapter's (content hash, strength, alpha
per layer), so re-running a prompt does not measure again.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from .errors import MergeRefusedError
from .settings import AUTO_MERGE_MAX_ROUNDING_LOSS, MergeMode
from .wrapper import LoraLinear, mergeable

log = logging.getLogger(__name__)


@dataclass
class MergeDecision:
    requested: str
    chosen: str                     # "merge" or "dynamic"
    share_lost: float | None        # share of the update a merge would round away
    reason: str
    layers: int
    cached: bool = False
    threshold: float = AUTO_MERGE_MAX_ROUNDING_LOSS
    # layers the host will not let us merge into right now (see LoraLinear.merge_refusal):
    # they stay dynamic whatever is chosen for the rest; layer name -> reason
    kept_dynamic: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {
            "requested": self.requested, "chosen": self.chosen, "share_lost": self.share_lost,
            "reason": self.reason, "layers": self.layers, "cached": self.cached, "threshold": self.threshold,
        }
        if self.kept_dynamic and self.chosen == "merge":
            d["kept_dynamic"] = len(self.kept_dynamic)
            d["kept_dynamic_reason"] = next(iter(self.kept_dynamic.values()))
            d["kept_dynamic_examples"] = list(self.kept_dynamic)[:3]
        return d


@dataclass
class DecisionCache:
    """Measured rounding-loss shares; one instance per base model (held by the caller)."""

    shares: dict = field(default_factory=dict)
    measurements: int = 0

    def clear(self) -> None:
        self.shares.clear()


def _cache_key(wrappers: list[LoraLinear]) -> tuple:
    parts = []
    for w in wrappers:
        weight = w.weight
        slots = tuple(
            (s.content_hash or id(s.layer), s.layer.stem, s.strength, s.layer.alpha)
            for s in w.slots.values() if s.contributes
        )
        parts.append((w.layer_name, weight.data_ptr(), str(weight.dtype), tuple(weight.shape), slots))
    return tuple(parts)


def measure_share_lost(wrappers: list[LoraLinear], max_rows: int = 1024) -> float:
    err = ref = 0.0
    for w in wrappers:
        e, r = w.rounding_loss_sums(max_rows)
        err += e
        ref += r
    return math.sqrt(err / ref) if ref > 0 else 0.0


def decide(mode: MergeMode, wrappers: list[LoraLinear], cache: DecisionCache | None = None) -> MergeDecision:
    n = len(wrappers)
    if mode is MergeMode.DYNAMIC:
        return MergeDecision(mode.value, "dynamic", None, "dynamic mode never touches the weights", n)
    # a host refusal (the host patches that weight itself) keeps that layer dynamic; a weight
    # that cannot take a merge at all (quantized, packed, fp8) is judged for the whole set
    soft = {w.layer_name: w.merge_refusal for w in wrappers if getattr(w, "merge_refusal", "")}
    rest = [w for w in wrappers if w.layer_name not in soft]
    refused = [(w.layer_name, why) for w in rest for ok, why in [mergeable(w)] if not ok]
    if mode is MergeMode.MERGE:
        if refused:
            name, why = refused[0]
            raise MergeRefusedError(
                f"merge mode 'merge' cannot fold the adapter into layer {name!r}: {why} "
                f"({len(refused)} such layers). Use merge mode 'dynamic' (or 'auto')."
            )
        reason = "merge mode folds every adapter into the weights"
        if soft:
            reason += f"; {len(soft)} layers stay dynamic ({next(iter(soft.values()))})"
        return MergeDecision(mode.value, "merge" if rest else "dynamic", None, reason, n, kept_dynamic=soft)
    if refused:
        name, why = refused[0]
        return MergeDecision(mode.value, "dynamic", None, f"{len(refused)} layers cannot take a merge (e.g. {name}: {why})", n)
    if not rest:
        return MergeDecision(mode.value, "dynamic", None, f"no layer may be merged into: {next(iter(soft.values()))}",
                             n, kept_dynamic=soft)
    key = _cache_key(rest)
    cached = cache is not None and key in cache.shares
    if cached:
        share = cache.shares[key]
    else:
        share = measure_share_lost(rest)
        if cache is not None:
            cache.shares[key] = share
            cache.measurements += 1
    if share > AUTO_MERGE_MAX_ROUNDING_LOSS:
        reason = (f"stays unmerged: merging into the base weights would round away {share:.0%} of its update "
                  f"(> {AUTO_MERGE_MAX_ROUNDING_LOSS:.0%})")
        chosen = "dynamic"
    else:
        reason = f"merged: a merge rounds away {share:.0%} of its update (<= {AUTO_MERGE_MAX_ROUNDING_LOSS:.0%})"
        chosen = "merge"
        if soft:
            reason += f"; {len(soft)} layers stay dynamic ({next(iter(soft.values()))})"
    log.info("LoRA auto merge over %d layers: %s", n, reason)
    return MergeDecision(mode.value, chosen, share, reason, n, cached, kept_dynamic=soft)
