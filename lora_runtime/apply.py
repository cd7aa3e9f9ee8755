"""Putting adapters on a model and taking them off again, exactly.

    p = plan(model, [AdapterSpec("style.safetensors", 0.8)], mode="auto", tier="lossless")
    with applied(model, p, cache=decision_cache) as report:
        ...  # run the model; wrappers read the tier from the runtime context
    # here every wrapper is gone and every merged weight is restored bit for bit,
    # also when the body raised or was interrupted

`plan` loads and matches the adapters (coverage reports; zero matches raises) and
touches nothing. `LoraInjector.apply` moves a model from whatever adapter state it
is in to the planned one (hot switching): merged weights are restored first, layers
are wrapped/unwrapped, slots synced in plan order, the merge decision taken (and
cached), and the merge done. A failure part-way leaves no weight modified.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from .files.coverage import CoverageReport
from .files.layer_adapter import LayerAdapter, LoraAdapter
from .files.load import load_adapter
from .files.match import log_report
from .errors import LoraRuntimeError, NonFiniteMergeError
from .files.param_deltas import ParamDelta
from .param_patch import ParamPatch
from .decision.cache import DecisionCache
from .decision.policy import MergeDecision, decide
from .layer.base_weight import staged_reason
from .layer.runtime_context import runtime_context
from .intent import AdapterSpec, Intent
from .layer.schedule import Branch
from .settings import DEFAULT_RESTORE_MEMORY, MergeMode, RestoreMemory, Tier
from .layer.shared_shrink import group_siblings
from .layer.wrapper import AdaptedLayer, attached_wrapper
from .targets import targets_of

log = logging.getLogger(__name__)


@dataclass
class PlannedAdapter:
    name: str
    spec: AdapterSpec
    adapter: LoraAdapter
    layers: dict[str, LayerAdapter]   # model module name -> weights (the layers a block filter keeps)
    coverage: CoverageReport
    strengths: dict[str, float] = field(default_factory=dict)  # layer -> its strength, where a block filter set one
    blocks: dict | None = None        # the block filter's report (`block_filter.groups`), None without one

    def strength_of(self, target: str) -> float:
        return self.strengths.get(target, self.spec.strength)


@dataclass
class Plan:
    mode: MergeMode
    tier: Tier
    adapters: list[PlannedAdapter]
    # module name -> why its weight must not be merged into (set by the host, e.g. ComfyUI
    # patches that weight itself and may restore its own backup into it mid-sampling)
    merge_refusals: dict[str, str] = field(default_factory=dict)
    restore: RestoreMemory = DEFAULT_RESTORE_MEMORY   # what a merge keeps to restore the weight
    # module name -> the host's stochastic-rounding seed for a merge into a quantized weight (None: 0)
    requant_seed: "Callable[[str], int] | None" = None
    # (module name, module) -> why its weight must not be merged into, asked when the adapters go on
    # (after the host loaded the model: what it staged is known then); '' for none. Set by a host that
    # stages weights itself (ComfyUI's dynamic VRAM); it wins over `merge_refusals` where both name a layer
    layer_refusal: "Callable[[str, nn.Module], str] | None" = None

    def modules(self) -> list[str]:
        """Modules that get a wrapper (parameter deltas are not modules)."""
        seen: dict[str, None] = {}
        for pa in self.adapters:
            for m, la in pa.layers.items():
                if isinstance(la, LayerAdapter):
                    seen.setdefault(m)
        return list(seen)


def plan(model: nn.Module, specs, mode="auto", tier="lossless", *, loader=load_adapter,
         restore=DEFAULT_RESTORE_MEMORY) -> Plan:
    """`plan_intent` of ``Intent(specs, mode, tier, restore)``: the settings parsed there."""
    return plan_intent(model, Intent(specs, mode, tier, restore), loader=loader)


def plan_intent(model: nn.Module, intent: Intent, *, loader=load_adapter) -> Plan:
    """Load and match every adapter of `intent`. Touches nothing on the model."""
    planned: list[PlannedAdapter] = []
    used: set[str] = set()
    for spec in intent.adapters:
        adapter = loader(spec.path, content_hash=spec.content_hash) if spec.content_hash else loader(spec.path)
        name = unique_name(spec.name or adapter.name, used)
        t = targets_of(adapter, model, spec, where=f"adapter {name}")
        t.coverage.adapter = name  # the report joins coverage and adapters by the planned name
        log_report(t.coverage)
        strengths = t.strengths(spec.strength, where=f"adapter {name}")
        planned.append(PlannedAdapter(name, spec, adapter, t.layers, t.coverage, strengths, t.blocks))
    return Plan(intent.mode, intent.tier, planned, restore=intent.restore)


def unique_name(name: str, used: set[str]) -> str:
    """The planned name of an adapter: `name`, or `name#2`, `name#3`... when taken; added to `used`."""
    base, k = name, 2
    while name in used:
        name, k = f"{base}#{k}", k + 1
    used.add(name)
    return name


@dataclass
class ApplyReport:
    tier: str
    decision: MergeDecision | None
    coverage: list[CoverageReport]
    adapters: list[dict]
    layers_wrapped: int = 0
    restore_bytes: int = 0
    restore_memory: str = DEFAULT_RESTORE_MEMORY.value
    merged_weight_bytes: int = 0
    patch_seconds: float = 0.0
    fusions: list[dict] = field(default_factory=list)
    params: list[dict] = field(default_factory=list)   # parameter deltas merged (norms, modulation)
    mounted: object = field(default=None, repr=False)   # the mounted fusion sites while applied
    kept: bool = False   # resumed from the state the last sampling left on (lora_runtime.resident)
    layers: list[dict] = field(default_factory=list)   # what happened per layer (`layer_outcomes`)

    def to_dict(self) -> dict:
        return {
            "tier": self.tier,
            "decision": self.decision.to_dict() if self.decision else None,
            "coverage": [c.to_dict() for c in self.coverage],
            "adapters": self.adapters,
            "layers_wrapped": self.layers_wrapped,
            "restore_bytes": self.restore_bytes,
            "restore_memory": self.restore_memory,
            "merged_weight_bytes": self.merged_weight_bytes,
            "patch_seconds": round(self.patch_seconds, 4),
            "fusions": self.mounted.report() if self.mounted is not None else self.fusions,
            "params": self.params,
            "kept": self.kept,
            "layers": self.layers,
        }


def refusal_label(why: str) -> str:
    """The short label of a merge refusal: the text before its first ': ' (e.g. 'streamed (dynamic
    VRAM)'), or 'kept dynamic' when it has none."""
    head, sep, _ = why.partition(": ")
    return head if sep and len(head) <= 48 else "kept dynamic"


