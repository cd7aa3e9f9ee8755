"""LoraLinear: the adapters of one Linear (or ComfyUI cast Linear), N at a time.

Contract
- Attached, not inserted: ``attach()`` sets an instance ``forward`` on the real layer (chaining
  any instance forward already there) and records itself as ``layer._lora_runtime``; the module
  tree, state dict and the host's Parameters are unchanged; ``detach()`` puts the forward back.
  ``weight``, ``bias`` and every other attribute read through to the wrapped layer.
- Adapters live in ``slots`` (insertion order), each with its update, strength and enabled flag;
  they change only through `add_adapter` / `set_slots` and the setters.
- Dynamic path: ``y = base(x) + sum of each live slot's delta``; the update answers how (its
  `forward`, or its `stack()` pair) and `scaling` applies the factors per the runtime tier.
  ``diff_b`` offsets are added at run time even when the weight is merged. A runtime scale of
  0.0 returns the base output.
- ``merge()`` folds the live slots' weight deltas into the weight with one rounding (scale and
  strength one after the other under ``merge_tier`` exact, as one product under lossless/high);
  ``unmerge()`` restores it bit for bit (from the lean record, or a
  full copy when ``restore_copy`` is set), recomputing the delta as its merge did.
- ``stack(device, dtype)`` is what a fused kernel takes for this call, or None.
The paths and their numerics: docs/engine.md.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LoraRuntimeError, MergeRefusedError, NonFiniteMergeError
from . import call_plan, stacking
from . import quantized_merge
from .base_weight import base_weight, float_view, own_storage, packed_reason, quant_layout, real_shape
from .merge import RestoreRecord, merge_weight, restore_weight, rounding_loss_sums
from .runtime_context import _CURRENT, current_context
from .stacking import can_add_inplace, row_mask
from ..scaling import combined_factor, folds_scales, scale_delta, times
from ..settings import Tier
from ..updates import Update

if TYPE_CHECKING:
    from ..files.layer_adapter import LayerAdapter

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass
class AdapterSlot:
    name: str
    layer: "LayerAdapter"
    strength: float = 1.0
    enabled: bool = True
    merged: bool = False
    content_hash: str = ""
    frozen_delta: torch.Tensor | None = field(default=None, repr=False)  # weight-dependent delta while merged

    @property
    def update(self) -> Update:
        return self.layer.update

    @property
    def contributes(self) -> bool:
        return self.enabled and self.strength != 0.0

    @property
    def stackable(self) -> bool:
        """Does the update answer `stack()` (one low-rank pair a stacked GEMM or fused kernel takes)?"""
        return self.layer.update.stack() is not None

    @property
    def has_weight_delta(self) -> bool:
        return self.layer.update.has_weight_delta

    @property
    def factor(self) -> float:
        """The update's scale times this slot's strength (no runtime scale)."""
        return combined_factor(self.layer.update.scale, self.strength)


def mergeable(layer: nn.Module) -> tuple[bool, str]:
    """Can a merge write into this layer's weight? Judged on the wrapped layer."""
    refusal = getattr(layer, "merge_refusal", "")
    if refusal:
        return False, refusal
    base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
    w = getattr(base, "weight", None)
    if w is None:
        return False, "layer has no weight"
    if getattr(base, "weight_lowvram_function", None) is not None or getattr(base, "_v", None) is not None:
        return False, "weight is streamed and patched per call (ComfyUI dynamic VRAM)"
    if quant_layout(w) is not None:  # merged as the host merges: re-quantized on the layout's grid
        if getattr(base, "weight_function", None):
            return False, "weight has weight-function patches"
        why = quantized_merge.can_requantize(w)
        return not why, why
    why = packed_reason(w)  # a GGUF F16/BF16/F32 weight is a plain float weight; quantized ones are not
    if why:
        return False, why
    if getattr(base, "weight_function", None):
        return False, "weight has weight-function patches"
    for attr in ("scale_weight", "weight_scale", "quant_state", "qweight"):
        if getattr(base, attr, None) is not None:
            return False, f"weight is scaled/quantized ({attr})"
    return True, ""


def _identity(w: torch.Tensor) -> tuple:
    """Storage, layout and in-place write count of a weight (None for the count of an
    inference tensor, which keeps none): equal only if nothing replaced it or wrote into it
    through torch since. Used between a restore and the merge that follows it in one state
    transition, where nothing else runs."""
    version = None if w.is_inference() else w._version
    return (w.data_ptr(), w.dtype, tuple(w.shape), tuple(w.stride()), w.device, version)


