"""Adapters kept on a model between samplings, taken off exactly when anything else runs it.

A host that keeps a model loaded between samplings (ComfyUI) keeps its own patches in the
weights until it unloads the model or loads another patcher of the same weights. `held` gives
our adapters the same life:

- ``with held(model, p, key, cache) as report``: if the model holds a kept state with an equal
  `key` whose merged weights nobody replaced or wrote since, that state is resumed (no merge, no
  measurement; ``report.kept`` is True); else any kept state comes off bit for bit and `p` is
  applied. Inside: parameter deltas merged, fusion sites mounted, the runtime context entered,
  as with `applied`.
- normal exit: the wrappers and their merged weights stay (the kept state); parameter deltas,
  fusion sites and cast-time patches come off, and every wrapper is armed: the next forward of an
  adapted layer outside a runtime context takes the whole state off before it reads a weight, so
  a sampling of another MODEL on the same weights sees them as the file has them.
- exit by an error or an interrupt: everything comes off (the weights as the file has them),
  then the error propagates.
- `evict(model, why)` takes a kept state off (the host's unload, another MODEL's load), under
  inference mode (the host's weights may be inference tensors); a failure raises RestoreError and
  every later `held` on that model refuses it with the same message. `kept(model)` is the state or
  None.
- ``with applied(model, p, cache) as report``: `p` applied for one block (a kept state comes off
  first); on any exit everything comes off bit for bit.
"""
from __future__ import annotations

import contextlib
import logging
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Hashable

import torch
from torch import nn

from .apply import ApplyReport, LoraInjector, Plan, running
from .decision.cache import DecisionCache
from .errors import LoraRuntimeError, RestoreError
from .layer.base_weight import weight_identity
from .layer.shared_shrink import group_siblings

log = logging.getLogger(__name__)

_ATTR = "_lora_runtime_kept"
_FAILED_ATTR = "_lora_runtime_restore_failed"   # why the last evict failed: every later `held` refuses the model


@dataclass
class KeptState:
    """What stays on a model between samplings."""

    model: nn.Module = field(repr=False)
    key: Hashable = field(repr=False)
    plan: Plan = field(repr=False)
    injector: LoraInjector = field(repr=False)
    report: ApplyReport = field(repr=False)
    # the host handle that carries these adapters (ComfyUI: the patcher), held weakly: the state never
    # keeps a MODEL the host dropped alive, and taking it off never frees a host object (ComfyUI evicts
    # from inside its loop over loaded models, where a freed patcher runs finalizers that edit that list)
    owner: Any = field(default=None, repr=False)
    weights: dict = field(default_factory=dict, repr=False)   # layer -> (Parameter, identity) of each merged weight
    samplings: int = 0                # samplings that ran on this state

    def intact(self) -> str:
        """'' when every wrapper is attached and every merged weight is the tensor the merge left
        (same Parameter, storage and in-place write count); else what changed."""
        for name, w in self.injector.wrappers.items():
            if not w.attached or w.base_layer.__dict__.get("forward") != w.forward:
                return f"layer {name}: its forward was replaced since"
        for name, (param, ident) in self.weights.items():
            cur = self.injector.wrappers[name].get_base_layer().weight
            if cur is not param or weight_identity(cur) != ident:
                return f"layer {name}: its weight was replaced or written since"
        return ""

    def set_owner(self, owner) -> None:
        """Carried by `owner` now (None: by nobody); when that owner is freed, the state comes off."""
        if self.owner is not None:
            self.owner.detach()
            self.owner = None
        if owner is not None:
            self.owner = weakref.finalize(owner, _owner_freed, weakref.ref(self.model), weakref.ref(self))
            self.owner.atexit = False

    def arm(self) -> None:
        def foreign(layer: str) -> None:
            evict(self.model, f"layer {layer} ran outside a sampling that carries these adapters")
        for w in self.injector.wrappers.values():
            w.on_foreign_call = foreign

    def disarm(self) -> None:
        for w in self.injector.wrappers.values():
            w.on_foreign_call = None


def _merged_weights(inj: LoraInjector) -> dict:
    out = {}
    for name, w in inj.wrappers.items():
        if w.merged:
            p = w.get_base_layer().weight
            out[name] = (p, weight_identity(p))
    return out


def _owner_freed(model_ref, state_ref) -> None:
    """The host freed the MODEL that carried a kept state (ComfyUI dropped it from its caches)."""
    model, state = model_ref(), state_ref()
    if model is None or state is None or kept(model) is not state:
        return
    try:
        evict(model, "the MODEL that carried these adapters was freed")
    except LoraRuntimeError as e:  # a finalizer must not raise; the next sampling of the model says it
        log.error("LoRA runtime: %s", e)


