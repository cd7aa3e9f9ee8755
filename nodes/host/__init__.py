"""The one module the nodes talk to: real ComfyUI when present, else the bundled host.

Real ComfyUI is detected by `comfy.model_management` being importable (the pack
sits in `ComfyUI/custom_nodes/`). Everything the nodes need goes through these
functions, so node code never cares which host runs it:

- `lora_names()`, `resolve_lora(name)`: the `loras` model folder;
- `diffusion_model(model)`: the nn.Module inside a MODEL (patcher);
- `apply_clip_lora(clip, adapter, strength)`: the adapter's text-encoder layers on a clone
  of a CLIP, as the host's own LoraLoader applies them -> (clip, applied, skipped);
- `sample(model, ...)`: the host's KSampler (seeded noise, sigmas, sampler) -> LATENT;
- `sampler_names()`, `scheduler_names()`;
- `InterruptProcessingException`: what an interrupt raises through sampling;
- `has_wrappers(model, key)`, `add_wrappers(model, key, sampler_fn, model_call_fn)`: the
  patcher's SAMPLER_SAMPLE hook (nodes/lifecycle.py rides on it) and its APPLY_MODEL hook,
  once per model call, whose transformer_options carry that call's ``sigmas`` and
  ``cond_or_uncond`` (strength schedules, branches). Both hosts' patchers have the same
  wrapper API; only the hook names come from the host;
- `add_detach_callback(model, key, fn)`: ``fn(patcher, unpatch_all)`` when the host detaches that
  loaded MODEL (an unload, or a load of it or of another clone of its base); clones inherit it;
- `add_deepclone_callback(model, key, fn)`: ``fn(patcher, clone)`` when the host deep-clones that MODEL
  onto a fresh copy of its model for another device (multi-GPU); nothing on a host without it;
- `requant_seed(layer)`: the host's stochastic-rounding seed for a merge into a quantized weight
  (0: round to nearest);
- `send_report(report)`: a runtime report for the node that is executing (the web
  extension shows it on that node; the bundled host hands it to its listeners).
"""
from __future__ import annotations

import importlib.util


def _real_comfyui_present() -> bool:
    try:
        return importlib.util.find_spec("comfy") is not None and importlib.util.find_spec(
            "comfy.model_management") is not None
    except (ImportError, ValueError):
        return False


REAL_COMFYUI = _real_comfyui_present()

if REAL_COMFYUI:
    from .comfy_host import (APPLY_MODEL, ON_DEEPCLONE_MULTIGPU, ON_DETACH, OUTER_SAMPLE, PREPARE_SAMPLING, SAMPLER_SAMPLE, InterruptProcessingException,  # noqa: F401
                             apply_clip_lora, diffusion_model, lora_names, resolve_lora, sample, sampler_names,
                             requant_seed, scheduler_names, send_report)
    NAME = "comfyui"
else:
    from .bundled_host import (APPLY_MODEL, ON_DEEPCLONE_MULTIGPU, ON_DETACH, OUTER_SAMPLE, PREPARE_SAMPLING, SAMPLER_SAMPLE, InterruptProcessingException,  # noqa: F401
                               apply_clip_lora, diffusion_model, lora_names, resolve_lora, sample, sampler_names,
                               requant_seed, scheduler_names, send_report)
    NAME = "bundled"


def has_wrappers(model, key: str) -> bool:
    """Does `model` carry the sampling wrapper registered under `key`?"""
    return bool(model.get_wrappers(SAMPLER_SAMPLE, key))


def add_wrappers(model, key: str, sampler_fn, model_call_fn, outer_fn=None, prepare_fn=None) -> None:
    """Register `sampler_fn` on the SAMPLER_SAMPLE hook, `model_call_fn` on the APPLY_MODEL hook,
    and `outer_fn` / `prepare_fn` on the OUTER_SAMPLE / PREPARE_SAMPLING hooks of `model` under
    `key`, each once (clones inherit them)."""
    for hook, fn in ((SAMPLER_SAMPLE, sampler_fn), (APPLY_MODEL, model_call_fn), (OUTER_SAMPLE, outer_fn),
                     (PREPARE_SAMPLING, prepare_fn)):
        if fn is not None and not model.get_wrappers(hook, key):
            model.add_wrapper_with_key(hook, key, fn)


def add_detach_callback(model, key: str, fn) -> None:
    """Register `fn(patcher, unpatch_all)` on the patcher's ON_DETACH callbacks under `key`, once."""
    if not model.get_callbacks(ON_DETACH, key):
        model.add_callback_with_key(ON_DETACH, key, fn)


def add_deepclone_callback(model, key: str, fn) -> None:
    """Register `fn(patcher, clone)` on the patcher's ON_DEEPCLONE_MULTIGPU callbacks under `key`, once
    (a host without multi-GPU deep clones: nothing)."""
    if ON_DEEPCLONE_MULTIGPU is not None and not model.get_callbacks(ON_DEEPCLONE_MULTIGPU, key):
        model.add_callback_with_key(ON_DEEPCLONE_MULTIGPU, key, fn)