ATTR = "_lora_runtime"


def attached_wrapper(layer: nn.Module) -> "LoraLinear | None":
    """The LoraLinear attached to `layer` (by `attach`), or None."""
    return layer.__dict__.get(ATTR)


def runtime_leftovers(model: nn.Module) -> list[str]:
    """Modules that still carry LoRA runtime state (an attached wrapper, a forward routed
    through one, or a wrapper module in the tree); [] after a clean restore."""
    out = []
    for name, m in model.named_modules():
        fwd = m.__dict__.get("forward")
        if (ATTR in m.__dict__ or getattr(m, "is_lora_wrapper", False)
                or getattr(getattr(fwd, "__self__", None), "is_lora_wrapper", False)):
            out.append(name)
    return out


class LoraLinear(nn.Module):
    is_lora_wrapper = True

    def __init__(self, base_layer: nn.Module, name: str = ""):
        super().__init__()
        self.base_layer = base_layer
        self.layer_name = name
        self._base_call = None        # set by attach(): the layer's own forward, called directly
        self._prev_forward = None     # an instance forward another patch had set, restored on detach
        self._attached = False
        self.merge_refusal = ""       # set by the host: why this layer's weight must not be merged into
        self.restore_copy = False     # restore memory 'copy': a merge keeps a full copy of the weight
        self.merge_tier = Tier.EXACT  # set by the injector: lossless/high merges fold the factors
        self.requant_seed = 0         # set by the host: its stochastic-rounding seed for a quantized merge
        self._merged_folded = False   # whether the current merge folded them (its restore does too)
        self.slots: "OrderedDict[str, AdapterSlot]" = OrderedDict()
        self._restore: RestoreRecord | None = None
        self._merged_names: tuple[str, ...] = ()
        self._verified: tuple | None = None   # (fingerprint, weight identity[, full copy]) right after a restore
        self._stack_cache: dict = {}
        self._plan_cache: tuple | None = None
        self._plans: dict = {}                 # (context, device, dtype) -> call_plan.CallPlan
        self._last_plan = None                 # the plan of the last call (checked first)
        self._trace_plan = None                # call_plan.TracePlan: what a compiled call reads
        self._sibling = None                   # (shared_shrink.SiblingGroup, index) or None
        # [eager forwards run, weight patches the host applied at cast time] (ran_guard: did this
        # layer run?); a list, so counting on the hot path skips nn.Module.__setattr__
        self._counts = [0, 0]
        self._cast_patch = None                # (weight fn, bias fn or None) while patched at cast time
        self._cast_cache: dict = {}
        # set while the adapters are kept on between samplings (lora_runtime.resident): called with the
        # layer name by a forward outside any runtime context, it takes the kept state off first
        self.on_foreign_call = None

    # --- read-through to the wrapped layer -----------------------------------------
    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = self._modules.get("base_layer")
            if base is None:
                raise
            return getattr(base, name)

    # --- attach to / detach from the real layer ------------------------------------
    def attach(self) -> None:
        """Route the real layer's forward through this wrapper, in place (no renaming)."""
        layer = self.base_layer
        if attached_wrapper(layer) is not None:
            raise RuntimeError(f"{self.layer_name}: another LoRA runtime is attached to this layer; detach it first")
        prev = layer.__dict__.get("forward")
        self._prev_forward = prev
        self._base_call = prev if prev is not None else type(layer).forward.__get__(layer)
        object.__setattr__(layer, ATTR, self)
        layer.__dict__["forward"] = self.forward
        self._attached = True

    def detach(self) -> None:
        """Put the layer's previous forward back. If another patch chained on top of ours
        meanwhile, ours stays in its chain as a pass-through (adds nothing)."""
        if not self._attached:
            return
        self.on_foreign_call = None
        self.unpatch_at_cast()
        layer = self.base_layer
        if layer.__dict__.get("forward") == self.forward:
            if self._prev_forward is None:
                del layer.__dict__["forward"]
            else:
                layer.__dict__["forward"] = self._prev_forward
        layer.__dict__.pop(ATTR, None)
        self._attached = False

    def get_base_layer(self) -> nn.Module:
        layer = self.base_layer
        while hasattr(layer, "base_layer"):
            layer = layer.base_layer
        return layer

    # --- slot state ---------------------------------------------------------------
    def add_adapter(self, name: str, layer: "LayerAdapter", strength: float = 1.0, enabled: bool = True,
                    content_hash: str = "") -> None:
        if name in self.slots:
            raise ValueError(f"{self.layer_name}: adapter {name!r} is already attached")
        self._require_unmerged("add an adapter")
        self.slots[name] = AdapterSlot(name, layer, float(strength), enabled, content_hash=content_hash)
        self._weight_changed()

    def remove_adapter(self, name: str) -> None:
        self._require_unmerged("remove an adapter")
        del self.slots[name]
        self._invalidate()

    def set_strength(self, name: str, strength: float) -> None:
        self._require_unmerged("change a strength")
        self.slots[name].strength = float(strength)
        self._live_change()

    def set_enabled(self, name: str, enabled: bool) -> None:
        self._require_unmerged("enable/disable an adapter")
        self.slots[name].enabled = bool(enabled)
        self._live_change()

    def _live_change(self) -> None:
        prepared = self._trace_plan is not None
        self._invalidate()
        if prepared:  # a compiled model keeps reading a current trace plan
            self.prepare_trace()

    def set_slots(self, entries) -> None:
        """Make the slots exactly `entries`, in order: (name, layer, strength, enabled, content_hash).
        A slot whose layer is the same object keeps its caches and takes the new strength and flag."""
        self._require_unmerged("change the adapters")
        old = dict(self.slots)
        self.slots.clear()
        self._invalidate()
        for name, layer, strength, enabled, content_hash in entries:
            slot = old.get(name)
            if slot is not None and slot.layer is layer:
                slot.strength, slot.enabled = float(strength), bool(enabled)
                self.slots[name] = slot
            else:
                self.add_adapter(name, layer, strength, enabled, content_hash=content_hash)
        self._invalidate()

    def _weight_changed(self) -> None:
        """The base weight may differ from what weight-dependent updates (DoRA norms) cached:
        a new run, or a merge / restore here. Inference tensors keep no version counter, so
        the caches are cleared explicitly."""
        for s in self.slots.values():
            if s.update is not None and s.update.needs_weight:
                s.update.clear_cache()
        self._invalidate()

    def _invalidate(self) -> None:
        """Slot state changed: drop the stacked weights, the call plans and the trace plan (a
        compiled call takes the general path until `prepare_trace`)."""
        self._stack_cache.clear()
        self._cast_cache.clear()
        self._plan_cache = None
        self._plans.clear()
        self._last_plan = None
        self._trace_plan = None
        if self._sibling is not None:  # the group's pending h and concatenated A's read our old A
            self._sibling[0].reset()

    def prepare_trace(self) -> None:
        """Build what a compiled call reads (tensors only) for the current slot state; called
        after every state transition (`LoraInjector.apply`), never inside a trace."""
        self._trace_plan = call_plan.build_trace_plan(self)

    def _call_plan(self):
        """(weight slots not merged, slots with an output offset), cached until the state changes."""
        if self._plan_cache is None:
            self._plan_cache = (
                [s for s in self._weight_slots() if not s.merged],
                [s for s in self.slots.values() if s.contributes and s.update.diff_b is not None],
            )
        return self._plan_cache

    def _require_unmerged(self, what: str) -> None:
        if self.merged:
            raise RuntimeError(f"{self.layer_name}: unmerge before you {what}")

    @property
    def merged(self) -> bool:
        return self._restore is not None

    @property
    def has_output_offset(self) -> bool:
        return any(s.contributes and s.update.diff_b is not None for s in self.slots.values())

    @property
    def lora_active(self) -> bool:
        """Does this call add output to the wrapped layer's output right now?"""
        ctx = current_context()
        if (ctx is not None and ctx.scale == 0.0) or self._cast_patch is not None:
            return False  # patched at cast time: the host's weight already carries it
        return any(s.contributes and (not s.merged or s.update.diff_b is not None)
                   and (ctx is None or ctx.adapters is None or self.call_factor(s, ctx)[0] != 0.0)
                   for s in self.slots.values())

    # --- per-call factor of a slot (strength schedule, CFG branch) ---------------------
    def call_factor(self, s: AdapterSlot, ctx) -> tuple[float, "torch.Tensor | None"]:
        """Slot `s`'s runtime scale for this call and its row mask (fp32 [rows] of 0/1 over the
        call's batch, or None for every row): the context's scale times the adapter's scheduled
        multiplier, set per model call by the sampler hook (see schedule.py). Without a schedule
        this is (ctx.scale, None), the same float as before: no extra multiply, no extra bit."""
        return ctx.adapter_factor(s.name) if ctx is not None else (1.0, None)

    def call_has_row_mask(self) -> bool:
        """Does some live slot act on part of this call's rows only (a per-branch adapter in a
        batched CFG call)? Fused kernels take a per-rank scale, not a per-row one: such a call
        runs unfused (fusion_sites reports the route)."""
        ctx = current_context()
        if ctx is None or ctx.adapters is None:
            return False
        dyn, offsets = self._call_plan()
        return any(self.call_factor(s, ctx)[1] is not None for s in (*dyn, *offsets))

    # --- weight-space delta (merge, loss estimate, reference) ------------------------
    @property
    def is_conv(self) -> bool:
        return isinstance(self.get_base_layer(), _CONVS)

    @property
    def weight2d(self) -> torch.Tensor:
        """The weight as the [out, in * kernel] matrix the updates' deltas are written for, read
        through the layer (`base_weight`): a view when the weight is stored as floats (writes
        reach the layer's weight), else the layer's own dequantization (a copy; such a layer
        never merges)."""
        w = self.dense_weight
        return w.view(w.shape[0], -1) if w.dim() > 2 else w

    @property
    def dense_weight(self) -> torch.Tensor:
        """The weight the layer multiplies with, in its real shape (see `base_weight`)."""
        return base_weight(self.get_base_layer()).tensor

    def _weight_slots(self) -> list[AdapterSlot]:
        return [s for s in self.slots.values() if s.contributes and s.has_weight_delta]

    @torch.no_grad()
    def delta_rows(self, rows, slots: list[AdapterSlot] | None = None, fold: bool = False) -> torch.Tensor:
        """fp32 weight delta of `slots` (default: every contributing slot) for `rows`,
        times each slot's strength. Slots whose delta depends on the weight (DoRA) use the
        delta frozen at merge time while merged, so a restore subtracts what was added.
        `fold` (lossless/high merges): each slot's scale and strength applied as one product
        (`Update.folded_delta`); else one after the other, the `exact` order."""
        return self._delta_rows(self.weight2d, rows, self._weight_slots() if slots is None else slots, fold)

    def _chunk_deltas(self, w: torch.Tensor, slots: list[AdapterSlot], fold: bool):
        """`delta_rows` for merge / restore row chunks, with the weight read once (no per-chunk
        attribute walk; the caller holds no_grad)."""
        return lambda rows: self._delta_rows(w, rows, slots, fold)

    def _delta_rows(self, w: torch.Tensor, rows, slots: list[AdapterSlot], fold: bool) -> torch.Tensor:
        """A new tensor on every call (the merge writes into it): the updates' deltas are new
        tensors (`Update.delta`), a frozen delta is cloned."""
        out = None
        for s in slots:
            if s.frozen_delta is not None:
                d = s.frozen_delta[rows]
                out = d.clone() if out is None else out.add_(d)  # never write into the frozen delta
                continue
            weight = w if s.update.needs_weight else None
            if fold:
                d = s.update.folded_delta(w.device, s.strength, rows, weight=weight)
            else:
                d = times(s.update.delta(w.device, torch.float32, rows, weight=weight), s.strength, inplace=True)
            out = d if out is None else out.add_(d)
        if out is None:
            out = torch.zeros((w[rows].shape[0], w.shape[1]), dtype=torch.float32, device=w.device)
        return out

    @property
    def merge_folds(self) -> bool:
        """Does a merge here fold scale x strength into one product (lossless/high), or apply them in
        order (exact)? The rounding-loss estimate, the merge and its decision cache key follow it."""
        return self.merge_tier is not Tier.EXACT

    def rounding_loss_sums(self, max_rows: int = 1024) -> tuple[float, float]:
        fold = self.merge_folds   # the scaling the merge would use
        return rounding_loss_sums(self.weight2d, lambda r: self.delta_rows(r, None, fold), max_rows=max_rows,
                                  round_to=self.grid_round if self.quantized else None)

    @property
    def quantized(self) -> bool:
        """Is the weight host-quantized (a merge re-quantizes it on its layout's grid)?"""
        return quant_layout(self.get_base_layer().weight) is not None

    def grid_round(self, exact: torch.Tensor) -> torch.Tensor:
        """fp32 [out, in] values -> what a merge into this quantized weight would leave."""
        return quantized_merge.grid_round(self.get_base_layer().weight, exact, self.requant_seed)

    # --- merge / restore -------------------------------------------------------------
    def merge(self, only: set[str] | None = None) -> None:
        """Fold the delta of the contributing slots (those named in `only`, default all) into
        the weight with one rounding; the other slots stay dynamic."""
        ok, why = mergeable(self)
        if not ok:
            raise MergeRefusedError(f"{self.layer_name}: cannot merge ({why}); use merge mode 'dynamic'")
        if self.merged:
            return
        slots = [s for s in self._weight_slots() if only is None or s.name in only]
        if not slots:
            return
        if self.quantized:
            self._merge_quantized(slots)
            return
        bw = base_weight(self.get_base_layer())
        if not bw.writable:  # mergeable() judged it; a copy must never take a merge
            raise MergeRefusedError(f"{self.layer_name}: cannot merge ({bw.reason}); use merge mode 'dynamic'")
        own_storage(self.get_base_layer().weight)  # a GGUF file's read-only map is never written
        w = self.weight2d
        self._freeze_weight_deltas(slots, w)
        known, self._verified = self._verified, None
        if known is None or known[1] != _identity(w):
            known = None
        known_fp = known[0] if known is not None else None
        backup = known[2] if known is not None and len(known) > 2 and self.restore_copy else None
        try:
            fold = self.merge_folds
            self._restore = merge_weight(w, self._chunk_deltas(w, slots, fold), what=self.layer_name,
                                         known_fingerprint=known_fp, keep_copy=self.restore_copy, backup=backup,
                                         scratch_deltas=True)
        except BaseException:
            for s in slots:
                s.frozen_delta = None
            raise
        self._merged(slots, fold)

    @torch.no_grad()
    def _merge_quantized(self, slots: list[AdapterSlot]) -> None:
        """Merge into a quantized weight: the merged weight re-quantized into a new Parameter; the
        old Parameter (bytes and scales untouched) is the restore record."""
        base = self.get_base_layer()
        old = base.weight
        w = self.weight2d                     # fp32 dequantized copy
        self._freeze_weight_deltas(slots, w)
        try:
            fold = self.merge_folds
            exact = w.add_(self._delta_rows(w, slice(None), slots, fold))
            if not bool(torch.isfinite(exact).all()):
                raise NonFiniteMergeError(f"{self.layer_name}: the merged weight is not finite (inf/NaN); nothing "
                                          "was written. Lower the adapter's strength")
            new = quantized_merge.requantized(old, exact.reshape(old.shape), self.requant_seed)
        except BaseException:
            for s in slots:
                s.frozen_delta = None
            raise
        base.weight = nn.Parameter(new, requires_grad=False)
        self._restore = quantized_merge.QuantRestore(old)
        self._merged(slots, fold)

    def _merged(self, slots: list[AdapterSlot], fold: bool) -> None:
        """The weight holds `slots` now (`_restore` set); the restore recomputes the delta as the merge did."""
        self._merged_folded = fold
        for s in slots:
            s.merged = True
        self._merged_names = tuple(s.name for s in slots)
        self._weight_changed()

    def unmerge(self, remember: bool = False) -> None:
        """Restore the weight bit for bit (fingerprint-checked). `remember`: keep the verified
        fingerprint for the next `merge` of the same, untouched weight (a swap inside one
        state transition; the caller drops it with `forget_verified` when the transition ends),
        and a full copy the record kept, which then holds the weight's bits: a merge with
        restore memory ``copy`` takes it as its own copy instead of writing a new one."""
        if not self.merged:
            return
        slots = [self.slots[n] for n in self._merged_names]
        if isinstance(self._restore, quantized_merge.QuantRestore):
            self.get_base_layer().weight = self._restore.param  # the very Parameter it held: same bytes
            self._unmerged(slots)
            return
        w = self.weight2d
        fold = self._merged_folded
        record = self._restore
        fp = restore_weight(w, record, self._chunk_deltas(w, slots, fold), what=self.layer_name)
        self._unmerged(slots)
        if remember:
            self._verified = (fp, _identity(w)) if record.full is None else (fp, _identity(w), record.full)

    def _unmerged(self, slots: list[AdapterSlot]) -> None:
        """The weight is back: the slots are dynamic again, no record, no verified fingerprint."""
        for s in slots:
            s.merged = False
            s.frozen_delta = None
        self._restore = None
        self._merged_names = ()
        self._weight_changed()
        self._verified = None

    def _freeze_weight_deltas(self, slots: list[AdapterSlot], w: torch.Tensor) -> None:
        """A DoRA delta depends on the weight: taken from the weight before the merge writes."""
        for s in slots:
            if s.update.needs_weight:
                s.frozen_delta = times(s.update.delta(w.device, torch.float32, weight=w), s.strength, inplace=True)

    def forget_verified(self) -> None:
        self._verified = None

    @property
    def restore_bytes(self) -> int:
        return self._restore.nbytes if self._restore is not None else 0

    # --- forward ---------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if (self.on_foreign_call is not None and not torch.compiler.is_compiling()
                and _CURRENT.get() is None):
            self.on_foreign_call(self.layer_name)  # kept adapters come off before this call reads a weight
        if self._base_call is None:
            y = self.base_layer(x, *args, **kwargs)
        else:
            y = self._base_call(x, *args, **kwargs)
            if not self._attached:
                return y  # detached while another patch still chains through us
        if torch.compiler.is_compiling():  # traced: tensor factors, no context read (call_plan.py)
            return call_plan.traced_forward(self, x, y)
        self._counts[0] += 1
        if self._cast_patch is not None:
            return y  # the host added the adapters when it cast the weight
        ctx = _CURRENT.get()
        p = self._last_plan
        if p is None or p.ctx is not ctx or p.dtype is not x.dtype or p.device != x.device:
            p = self._plan_for(ctx, x)
        return y if p.run is None else p.run(x, y)

    def _plan_for(self, ctx, x: torch.Tensor):
        """The call plan for `ctx` and x's device/dtype (built once per slot state and context)."""
        key = (id(ctx), x.device, x.dtype)  # by identity (contexts compare by tier and scale only);
        p = self._plans.get(key)             # the plan holds its context, so the id stays valid
        if p is None or p.ctx is not ctx:
            if len(self._plans) >= 16:
                self._plans.clear()
            p = self._plans[key] = call_plan.build(self, ctx, x.device, x.dtype)
        self._last_plan = p
        return p

    def _call_selection(self, ctx):
        """(live weight slots, live offset slots, {name: (runtime scale, row mask)}) of a call in
        `ctx`; the slots scheduled to 0 there are left out (the call then gives the base bits)."""
        dyn, offsets = self._call_plan()
        if not dyn and not offsets or (ctx is not None and ctx.scale == 0.0):
            return [], [], {}
        # this call's runtime scale and row mask per slot: the context's scale, times a strength
        # schedule and a CFG-branch mask when the sampler set them (schedule.py)
        f = {s.name: self.call_factor(s, ctx) for s in (*dyn, *offsets)}
        if ctx is not None and ctx.adapters is not None:  # slots scheduled to 0 this call: base bits
            dyn = [s for s in dyn if f[s.name][0] != 0.0]
            offsets = [s for s in offsets if f[s.name][0] != 0.0]
        return dyn, offsets, f

    def _forward_general(self, x, y, ctx, dyn, offsets, f) -> torch.Tensor:
        """Every path (the plans' fallback): `dyn`, `offsets`, `f` from `_call_selection(ctx)`."""
        if self.is_conv:
            return self._conv_forward(x, y, dyn, offsets, f, ctx)
        if folds_scales(ctx):
            # an update that wants x W^T (DoRA, per-row norm) reads it off the base output before
            # anything is added to it (y - bias) instead of a second base GEMM; reference: recomputed
            first = [s for s in dyn if s.update.needs_base_output]
            y0 = self._base_out_nobias(y) if first else None
            first = [self._masked(self._slot_delta(x, s, f[s.name][0], ctx, y0=y0), f[s.name][1]) for s in first]
            stacked = [s for s in dyn if s.stackable]
            if stacked:  # one pair of GEMMs for every update that answers stack()
                f0 = f[stacked[0].name]
                if f0[1] is None and all(f[s.name] == f0 for s in stacked):
                    y = stacking.add_stacked(self, x, y, stacked, f0[0])  # uniform: scale rides as addmm_'s alpha
                else:
                    y = stacking.add_stacked_per_slot(self, x, y, stacked, [f[s.name] for s in stacked])
            for d in first:
                y = y.add_(d) if can_add_inplace(y) else y + d
            dyn = [s for s in dyn if not s.stackable and not s.update.needs_base_output]
        for s in dyn:
            # the delta is a fresh tensor, scaled in place; accumulate in place too (same bits)
            d = self._masked(self._slot_delta(x, s, f[s.name][0], ctx), f[s.name][1])
            y = y.add_(d) if can_add_inplace(y) else y + d
        return self._add_offsets(y, offsets, f, ctx)

    def _masked(self, d: torch.Tensor, mask) -> torch.Tensor:
        """The delta on the rows of this call's chosen CFG branch only (exact: the last factor)."""
        return d if mask is None else times(d, row_mask(mask, d, self.layer_name))

    def _add_offsets(self, y: torch.Tensor, offsets, f, ctx) -> torch.Tensor:
        """diff_b output offsets (cached and shared: never in place); on a conv, per channel."""
        for s in offsets:
            rs, mask = f[s.name]
            off = s.update.bias_delta(y.device, y.dtype)
            if self.is_conv:
                off = off.reshape(-1, *([1] * (y.dim() - 2)))
            off = scale_delta(off, (s.strength, rs), ctx)
            y = y + (off if mask is None else times(off, row_mask(mask, y, self.layer_name)))
        return y

    def base_bias_to_subtract(self) -> tuple[bool, torch.Tensor | None]:
        """How x W^T is read off the base output: (True, None) it is the output (no bias),
        (True, b) the output minus b, (False, None) it cannot be: the host patches the weight or
        bias per call (ComfyUI ``weight_function`` / ``bias_function``) or the bias is packed."""
        base = self.get_base_layer()
        if getattr(base, "weight_function", None) or getattr(base, "bias_function", None):
            return False, None
        b = self.bias
        if b is None:
            return True, None
        fb = float_view(b)
        return fb is not None, fb

    def _base_out_nobias(self, y: torch.Tensor) -> torch.Tensor | None:
        """x W^T read off the base output, or None (`base_bias_to_subtract`): then it is recomputed."""
        ok, fb = self.base_bias_to_subtract()
        if not ok:
            return None
        return y if fb is None else y - fb.to(y.device, y.dtype)

    def _slot_delta(self, x: torch.Tensor, s: AdapterSlot, rs: float, ctx, y0=None) -> torch.Tensor:
        """One slot's output delta (no diff_b). An update with a `stack()` pair, in `exact`:
        ((x A^T) B^T), then each non-unit factor (scale, strength, runtime scale) in order. Other
        updates: their own `forward`, then strength and runtime scale; in lossless/high their
        product goes into the update's forward (onto its small inner tensor)."""
        v = s.update
        st = v.stack(x.device, x.dtype)
        if st is not None:
            a, b, scale = st
            return scale_delta(F.linear(F.linear(x, a), b), (scale, s.strength, rs), ctx, inplace=True)
        w = self.dense_weight if v.needs_weight else None
        if folds_scales(ctx):
            return v.forward(x, combined_factor(s.strength, rs), base_out_nobias=y0, weight=w, include_bias=False)
        return scale_delta(v.forward(x, 1.0, weight=w, include_bias=False), (s.strength, rs), ctx, inplace=True)

    def _conv_forward(self, x, y, dyn, offsets, f, ctx):
        """Conv layers: each live slot's dense kernel delta (strength folded in, cached per
        strength/device/dtype: a patch embedding's kernel is small) through the layer's own
        convolution geometry, then its runtime scale and row mask."""
        conv = self.get_base_layer()
        shape = real_shape(conv.weight)
        fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(shape) - 2]
        for s in dyn:
            key = ("conv", s.name, s.strength, x.device, x.dtype)
            k = self._stack_cache.get(key)
            if k is None:
                d = times(s.update.delta(x.device, torch.float32), s.strength, inplace=True)
                k = self._stack_cache[key] = d.reshape(shape).to(x.dtype)
            rs, mask = f[s.name]
            d = scale_delta(fn(x, k, None, conv.stride, conv.padding, conv.dilation, conv.groups), (rs,), ctx,
                            inplace=True)
            d = self._masked(d, mask)
            y = y.add_(d) if can_add_inplace(y) else y + d
        return self._add_offsets(y, offsets, f, ctx)

    # --- adapters applied at cast time (ran_guard: a host path that skips this forward) ------------
    @property
    def watched(self) -> bool:
        """Does this layer add output the weight does not hold (a dynamic slot or an offset)?"""
        dyn, offsets = self._call_plan()
        return bool(dyn or offsets)

    @property
    def calls(self) -> int:
        """Eager forwards this wrapper ran."""
        return self._counts[0]

    @property
    def cast_calls(self) -> int:
        """Times the host applied this wrapper's cast-time weight patch."""
        return self._counts[1]

    @property
    def cast_patched(self) -> bool:
        return self._cast_patch is not None

    def patch_at_cast(self) -> str:
        """Move the dynamic adapters into the host's cast-time patches (``weight_function`` /
        ``bias_function``: W + delta when the host casts the weight, as its own LoRA does), so a
        host path that reads the weight without calling the layer sees them too; the forward then
        adds nothing. '' when done, else why it cannot be."""
        base = self.get_base_layer()
        wf, bf = getattr(base, "weight_function", None), getattr(base, "bias_function", None)
        if not isinstance(wf, list):
            return f"its {type(base).__name__} takes no weight patch at cast time"
        if self.is_conv:
            return "it is a convolution"
        if self._cast_patch is not None:
            return ""
        dyn, offsets = self._call_plan()
        if offsets and not isinstance(bf, list):
            return f"an output offset (diff_b) rides on it and its {type(base).__name__} takes no bias patch"

        def weight_fn(weight):
            self._counts[1] += 1
            return self._cast_added(weight, bias=False)

        def bias_fn(bias):
            return self._cast_added(bias, bias=True)

        wf.append(weight_fn)
        if offsets:
            bf.append(bias_fn)
        self._cast_patch = (weight_fn, bias_fn if offsets else None)
        self._cast_cache.clear()
        return ""

    def unpatch_at_cast(self) -> None:
        if self._cast_patch is None:
            return
        base = self.get_base_layer()
        wfn, bfn = self._cast_patch
        for lst, fn in ((getattr(base, "weight_function", None), wfn), (getattr(base, "bias_function", None), bfn)):
            if fn is not None and isinstance(lst, list) and fn in lst:
                lst.remove(fn)
        self._cast_patch = None
        self._cast_cache.clear()

    @torch.no_grad()
    def _cast_added(self, t: torch.Tensor, bias: bool) -> torch.Tensor:
        """The host's cast weight (or bias) plus this call's dynamic deltas (offsets), summed in
        fp32 and rounded once to the cast dtype."""
        ctx = _CURRENT.get()
        dyn, offsets, f = self._call_selection(ctx)
        slots = offsets if bias else dyn
        if not slots:
            return t
        masked = [s.name for s in slots if f[s.name][1] is not None]
        if masked:
            raise LoraRuntimeError(
                f"layer {self.layer_name!r}: the host computes it from its weight without calling the layer, so "
                f"adapter {masked[0]!r} is added to the weight, which cannot hold a per-branch (CFG) adapter. "
                "Set that adapter's branch to 'both'")
        key = (bias, t.device, tuple((s.name, f[s.name][0]) for s in slots))
        d = self._cast_cache.get(key)
        if d is None:
            if len(self._cast_cache) >= 8:
                self._cast_cache.clear()
            for s in slots:
                if bias:
                    e = s.update.bias_delta(t.device, torch.float32).clone()  # cached: never scaled in place
                else:
                    e = s.update.delta(t.device, torch.float32, weight=self.weight2d if s.update.needs_weight else None)
                e = times(times(e, s.strength, inplace=True), f[s.name][0], inplace=True)
                d = e if d is None else d.add_(e)
            d = self._cast_cache[key] = d.reshape(t.shape)
        return (t.to(torch.float32) + d).to(t.dtype)

    # --- the stacked low-rank pairs (the fast dynamic path, the fused kernels) -------------
    def stack(self, device, dtype):
        """What a LoRA-aware fused kernel takes for this call: (A_cat [R, in], B_cat [out, R],
        scale: a float or an fp32 [R] tensor including the runtime scale), or None when some live
        slot has no `stack()` pair, rides an offset or a per-row mask, or the layer is a conv."""
        return stacking.fused_stack(self, device, dtype)

    def unfusable_reason(self) -> str:
        """Why `stack` gives nothing right now (for the fusion report)."""
        if self.call_has_row_mask():
            return "a per-branch adapter in a CFG batch: the fused kernel takes a per-rank scale, not a per-row one"
        live, offsets = self._call_plan()
        kinds = sorted({s.update.kind for s in live if not s.stackable})
        if kinds:
            return f"{'/'.join(kinds)} update: a fused kernel takes plain LoRA only"
        if offsets:
            return "an output offset (diff_b) rides on the layer"
        if self.is_conv:
            return "a convolution"
        return "no live low-rank update"

    def extra_repr(self) -> str:
        return f"{self.layer_name}: " + ", ".join(
            f"{s.name}(s={s.strength}{', merged' if s.merged else ''}{'' if s.enabled else ', off'})"
            for s in self.slots.values())
