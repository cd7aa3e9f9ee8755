"""The merge decision: measured per adapter, cached, explained.

`decide(mode, wrappers, cache, order)` returns a `MergeDecision` for the wrapped layers
carrying an adapter set, with one `AdapterDecision` per adapter (`order`: the adapter
names in plan order, which is merge order):

- ``dynamic``: never merge.
- ``merge``: merge every adapter; a layer whose weight cannot take a merge (quantized,
  packed, fp8) raises MergeRefusedError naming it.
- ``auto``: layers whose weight cannot take a merge make every adapter dynamic.
  Otherwise **each adapter on its own**: the share of *its* update a merge would round
  away, ``sqrt(sum ||round(W_i + dW_i) - W_i - dW_i||^2 / sum ||dW_i||^2)`` over its
  layers, where ``W_i`` is the weight it would be merged into (the base weight plus
  the adapters before it in merge order that merge), measured on an even row sample,
  writing nothing. Above AUTO_MERGE_MAX_ROUNDING_LOSS it stays dynamic, else it
  merges. A set-wide share would let a large style update hide a sub-ulp distilled
  one, which the merge then rounds away; per adapter it cannot.
- An adapter whose strength changes over the steps or per CFG branch (`varying`, see
  `schedule`) stays dynamic in ``auto`` (the reason says why) and is refused by ``merge``:
  a merge would have to be redone at every change.
- In every mode, layers the host refuses (`AdaptedLayer.merge_refusal`) and layers whose weight
  the host stages itself (`base_weight.staged_reason`: ComfyUI dynamic VRAM) stay dynamic for
  every adapter (`kept_dynamic`); the others are decided as above.

The actual merge folds the merged adapters of a layer with one rounding
(round(W + sum dW_i)); restore is bit for bit with any mix of merged and dynamic slots.

Each adapter's measurement is cached in a `DecisionCache` keyed by its layers (name,
weight storage, dtype, shape), its content (hash, strength, alpha per layer) and the
keys of the adapters merged before it, so re-running a prompt does not measure again;
with a disk level (`disk_cache`) another process that shares its folder does not either.
The file's name is not part of the key: the same bytes under another name are the same
adapter. A decision says how many adapters came from the shared cache (`shared_cache`),
how many were measured (`measured`) and what the disk level could not use (`cache_notes`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError, MergeRefusedError
from ..layer.base_weight import float_view, quant_layout, staged_reason, stored_tensors
from ..layer.merge import content_key
from ..settings import AUTO_MERGE_MAX_ROUNDING_LOSS, MergeMode
from ..layer.wrapper import AdaptedLayer
from ..layer.weight_merge import mergeable
from .cache import CHECK, SHARE, SHARED, DecisionCache
from .estimate import MAX_SAMPLE_ROWS, SequentialEstimate

log = logging.getLogger(__name__)



@dataclass
class AdapterDecision:
    name: str
    chosen: str                  # "merge" or "dynamic"
    share_lost: float | None     # share of this adapter's own update a merge would round away
    reason: str
    layers: int
    cached: bool = False
    shared: bool = False         # read from the shared (disk) cache, measured by another process or run

    def to_dict(self) -> dict:
        d = {"name": self.name, "chosen": self.chosen, "share_lost": self.share_lost, "reason": self.reason,
             "layers": self.layers, "cached": self.cached}
        if self.shared:
            d["shared_cache"] = True
        return d


@dataclass
class MergeDecision:
    requested: str
    chosen: str                     # "merge", "dynamic", or "mixed" (some adapters merged, some not)
    share_lost: float | None        # the adapter's own share when there is one adapter, else the largest
    reason: str
    layers: int
    cached: bool = False
    threshold: float = AUTO_MERGE_MAX_ROUNDING_LOSS
    # layers the host will not let us merge into right now (see AdaptedLayer.merge_refusal):
    # they stay dynamic whatever is chosen for the rest; layer name -> reason
    kept_dynamic: dict = field(default_factory=dict)
    adapters: list[AdapterDecision] = field(default_factory=list)
    measured: int = 0               # measurements this decision made (shares and overflow checks)
    cache_notes: list[str] = field(default_factory=list)  # disk entries ignored or not written, and why

    def merged_adapters(self) -> set[str]:
        return {a.name for a in self.adapters if a.chosen == "merge"}

    def to_dict(self) -> dict:
        d = {
            "requested": self.requested, "chosen": self.chosen, "share_lost": self.share_lost,
            "reason": self.reason, "layers": self.layers, "cached": self.cached, "threshold": self.threshold,
            "adapters": [a.to_dict() for a in self.adapters],
        }
        if self.kept_dynamic and self.chosen != "dynamic":
            d["kept_dynamic"] = len(self.kept_dynamic)
            d["kept_dynamic_reason"] = next(iter(self.kept_dynamic.values()))
            d["kept_dynamic_examples"] = list(self.kept_dynamic)[:3]
        shared = sum(a.shared for a in self.adapters)
        if shared:
            d["shared_cache"] = shared
        d["measured"] = self.measured
        if self.cache_notes:
            d["cache_notes"] = list(self.cache_notes)
        return d


def _slot(w: AdaptedLayer, name: str):
    s = w.slots.get(name)
    return s if s is not None and s.contributes and s.has_weight_delta else None


def _adapter_key(wrappers: list[AdaptedLayer], name: str, weight_keys: dict | None = None) -> tuple | None:
    """What a measurement of adapter `name` on `wrappers` depends on, by content: per layer the
    weight's content key (dtype, shape, device, checksums of its bits: `merge.content_key`),
    the adapter file's digest, the layer stem, strength and alpha, and whether the merge folds
    its factors (the tier: the share measured follows the merge's scaling). None when a slot has no
    content digest (an adapter built in memory): such a measurement is never cached."""
    parts = []
    for w in wrappers:
        s = _slot(w, name)
        if s is None:
            continue
        if not s.content_hash:
            return None
        wk = weight_keys.get(w.layer_name) if weight_keys is not None else None
        if wk is None:
            wk = _weight_key(w)
            if weight_keys is not None:
                weight_keys[w.layer_name] = wk
        parts.append((w.layer_name, wk, s.content_hash, s.layer.stem, s.strength, s.update.alpha, w.merge_folds))
    return tuple(parts)


def _weight_key(w: AdaptedLayer) -> tuple:
    """The content key of `w`'s weight: a quantized one by its layout, stored bytes and scales
    (read as stored, never dequantized), a float one by its values."""
    q = w.get_base_layer().weight
    if w.quantized:
        return ("quantized", quant_layout(q), *(content_key(t) for t in stored_tensors(q)))
    return (content_key(w.weight2d), None)


def _cannot_overflow(w: AdaptedLayer, s) -> bool:
    """Can slot `s` never take a weight of `w`'s dtype past its largest finite value, whatever
    the weight? Round-to-nearest of ``W + dW`` stays finite when ``|dW|`` is below half an ulp
    at the top of the dtype's range (fp16: 16, bf16: 2**119); for a low-rank pair (``stack()``) ``|dW|`` is at
    most ``|strength * scale| * max_i sum_k |up_ik| * max |down|``. Reads the factors only."""
    dtype = _float_dtype(w)
    st = s.update.stack()  # the low-rank pair as loaded (no cast cached for this), or None
    if st is None or dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    fi = torch.finfo(dtype)
    half_ulp_top = 2.0 ** math.floor(math.log2(fi.max)) * fi.eps / 2
    down, up, scale = st
    bound = (abs(s.strength * scale) * float(up.float().abs().sum(dim=1).max())
             * float(down.float().abs().max()))
    return bound * 1.01 < half_ulp_top  # margin for the fp32 roundings of the delta and of the bound


def _float_dtype(w: AdaptedLayer) -> torch.dtype | None:
    """The dtype of `w`'s weight when it is stored as floats (`float_view`), else None."""
    v = float_view(w.get_base_layer().weight)
    return None if v is None else v.dtype


def _own_refused(rest: list[AdaptedLayer], names: list[str], refused: dict[str, str]) -> dict:
    """adapter -> (its first layer that cannot take a merge, why, how many of its layers cannot)."""
    out = {}
    for a in names:
        mine = [w.layer_name for w in rest if _slot(w, a) is not None and w.layer_name in refused]
        if mine:
            out[a] = (mine[0], refused[mine[0]], len(mine))
    return out


def measure_share_lost(wrappers: list[AdaptedLayer], max_rows: int = MAX_SAMPLE_ROWS) -> float:
    """Share of the combined update of every contributing slot a merge would round away
    (one rounding of the sum, as the merge does). Used for a single adapter's layers."""
    err = ref = 0.0
    for w in wrappers:
        e, r = w.rounding_loss_sums(max_rows)
        err += e
        ref += r
    return math.sqrt(err / ref) if ref > 0 else 0.0


OFF = "off"
OFF_REASON = "off (strength 0)"


def _off(wrappers: list[AdaptedLayer], order: list[str], counts: dict[str, int]) -> list[AdapterDecision]:
    """Adapters on these layers that add nothing at all (strength 0 everywhere): not merged,
    not run, and said so, instead of vanishing from the decision."""
    out = []
    for name in order:
        if counts.get(name):
            continue
        slots = [w.slots[name] for w in wrappers if name in w.slots]
        if slots and all(s.strength == 0.0 for s in slots):
            out.append(AdapterDecision(name, OFF, None, OFF_REASON, len(slots)))
    return out


def _summary(mode: MergeMode, adapters: list[AdapterDecision], n: int, soft: dict, reason: str | None = None,
             cached: bool = False, off: list[AdapterDecision] = ()) -> MergeDecision:
    chosen_set = {a.chosen for a in adapters}
    chosen = chosen_set.pop() if len(chosen_set) == 1 else ("mixed" if chosen_set else "dynamic")
    if not adapters and off:  # every adapter is at strength 0: nothing is applied
        return MergeDecision(mode.value, OFF, None, OFF_REASON, n, adapters=list(off))
    if off:  # each adapter's own reason, the strength-0 ones included
        adapters, reason = list(adapters) + list(off), None
    shares = [a.share_lost for a in adapters if a.share_lost is not None]
    share = shares[0] if len(adapters) == 1 and shares else (max(shares) if shares else None)
    if reason is None:
        reason = adapters[0].reason if len(adapters) == 1 else "; ".join(f"{a.name}: {a.reason}" for a in adapters)
    if soft and chosen != "dynamic":
        reason += f"; {len(soft)} layers stay dynamic ({next(iter(soft.values()))})"
    return MergeDecision(mode.value, chosen, share, reason, n, cached, kept_dynamic=soft, adapters=adapters)


def _counted(d: MergeDecision, measured: int, notes: list[str]) -> MergeDecision:
    d.measured, d.cache_notes = measured, notes
    return d


def decide(mode: MergeMode, wrappers: list[AdaptedLayer], cache: DecisionCache | None = None,
           order: list[str] | None = None, varying: dict[str, str] | None = None) -> MergeDecision:
    """`varying`: adapter name -> why its strength changes over the run or per branch
    (`schedule.varies`); such adapters stay dynamic in auto and are refused by merge."""
    n = len(wrappers)
    varying = varying or {}
    if order is None:  # every adapter on these layers, in first-seen order
        order = list(dict.fromkeys(name for w in wrappers for name in w.slots))
    counts = {name: sum(1 for w in wrappers if _slot(w, name) is not None) for name in order}
    names = [name for name in order if counts[name]]

    def each(chosen: str, reason: str, share=None) -> list[AdapterDecision]:
        return [AdapterDecision(name, chosen, share, reason, counts[name]) for name in names]

    weight_keys: dict = {}  # layer -> content key, read once per decision
    off = _off(wrappers, order, counts)
    measured, notes = 0, []  # measurements made here; what the shared cache could not use or keep

    if mode is MergeMode.DYNAMIC:
        why = "dynamic mode never touches the weights"
        # overflow check only: an update the weight dtype cannot hold (cached by content). Only
        # weights stored as floats: a packed / quantized / fp8 weight is dequantized per call into
        # the compute dtype by its layer and never merged, so its storage has no range to check
        floats = [w for w in wrappers if _float_dtype(w) is not None]
        check = None
        for name in names:
            if all(_cannot_overflow(w, s) for w in floats for s in [_slot(w, name)] if s is not None):
                continue  # bounded by its factors: no weight of this dtype can overflow
            key = _adapter_key(floats, name, weight_keys) if cache is not None else None
            if key is not None:
                passed, _, note = cache.lookup(CHECK, key)
                notes += [note] if note else []
                if passed:
                    continue
            check = check or SequentialEstimate(floats)
            check.share(name)
            measured += 1
            if key is not None:
                note = cache.store(CHECK, key, True)
                notes += [note] if note else []
        return _counted(_summary(mode, each("dynamic", why), n, {}, why, off=off), measured, notes)
    # a host refusal (the host patches that weight itself) keeps that layer dynamic; a weight
    # that cannot take a merge at all (quantized, packed, fp8) is judged for the whole set
    # (the host's own refusals, and weights the host stages itself: ComfyUI dynamic VRAM streams them)
    soft = {w.layer_name: why for w in wrappers
            for why in [getattr(w, "merge_refusal", "") or staged_reason(w)] if why}
    rest = [w for w in wrappers if w.layer_name not in soft]
    refused = [(w.layer_name, why) for w in rest for ok, why in [mergeable(w)] if not ok]
    # per adapter: (first refused layer, why, how many of its own layers are refused)
    own_refused = _own_refused(rest, names, dict(refused)) if refused else {}
    if mode is MergeMode.MERGE:
        for name in names:
            if name in varying:
                raise ConfigError(
                    f"merge mode 'merge' cannot fold adapter {name!r} into the weights: "
                    f"{varying[name].removeprefix('stays unmerged: ')}. Use merge mode 'auto' (keeps it dynamic, "
                    "merges the others) or 'dynamic', or clear its strength_schedule / set its branch to 'both'")
        if refused:
            name, (layer, why, k) = next((a, own_refused[a]) for a in names if a in own_refused)
            raise MergeRefusedError(
                f"merge mode 'merge' cannot fold adapter {name!r} into layer {layer!r}: {why} "
                f"({k} of its {counts[name]} layers). Use merge mode 'dynamic' (or 'auto'): they keep "
                "their weights as stored and add the adapter at run time."
            )
        why = "merge mode folds every adapter into the weights"
        if not rest:
            return _summary(mode, each("dynamic", f"no layer may be merged into: {next(iter(soft.values()))}"),
                            n, soft, off=off)
        return _summary(mode, each("merge", why), n, soft, why, off=off)
    if refused:
        def own_msg(a: str) -> str:
            if a not in own_refused:
                return (f"stays dynamic with the others: none of its layers is refused, but {len(refused)} "
                        f"layers of the other adapters cannot take a merge (e.g. {refused[0][0]}: {refused[0][1]})")
            layer, why, k = own_refused[a]
            return f"{k} of its {counts[a]} layers cannot take a merge (e.g. {layer}: {why})"
        adapters = [AdapterDecision(a, "dynamic", None, own_msg(a), counts[a]) for a in names]
        return _summary(mode, adapters, n, {}, off=off)  # each adapter's own reason
    if not rest:
        msg = f"no layer may be merged into: {next(iter(soft.values()))}"
        return _summary(mode, each("dynamic", msg), n, soft, msg, off=off)

    estimate = None
    merged_names: list[str] = []

    def sampled() -> SequentialEstimate:
        nonlocal estimate
        if estimate is None:  # built on the first measurement; replay the merges decided from the cache
            estimate = SequentialEstimate(rest, order=[a for a in names if a not in varying])
            for done in merged_names:
                estimate.advance(estimate.share(done)[1])
        return estimate

    decisions: list[AdapterDecision] = []
    merged_keys: list[tuple] = []
    all_cached = True
    for name in names:
        if name in varying:  # a merge cannot follow a strength that changes per step or per branch
            decisions.append(AdapterDecision(name, "dynamic", None, varying[name], counts[name]))
            continue
        if not any(_slot(w, name) is not None for w in rest):  # only layers the host keeps dynamic
            decisions.append(AdapterDecision(name, "dynamic", None, "all its layers stay dynamic", counts[name]))
            continue
        own = _adapter_key(rest, name, weight_keys) if cache is not None else None
        key = (own, tuple(merged_keys)) if own is not None and None not in merged_keys else None
        share, source, note = cache.lookup(SHARE, key) if key is not None else (None, "", "")
        notes += [note] if note else []
        hit, after = share is not None, None
        if not hit:
            all_cached = False
            share, after = sampled().share(name)
            share = float(share)
            measured += 1
            if key is not None:
                note = cache.store(SHARE, key, share)
                notes += [note] if note else []
        if share > AUTO_MERGE_MAX_ROUNDING_LOSS:
            reason = (f"stays unmerged: merging into the base weights would round away {share:.0%} of its update "
                      f"(> {AUTO_MERGE_MAX_ROUNDING_LOSS:.0%})")
            decisions.append(AdapterDecision(name, "dynamic", share, reason, counts[name], hit, source == SHARED))
            continue
        reason = f"merged: a merge rounds away {share:.0%} of its update (<= {AUTO_MERGE_MAX_ROUNDING_LOSS:.0%})"
        decisions.append(AdapterDecision(name, "merge", share, reason, counts[name], hit, source == SHARED))
        merged_keys.append(own)
        merged_names.append(name)
        if estimate is not None:  # later adapters are measured against the weight with this one merged
            estimate.advance(after if after is not None else estimate.share(name)[1])
    decision = _counted(_summary(mode, decisions, n, soft, cached=all_cached, off=off), measured, notes)
    for a in decisions:
        log.info("LoRA auto merge, %s over %d layers: %s", a.name, a.layers, a.reason)
    return decision