def layer_outcomes(wrappers: list[AdaptedLayer]) -> list[dict]:
    """What happened per adapted layer, grouped: {"what": "<label>: <outcome>" or "<outcome>",
    "layers": n, "names": every layer's name, "why": the refusal in full or ''}, most layers first.
    Outcome: merged, dynamic, merged + dynamic (some adapters of the layer merged), offset only (a
    bias offset added at run time), off (strength 0). Label: why the layer took no merge, when the host
    refused it (`merge_refusal`) or stages its weight itself (`base_weight.staged_reason`)."""
    groups: dict[str, dict] = {}
    for w in wrappers:
        slots = w.weight_slots()
        merged = sum(1 for s in slots if s.merged)
        if not slots:
            outcome = "offset only" if w.has_output_offset else "off"
        else:
            outcome = "merged" if merged == len(slots) else "dynamic" if merged == 0 else "merged + dynamic"
        why = w.merge_refusal or staged_reason(w)
        what = f"{refusal_label(why)}: {outcome}" if why else outcome
        g = groups.setdefault(what, {"what": what, "layers": 0, "names": [], "why": why})
        g["layers"] += 1
        g["names"].append(w.layer_name)
    return sorted(groups.values(), key=lambda g: (-g["layers"], g["what"]))


class LoraInjector:
    """Owns the LoRA state of one model: which layers are wrapped, what is merged."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.wrappers: dict[str, AdaptedLayer] = {}
        self.params: dict[str, ParamPatch] = {}
        self.cache = DecisionCache()   # used when `apply` is given none (content-keyed: never stale)
        self.sibling_groups: list = []  # shared_shrink.SiblingGroup of the wrapped q/k/v-style projections
        self.share_shrink = True        # False: each projection its own shrink GEMM (benchmarks' side arm)

    # -- attaching (instance forward; the module tree is never changed) -----------------
    def _wrap(self, name: str) -> AdaptedLayer:
        mod = self.model.get_submodule(name)
        if attached_wrapper(mod) is not None or getattr(mod, "is_lora_wrapper", False):
            raise LoraRuntimeError(f"layer {name!r} already carries another LoRA runtime's adapters; "
                                   "let that sampling finish (or remove it) first")
        w = AdaptedLayer(mod, name)
        w.attach()
        self.wrappers[name] = w
        return w

    def _unwrap(self, name: str) -> None:
        w = self.wrappers.pop(name)
        try:
            w.unmerge()
        finally:
            w.detach()

    def unmerge_all(self, remember: bool = False) -> None:
        """Restore every merged weight. `remember` (inside `apply` only): each wrapper keeps
        its verified fingerprint for the merge that follows in the same transition."""
        errors = []
        try:
            self.restore_params()
        except Exception as e:  # keep restoring the others
            errors.append(e)
        for w in self.wrappers.values():
            try:
                w.unmerge(remember=remember)
            except Exception as e:  # keep restoring the others
                errors.append(e)
        if errors:
            raise errors[0]

    def clear(self) -> None:
        """Restore every merged weight and remove every wrapper."""
        self.unmerge_all()
        for name in list(self.wrappers):
            self._unwrap(name)
        self.sibling_groups = []

    # -- state transition --------------------------------------------------------------
    def apply(self, p: Plan, cache: DecisionCache | None = None) -> ApplyReport:
        t0 = time.perf_counter()
        try:
            return self._apply(p, self.cache if cache is None else cache, t0)
        finally:  # a fingerprint verified by this transition's restore is never reused later
            for w in self.wrappers.values():
                w.forget_verified()

    def _apply(self, p: Plan, cache: DecisionCache, t0: float) -> ApplyReport:
        self.unmerge_all(remember=True)
        wanted: dict[str, list[tuple[PlannedAdapter, LayerAdapter]]] = {}
        for pa in p.adapters:
            for target, la in pa.layers.items():
                if not isinstance(la, ParamDelta):
                    wanted.setdefault(target, []).append((pa, la))
        params = self.param_patches(p)
        for name in [n for n in self.wrappers if n not in wanted]:
            self._unwrap(name)
        for name, entries in wanted.items():
            w = self.wrappers.get(name) or self._wrap(name)
            w.merge_refusal = (p.layer_refusal(name, w.get_base_layer()) if p.layer_refusal is not None
                               else "") or p.merge_refusals.get(name, "")
            w.restore_copy = p.restore is RestoreMemory.COPY
            w.merge_tier = p.tier
            w.requant_seed = p.requant_seed(name) if p.requant_seed is not None else 0
            w.set_slots([(pa.name, la, pa.strength_of(name), pa.spec.enabled, pa.adapter.content_hash)
                         for pa, la in entries])
        wrappers = [self.wrappers[n] for n in wanted]
        varying = {pa.name: pa.spec.varies for pa in p.adapters if pa.spec.varies}
        decision = decide(p.mode, wrappers, cache, [pa.name for pa in p.adapters],
                          varying=varying) if wrappers else None
        if decision is not None and decision.merged_adapters():
            merge = decision.merged_adapters()
            self._merge_all([w for w in wrappers if w.layer_name not in decision.kept_dynamic
                             and merge.intersection(w.slots)], wanted, merge)
        self.merge_params(params)
        # q/k/v: one shrink GEMM (eager lossless/high calls)
        self.sibling_groups = group_siblings(self.wrappers, enabled=self.share_shrink)
        for w in wrappers:  # what a compiled call reads, for the final (merged or dynamic) state
            w.prepare_trace()
        report = ApplyReport(
            tier=p.tier.value,
            decision=decision,
            coverage=[pa.coverage for pa in p.adapters],
            adapters=[{"name": pa.name, "path": pa.spec.path, "strength": pa.spec.strength,
                       "enabled": pa.spec.enabled, "format": pa.adapter.format,
                       "layers": len(pa.layers), "kinds": dict(pa.coverage.kinds),
                       **({"schedule": pa.spec.schedule.describe()} if pa.spec.schedule is not None else {}),
                       **({"branch": pa.spec.branch.value} if pa.spec.branch is not Branch.BOTH else {}),
                       **({"blocks": pa.blocks} if pa.blocks is not None else {})}
                      for pa in p.adapters],
            layers_wrapped=len(self.wrappers),
            restore_memory=p.restore.value,
            restore_bytes=sum(w.restore_bytes for w in self.wrappers.values())
            + sum(pp.restore_bytes for pp in self.params.values()),
            merged_weight_bytes=sum(w.weight.numel() * w.weight.element_size()
                                    for w in self.wrappers.values() if w.merged),
            patch_seconds=time.perf_counter() - t0,
            params=[{"param": n, "adapters": sorted({a for a, _, _ in pp.entries}),
                     "share_lost": round(pp.share_lost, 4)} for n, pp in self.params.items()],
            layers=layer_outcomes(wrappers),
        )
        return report

    def param_patches(self, p: Plan) -> dict[str, ParamPatch]:
        """The plan's parameter deltas (norms, modulation, biases of layers without a wrapper), one
        patch per parameter of the model as it is now; nothing merged yet."""
        params: dict[str, ParamPatch] = {}
        named = None
        for pa in p.adapters:
            for target, la in pa.layers.items():
                if isinstance(la, ParamDelta):
                    if named is None:
                        named = dict(self.model.named_parameters())
                    if target not in params:
                        params[target] = ParamPatch(target, named[target], cast_site=_cast_site(self.model, target))
                    params[target].add(pa.name, la, pa.strength_of(target) if pa.spec.enabled else 0.0)
        return params

    def merge_params(self, params: dict[str, ParamPatch]) -> None:
        """Merge the parameter deltas (they have no forward of their own: merged in every mode); a
        failure restores every merged weight."""
        try:
            for name, pp in params.items():
                pp.merge()
                self.params[name] = pp
        except BaseException:
            self.unmerge_all()
            raise

    def restore_params(self) -> None:
        """Take the parameter deltas off (bit for bit); the wrappers' merges stay."""
        errors = []
        for pp in self.params.values():
            try:
                pp.restore()
            except Exception as e:  # keep restoring the others
                errors.append(e)
        self.params.clear()
        if errors:
            raise errors[0]

    def _merge_all(self, wrappers: list[AdaptedLayer], wanted, only: set[str] | None = None) -> None:
        done = []
        try:
            for w in wrappers:
                w.merge(only)
                done.append(w)
        except NonFiniteMergeError as e:
            for d in done:
                d.unmerge()
            names = ", ".join(pa.name for pa, _ in wanted[w.layer_name])
            raise NonFiniteMergeError(f"adapter(s) {names}: {e}") from None
        except BaseException:
            for d in done:
                d.unmerge()
            raise


def _cast_site(model: nn.Module, target: str) -> tuple | None:
    """(module, 'weight' | 'bias') when `target` is a weight or bias of a module whose weights the host
    stages itself (ComfyUI dynamic VRAM): its delta rides at cast time (`ParamPatch`); else None."""
    owner, _, attr = target.rpartition(".")
    if attr not in ("weight", "bias"):
        return None
    module = model.get_submodule(owner) if owner else model
    return (module, attr) if staged_reason(module) else None


@contextlib.contextmanager
def running(model: nn.Module, report: ApplyReport, tier: Tier, fusion_backend: str | None):
    """The per-run parts on an applied model: the fusion sites the tier admits mounted (none with
    ``fusion_backend=None``) and the runtime context entered; on exit the sites are unmounted and
    what they did is kept in ``report.fusions``."""
    from .fusion.fusion_sites import mount_fusions

    mounted = None
    try:
        if fusion_backend is not None:
            mounted = report.mounted = mount_fusions(model, tier, fusion_backend)
        with runtime_context(tier=tier):
            yield report
    finally:
        if mounted is not None:
            report.fusions = mounted.report()
            report.mounted = None
            mounted.unmount()
