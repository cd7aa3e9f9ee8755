"""Adapters applied when the host casts the weight (a host path that reads the weight without
calling the layer sees them too).

Contract
- `patch_at_cast(layer)`: appends a weight patch (and a bias patch when an output offset rides
  on the layer) to the wrapped layer's ``weight_function`` / ``bias_function`` lists, as the
  host's own LoRA does: W + this call's dynamic deltas, summed in fp32 and rounded once to the
  cast dtype; sets ``layer.cast_patch`` (the layer's forward then adds nothing). '' when done,
  else why it cannot be. `unpatch_at_cast(layer)` takes the patches off again.
- A per-branch (CFG) adapter cannot ride on a weight: the patch raises at cast time.
"""
from __future__ import annotations

import torch

from ..errors import LoraRuntimeError
from ..scaling import times
from .base_weight import instance_list
from .general_path import select
from .runtime_context import current_context


class CastPatch:
    """The patch functions a layer put on its wrapped layer, and their summed deltas (cached)."""
    __slots__ = ("weight_fn", "bias_fn", "cache")

    def __init__(self, weight_fn, bias_fn, cache: dict):
        self.weight_fn, self.bias_fn, self.cache = weight_fn, bias_fn, cache


def patch_at_cast(layer) -> str:
    base = layer.get_base_layer()
    if not isinstance(getattr(base, "weight_function", None), list):
        return f"its {type(base).__name__} takes no weight patch at cast time"
    if layer.is_conv:
        return "it is a convolution"
    if layer.cast_patch is not None:
        return ""
    dyn, offsets = layer.live_slots()
    if offsets and not isinstance(getattr(base, "bias_function", None), list):
        return f"an output offset (diff_b) rides on it and its {type(base).__name__} takes no bias patch"
    wf = instance_list(base, "weight_function")   # never the list a class shares with all its layers
    bf = instance_list(base, "bias_function") if offsets else None

    cache: dict = {}

    def weight_fn(weight):
        layer.counts[1] += 1
        return _cast_added(layer, cache, weight, bias=False)

    def bias_fn(bias):
        return _cast_added(layer, cache, bias, bias=True)

    wf.append(weight_fn)
    if offsets:
        bf.append(bias_fn)
    layer.cast_patch = CastPatch(weight_fn, bias_fn if offsets else None, cache)
    return ""


def unpatch_at_cast(layer) -> None:
    patch = layer.cast_patch
    if patch is None:
        return
    base = layer.get_base_layer()
    for lst, fn in ((getattr(base, "weight_function", None), patch.weight_fn),
                    (getattr(base, "bias_function", None), patch.bias_fn)):
        if fn is not None and isinstance(lst, list) and fn in lst:
            lst.remove(fn)
    layer.cast_patch = None


@torch.no_grad()
def _cast_added(layer, cache: dict, t: torch.Tensor, bias: bool) -> torch.Tensor:
    """The host's cast weight (or bias) plus this call's dynamic deltas (offsets), summed in
    fp32 and rounded once to the cast dtype."""
    dyn, offsets, f = select(layer, current_context())
    slots = offsets if bias else dyn
    if not slots:
        return t
    masked = [s.name for s in slots if f[s.name][1] is not None]
    if masked:
        raise LoraRuntimeError(
            f"layer {layer.layer_name!r}: the host computes it from its weight without calling the layer, so "
            f"adapter {masked[0]!r} is added to the weight, which cannot hold a per-branch (CFG) adapter. "
            "Set that adapter's branch to 'both'")
    key = (bias, t.device, tuple((s.name, f[s.name][0]) for s in slots))
    d = cache.get(key)
    if d is None:
        if len(cache) >= 8:
            cache.clear()
        for s in slots:
            if bias:
                e = s.update.bias_delta(t.device, torch.float32).clone()  # cached: never scaled in place
            else:
                e = s.update.delta(t.device, torch.float32, weight=layer.weight2d if s.update.needs_weight else None)
            e = times(times(e, s.strength, inplace=True), f[s.name][0], inplace=True)
            d = e if d is None else d.add_(e)
        d = cache[key] = d.reshape(t.shape)
    return (t.to(torch.float32) + d).to(t.dtype)