def kept(model: nn.Module) -> KeptState | None:
    return model.__dict__.get(_ATTR)


def evict(model: nn.Module, why: str) -> bool:
    """Take the kept state off `model` bit for bit (every merged weight restored, every wrapper
    removed); False when there was none."""
    state = model.__dict__.pop(_ATTR, None)
    if state is None:
        return False
    state.disarm()
    state.set_owner(None)
    t0 = time.perf_counter()
    try:
        # a host may hold its weights as inference tensors (ComfyUI loads and samples under
        # inference mode) and unload outside it: in-place restores are allowed only inside
        with torch.inference_mode():
            state.injector.clear()
    except Exception as e:
        msg = (f"taking the LoRA adapters off this model failed ({why}): {type(e).__name__}: {e}. Its weights may "
               "still hold part of them: free the model and node cache (ComfyUI: Unload Models and Free model and "
               "node cache) so the checkpoint loads again")
        model.__dict__[_FAILED_ATTR] = msg
        raise RestoreError(msg) from e
    log.info("LoRA runtime: adapters taken off (%s) in %.1f ms after %d sampling(s)", why,
             (time.perf_counter() - t0) * 1e3, state.samplings)
    return True


def _resume(state: KeptState) -> ApplyReport:
    """Put the per-sampling parts back on a kept state: parameter deltas merged again, and the q/k/v
    groups regrouped (their partners are learned from the first calls, as after a fresh apply, so a
    resumed sampling computes the same bits as the first one)."""
    t0 = time.perf_counter()
    inj = state.injector
    inj.merge_params(inj.param_patches(state.plan))
    inj.sibling_groups = group_siblings(inj.wrappers, enabled=inj.share_shrink)  # the trace plans stay valid
    d = state.report.decision  # the decision that was kept: nothing measured (or noted) for this sampling
    d = replace(d, measured=0, cache_notes=[]) if d is not None else None
    return replace(state.report, decision=d, patch_seconds=time.perf_counter() - t0, kept=True, mounted=None,
                   fusions=[])


def _set_aside(state: KeptState) -> None:
    """The end of a sampling that went well: the per-sampling parts come off, the rest stays armed."""
    inj = state.injector
    for w in inj.wrappers.values():
        w.unpatch_at_cast()
    inj.restore_params()
    state.samplings += 1
    state.arm()


def _take(model: nn.Module, p: Plan, key: Hashable, cache: DecisionCache | None, owner) -> tuple[KeptState, ApplyReport]:
    failed = model.__dict__.get(_FAILED_ATTR)
    if failed:
        raise RestoreError(failed)
    state = kept(model)
    if state is not None:
        why = ("the adapters or their settings changed" if state.key != key else state.intact())
        if not why:
            state.disarm()
            state.set_owner(owner)
            return state, _resume(state)
        evict(model, why)
    inj = LoraInjector(model)
    try:
        report = inj.apply(p, cache)
    except BaseException:
        inj.clear()
        raise
    state = KeptState(model, key, p, inj, report, None, _merged_weights(inj))
    state.set_owner(owner)
    model.__dict__[_ATTR] = state
    return state, report


@contextlib.contextmanager
def held(model: nn.Module, p: Plan, key: Hashable, cache: DecisionCache | None = None, *, owner=None,
         fusion_backend: str | None = "auto"):
    """`applied` for a model the host keeps loaded: see the module docstring."""
    state, report = _take(model, p, key, cache, owner)
    ok = False
    try:
        with running(model, report, p.tier, fusion_backend):
            yield report
        ok = True
    finally:
        if ok and kept(model) is state:
            try:
                _set_aside(state)
            except BaseException:
                evict(model, "setting the adapters aside after the sampling failed")
                raise
        else:
            evict(model, "the sampling ended with an error or an interrupt")


@contextlib.contextmanager
def applied(model: nn.Module, p: Plan, cache: DecisionCache | None = None, injector: LoraInjector | None = None,
            *, fusion_backend: str | None = "auto"):
    """Apply `p` and mount the fusions its tier admits for the duration of the block.

    On exit, also on error or interrupt: fusions unmounted, merged weights restored
    bit for bit, wrappers removed. ``fusion_backend=None`` mounts no fusion.
    """
    evict(model, "adapters were applied to this model for one block")  # a kept state comes off first
    inj = injector or LoraInjector(model)
    try:
        report = inj.apply(p, cache)
        with running(model, report, p.tier, fusion_backend):
            yield report
    finally:
        inj.clear()
