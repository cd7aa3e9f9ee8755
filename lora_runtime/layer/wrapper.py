"""AdaptedLayer: the adapters of one Linear, cast Linear or convolution, N at a time.

Contract
- Attached, not inserted: ``attach()`` sets an instance ``forward`` on the real layer (chaining
  any instance forward already there) and records itself as ``layer._lora_runtime``; the module
  tree, state dict and the host's Parameters are unchanged; ``detach()`` puts the forward back.
  ``weight``, ``bias`` and every other attribute read through to the wrapped layer.
- Adapters live in ``slots`` (insertion order, `slots.AdapterSlot`); they change only through
  `add_adapter` / `set_slots` and the setters, which drop everything derived from them: the
  stacked factors (``factor_cache``), the call plans and the traced factors (``traced_factors``).
- A call: ``y = base(x)`` plus what the call plan for (slot state, context, device, dtype)
  says (`call_plan`); a compiled call reads ``traced_factors`` instead (`traced`); a fused kernel takes
  ``fused_factors(x)``, read off the same plan. ``diff_b`` offsets are added at run time even when the
  weight is merged. A runtime scale of 0.0 returns the base output.
- ``merge()`` / ``unmerge()``: `weight_merge` (one rounding in, bit for bit out); ``patch_at_cast()``:
  `cast_patch` (the host adds the adapters when it casts the weight; the forward adds nothing).
The paths and their numerics: docs/engine.md.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import call_plan, cast_patch, quantized_merge, traced, weight_merge
from .base_weight import base_weight, float_view, quant_layout
from .merge import rounding_loss_sums
from .runtime_context import _CURRENT, current_context
from .slots import AdapterSlot
from ..settings import Tier

if TYPE_CHECKING:
    from ..files.layer_adapter import LayerAdapter

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
ATTR = "_lora_runtime"


def attached_wrapper(layer: nn.Module) -> "AdaptedLayer | None":
    """The AdaptedLayer attached to `layer` (by `attach`), or None."""
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


class AdaptedLayer(nn.Module):
    is_lora_wrapper = True

    def __init__(self, base_layer: nn.Module, name: str = ""):
        super().__init__()
        self.base_layer = base_layer
        self.layer_name = name
        self._base_call = None        # set by attach(): the layer's own forward, called directly
        self._prev_forward = None     # an instance forward another patch had set, restored on detach
        self.attached = False
        self.merge_refusal = ""       # set by the host: why this layer's weight must not be merged into
        self.restore_copy = False     # restore memory 'copy': a merge keeps a full copy of the weight
        self.merge_tier = Tier.EXACT  # set by the injector: lossless/high merges fold the factors
        self.requant_seed = 0         # set by the host: its stochastic-rounding seed for a quantized merge
        self.slots: "OrderedDict[str, AdapterSlot]" = OrderedDict()
        self.merge_state = weight_merge.MergeState()
        # derived from the slots, dropped on every change (`_invalidate`)
        self.factor_cache: dict = {}           # stacked pairs, conv kernels, per-rank factors
        self._live = None                      # live_slots()
        self._plans: dict = {}                 # (context, device, dtype) -> call_plan.CallPlan
        self._last_plan = None                 # the plan of the last call (checked first)
        self.traced_factors = None             # traced.TracedFactors: what a compiled call reads
        self.sibling = None                    # (shared_shrink.SiblingGroup, index) or None
        # [eager forwards run, weight patches the host applied at cast time] (ran_guard: did this
        # layer run?); a list, so counting on the hot path skips nn.Module.__setattr__
        self.counts = [0, 0]
        self.cast_patch = None                 # cast_patch.CastPatch while patched at cast time
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
        self.attached = True

    def detach(self) -> None:
        """Put the layer's previous forward back. If another patch chained on top of ours
        meanwhile, ours stays in its chain as a pass-through (adds nothing)."""
        if not self.attached:
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
        self.attached = False

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
        self.weight_changed()

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
        prepared = self.traced_factors is not None
        self._invalidate()
        if prepared:  # a compiled model keeps reading current traced factors
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

    def weight_changed(self) -> None:
        """The base weight may differ from what weight-dependent updates (DoRA norms) cached (a
        new run, a merge / restore): their caches are cleared (inference tensors keep no version)."""
        for s in self.slots.values():
            if s.update is not None and s.update.needs_weight:
                s.update.clear_cache()
        self._invalidate()

    def _invalidate(self) -> None:
        """Slot state changed: drop the stacked factors, the call plans and the traced factors (a
        compiled call takes the general path until `prepare_trace`)."""
        self.factor_cache.clear()
        if self.cast_patch is not None:
            self.cast_patch.cache.clear()
        self._live = None
        self.drop_plans()
        self.traced_factors = None
        if self.sibling is not None:  # the group's pending h and concatenated A's read our old A
            self.sibling[0].reset()

    def drop_plans(self) -> None:
        """Forget the call plans (a plan captures the sibling group: regrouping drops them too)."""
        self._plans.clear()
        self._last_plan = None

    def prepare_trace(self) -> None:
        """Build what a compiled call reads (tensors only) for the current slot state; called
        after every state transition (`LoraInjector.apply`), never inside a trace."""
        self.traced_factors = traced.build(self)

    def live_slots(self):
        """(weight slots not merged, slots with an output offset), cached until the state changes."""
        if self._live is None:
            self._live = (
                [s for s in self.weight_slots() if not s.merged],
                [s for s in self.slots.values() if s.contributes and s.update.diff_b is not None],
            )
        return self._live

    def weight_slots(self) -> list[AdapterSlot]:
        """The contributing slots with a weight delta (merged or not)."""
        return [s for s in self.slots.values() if s.contributes and s.has_weight_delta]

    def _require_unmerged(self, what: str) -> None:
        if self.merged:
            raise RuntimeError(f"{self.layer_name}: unmerge before you {what}")

    merged = property(lambda self: self.merge_state.restore is not None)
    has_output_offset = property(lambda self: any(s.contributes and s.update.diff_b is not None
                                                  for s in self.slots.values()))

    @property
    def lora_active(self) -> bool:
        """Does this call add output to the wrapped layer's output right now?"""
        ctx = current_context()
        if (ctx is not None and ctx.scale == 0.0) or self.cast_patch is not None:
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

    def call_has_row_mask(self, ctx=None) -> bool:
        """Does some live slot act on part of the call's rows only (a per-branch adapter in a
        batched CFG call) in `ctx` (default: the current context)? Fused kernels take a per-rank
        scale, not a per-row one: such a call runs unfused (fusion_sites reports the route)."""
        ctx = current_context() if ctx is None else ctx
        if ctx is None or ctx.adapters is None:
            return False
        dyn, offsets = self.live_slots()
        return any(self.call_factor(s, ctx)[1] is not None for s in (*dyn, *offsets))

    # --- the weight (merge, loss estimate, reference) --------------------------------
    is_conv = property(lambda self: isinstance(self.get_base_layer(), _CONVS))

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

    def base_bias_to_subtract(self) -> tuple[bool, torch.Tensor | None]:
        """How x W^T is read off the base output: (True, None) it is the output (no bias),
        (True, b) the output minus b, (False, None) it cannot be: the host patches the weight or
        bias per call (ComfyUI ``weight_function`` / ``bias_function``, dynamic VRAM's
        ``*_lowvram_function``) or the bias is packed."""
        base = self.get_base_layer()
        if (getattr(base, "weight_function", None) or getattr(base, "bias_function", None)
                or getattr(base, "weight_lowvram_function", None) is not None
                or getattr(base, "bias_lowvram_function", None) is not None):
            return False, None
        b = self.bias
        if b is None:
            return True, None
        fb = float_view(b)
        return fb is not None, fb

    @torch.no_grad()
    def delta_rows(self, rows, slots: list[AdapterSlot] | None = None, fold: bool = False) -> torch.Tensor:
        """fp32 weight delta of `slots` (default: every contributing slot) for `rows`, times each
        slot's strength (`weight_merge.delta_rows`; `fold`: lossless/high's one product)."""
        slots = self.weight_slots() if slots is None else slots
        # a quantized weight is dequantized only when an update reads its values (DoRA): the others
        # need its device alone
        reads = not slots or any(s.frozen_delta is None and s.update.needs_weight for s in slots)
        return weight_merge.delta_rows(self.weight2d if reads else self.get_base_layer().weight, rows, slots, fold)

    merge_folds = property(lambda self: self.merge_tier is not Tier.EXACT, doc=(
        "Does a merge here fold scale x strength into one product (lossless/high) or apply them in order "
        "(exact)? The rounding-loss estimate, the merge and its decision cache key follow it."))

    def rounding_loss_sums(self, max_rows: int = 1024) -> tuple[float, float]:
        fold = self.merge_folds   # the scaling the merge would use
        return rounding_loss_sums(self.weight2d, lambda r: self.delta_rows(r, None, fold), max_rows=max_rows,
                                  round_to=self.grid_round if self.quantized else None)

    quantized = property(lambda self: quant_layout(self.get_base_layer().weight) is not None,
                         doc="Is the weight host-quantized (a merge re-quantizes it on its layout's grid)?")

    def grid_round(self, exact: torch.Tensor) -> torch.Tensor:
        """fp32 [out, in] values -> what a merge into this quantized weight would leave."""
        return quantized_merge.grid_round(self.get_base_layer().weight, exact, self.requant_seed)

    def merge(self, only: set[str] | None = None) -> None:
        """Fold the contributing slots (those named in `only`, default all) into the weight."""
        weight_merge.merge(self, only)

    def unmerge(self, remember: bool = False) -> None:
        """Restore the weight bit for bit (`weight_merge.unmerge`)."""
        weight_merge.unmerge(self, remember)

    def forget_verified(self) -> None:
        self.merge_state.verified = None

    restore_bytes = property(lambda self: 0 if self.merge_state.restore is None else self.merge_state.restore.nbytes)

    # --- forward ---------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if (self.on_foreign_call is not None and not torch.compiler.is_compiling()
                and _CURRENT.get() is None):
            self.on_foreign_call(self.layer_name)  # kept adapters come off before this call reads a weight
        if self._base_call is None:
            y = self.base_layer(x, *args, **kwargs)
        else:
            y = self._base_call(x, *args, **kwargs)
            if not self.attached:
                return y  # detached while another patch still chains through us
        if torch.compiler.is_compiling():  # traced: tensor factors, no context read (traced.py)
            return traced.traced_forward(self, x, y)
        self.counts[0] += 1
        if self.cast_patch is not None:
            return y  # the host added the adapters when it cast the weight
        ctx = _CURRENT.get()
        p = self._last_plan
        if p is None or p.ctx is not ctx or p.dtype is not x.dtype or p.device != x.device:
            p = self.plan_for(ctx, x.device, x.dtype)
        return y if p.run is None else p.run(x, y)

    def plan_for(self, ctx, device, dtype) -> call_plan.CallPlan:
        """The call plan for `ctx` on `device`/`dtype` (built once per slot state and context)."""
        key = (id(ctx), device, dtype)  # by identity (contexts compare by tier and scale only);
        p = self._plans.get(key)         # the plan holds its context, so the id stays valid
        if p is None or p.ctx is not ctx:
            if len(self._plans) >= 16:
                self._plans.clear()
            p = self._plans[key] = call_plan.build(self, ctx, device, dtype)
        self._last_plan = p
        return p

    # --- adapters applied at cast time (ran_guard: a host path that skips this forward) ------------
    @property
    def watched(self) -> bool:
        """Does this layer add output the weight does not hold (a dynamic slot or an offset)?"""
        dyn, offsets = self.live_slots()
        return bool(dyn or offsets)

    calls = property(lambda self: self.counts[0], doc="Eager forwards this wrapper ran.")
    cast_calls = property(lambda self: self.counts[1], doc="Times the host applied the cast-time weight patch.")
    cast_patched = property(lambda self: self.cast_patch is not None)

    def patch_at_cast(self) -> str:
        """Move the dynamic adapters into the host's cast-time patches (`cast_patch`); '' when
        done, else why it cannot be."""
        return cast_patch.patch_at_cast(self)

    def unpatch_at_cast(self) -> None:
        cast_patch.unpatch_at_cast(self)

    # --- what a fused kernel takes --------------------------------------------------
    def fused_factors(self, x: torch.Tensor):
        """What a LoRA-aware fused kernel takes for this call on `x` (the call plan's `fused`);
        None when some live update cannot be fused (`stacking.unfusable_reason` says why)."""
        return self.plan_for(current_context(), x.device, x.dtype).fused(x)

    def extra_repr(self) -> str:
        return f"{self.layer_name}: " + ", ".join(
            f"{s.name}(s={s.strength}{', merged' if s.merged else ''}{'' if s.enabled else ', off'})"
            for s in self.slots.values())

