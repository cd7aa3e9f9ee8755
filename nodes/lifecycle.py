"""The LoRA runtime around every sampler that samples a MODEL our nodes touched.

Our nodes record an `Intent` on a MODEL clone (`with_changes`) and `register` this module's wrappers on it. They
ride on the ModelPatcher hooks (ComfyUI's and the bundled host's), so every sampler runs the same
lifecycle (docs/lifecycle.md): OUTER_SAMPLE plans and checks the schedules; PREPARE_SAMPLING,
after the host loaded the model, resumes the kept state or applies; SAMPLER_SAMPLE samples and
reports. A host path without the first two hooks gets plan, apply and restore around
SAMPLER_SAMPLE alone (nothing kept).

Contract
- `register(patcher)` is idempotent; clones inherit the wrappers, each clone its own Intent.
- The wrappers read the Intent of the patcher being sampled; no adapters and the default tier:
  they call straight through.
- A sampling that ends normally keeps its adapters on the loaded model (`resident.held`); the
  host's unload, another MODEL's load on the same weights, a forward outside our samplings, an
  error, interrupt or out-of-memory take them off bit for bit; an error then propagates unchanged.
- A multi-GPU deep clone (the host's ON_DEEPCLONE_MULTIGPU) keeps the intent and wrappers (a clone's) and
  shares the source model's decisions; it samples what the source samples.
- The report is stored on the patcher (`last_report`), logged, and sent to the frontend for the
  node that is executing (`host.send_report`).
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from dataclasses import replace

from . import host
from ..lora_runtime import applied, compile_watch, plan_intent, resident
from ..lora_runtime.fusion import fusion_sites  # noqa: F401  with the pack, as the host loads its nodes: the first
#                                                sampling would pay this import (the kernels' modules, ~25 ms)
from ..lora_runtime.errors import LoraRuntimeError
from ..lora_runtime.intent import Intent
from ..lora_runtime.layer import ran_guard
from ..lora_runtime.layer.base_weight import staged_reason
from ..lora_runtime.layer.schedule import Branch, SamplingSchedules, model_call_context, sampling_schedules
from ..lora_runtime.layer.wrapper import attached_wrapper
from . import report as report_mod
from .caches import ADAPTERS, decision_cache_for, share_decisions

log = logging.getLogger(__name__)

WRAPPER_KEY = "comfyui_lora_runtime"
INTENT_KEY = "lora_runtime"   # model_options key of a MODEL's Intent
_FIRST_CALL: contextvars.ContextVar = contextvars.ContextVar("lora_runtime_first_call", default=None)


class _FirstCall:
    """The ran check of one sampling: done on its first model call (ran_guard); `since`: the
    wrappers' counts when the adapters went on, if that was before the sampler started."""

    def __init__(self, dm, since: dict | None = None):
        self.dm = dm
        self.since = since
        self.done = False
        self.findings: list[dict] = []
_REPORT_ATTR = "_lora_runtime_report"


def is_registered(patcher) -> bool:
    return host.has_wrappers(patcher, WRAPPER_KEY)


def read(model) -> Intent:
    """The Intent our nodes recorded on `model` (``model_options["lora_runtime"]``); an empty one if none.
    ComfyUI copies model_options on clone (0.3.64 deep-copies it, newer versions share other objects:
    an immutable Intent is safe under both), so each branch of a graph keeps its own intent."""
    found = (getattr(model, "model_options", None) or {}).get(INTENT_KEY)
    if found is None:
        return Intent()
    if not isinstance(found, Intent):
        raise TypeError(f"model_options[{INTENT_KEY!r}] holds a {type(found).__name__}, not a LoRA runtime Intent; "
                        "another node wrote to this key")
    return found


def with_changes(model, **changes):
    """A registered clone of `model` whose intent has `changes` applied (text settings parsed by
    `Intent`); `model` is untouched."""
    new = replace(read(model), **changes)  # a bad setting raises here, before anything is cloned
    clone = model.clone()
    clone.model_options[INTENT_KEY] = new
    register(clone)
    return clone


def register(patcher) -> None:
    """Make every sampling of `patcher` (and of its later clones) run the LoRA runtime."""
    compile_watch.install()  # a torch.compile recompile-limit fallback is named on the report
    host.add_wrappers(patcher, WRAPPER_KEY, sampler_sample_wrapper, apply_model_wrapper,
                      outer_sample_wrapper, prepare_sampling_wrapper)
    host.add_detach_callback(patcher, WRAPPER_KEY, on_detach)
    host.add_deepclone_callback(patcher, WRAPPER_KEY, on_deepclone)


def on_deepclone(patcher, clone) -> None:
    """The host deep-cloned a MODEL of ours onto a freshly loaded copy of its model for another device
    (multi-GPU). The clone already carries our intent, wrappers and callbacks (a clone's); its model
    is remembered with its diffusion model (the host's key map) and shares the source's decisions."""
    try:
        source = patcher.get_model_object("diffusion_model")
        target = host.diffusion_model(clone)
    except AttributeError:
        return
    share_decisions(source, target)


def last_report(patcher) -> dict | None:
    """The report of the last sampling of this exact MODEL object, or None."""
    return getattr(patcher, _REPORT_ATTR, None)


def clear_report(patcher) -> None:
    setattr(patcher, _REPORT_ATTR, None)


def store_report(patcher, report: dict) -> None:
    """Keep `report` as the last report of this MODEL object (a sampler that sampled a clone of it)."""
    setattr(patcher, _REPORT_ATTR, report)


COMFY_PATCHED = ("ComfyUI patch beside ours: ComfyUI patches this weight itself (a LoraLoader or other model "
                 "patch upstream) and may put its own backup back into it if it offloads the layer mid-run, so "
                 "our adapter stays dynamic on it")
RESTAGED = ("re-staged at every load (dynamic VRAM): ComfyUI's dynamic VRAM loader copies this weight to the "
            "device at every load and puts its own backup back first, so a merge kept between runs would be "
            "dropped; the adapter runs dynamic")


def is_dynamic_vram(patcher) -> bool:
    """Does the host stage this MODEL's weights itself (ComfyUI's ModelPatcherDynamic)?"""
    fn = getattr(patcher, "is_dynamic", None)
    return bool(fn()) if callable(fn) else False


def dynamic_vram_refusal(name: str, module) -> str:
    """Why a layer of a MODEL under ComfyUI's dynamic VRAM takes no merge, asked after the host loaded
    it: a weight staged through the virtual VRAM bar is streamed; any other one (a small weight the
    loader copies to the device at every load, from its backup) is re-staged (docs/dynamic_vram.md)."""
    return staged_reason(module) or RESTAGED


def host_patched_layers(patcher) -> dict[str, str]:
    """Layers whose weight the host patches itself (ComfyUI ``patcher.patches`` keys
    ``diffusion_model.<layer>.weight``): a merge there is refused, the layer stays dynamic."""
    out = {}
    for key in getattr(patcher, "patches", None) or {}:
        k = key[0] if isinstance(key, tuple) else key
        if isinstance(k, str) and k.startswith("diffusion_model.") and k.endswith(".weight"):
            out[k[len("diffusion_model."):-len(".weight")]] = COMFY_PATCHED
    return out


def _wrappers(dm) -> list:
    return [w for m in dm.modules() for w in [attached_wrapper(m)] if w is not None]


def _plan(patcher, want):
    """The plan of `want` on `patcher`'s diffusion model (loads and matches the adapters; touches nothing)."""
    dm = host.diffusion_model(patcher)  # remembered with its host model: that model's key map places the keys
    p = plan_intent(dm, want, loader=ADAPTERS.load)
    p.merge_refusals = host_patched_layers(patcher)
    p.requant_seed = host.requant_seed
    if is_dynamic_vram(patcher):  # every weight is staged by the host: nothing is merged (per layer on the report)
        p.layer_refusal = dynamic_vram_refusal
    return p


class _Window:
    """One sampling of a MODEL with our intent, where the host gives the whole sampling a window:
    planned (and its schedules checked) when OUTER_SAMPLE starts, applied in PREPARE_SAMPLING right
    after the host loaded and patched the model (so condition processing that runs model layers,
    such as LTX-2's text connectors, runs with the adapters), sampled in SAMPLER_SAMPLE, restored
    when OUTER_SAMPLE exits, also on error or interrupt."""

    def __init__(self, patcher, want, p):
        self.patcher, self.want, self.plan = patcher, want, p
        self.stack = contextlib.ExitStack()
        self.dm = patcher.get_model_object("diffusion_model")
        self.key = kept_key(want, p)
        self.report = None      # the ApplyReport once applied
        self.t0 = None
        self.since = None       # ran_guard.snapshot right after the adapters went on
        self.evict_after = ""   # the host unloaded the model mid-sampling: take the adapters off at the end

    def apply(self) -> None:
        self.t0 = time.perf_counter()
        self.report = self.stack.enter_context(resident.held(self.dm, self.plan, self.key,
                                                             decision_cache_for(self.dm), owner=self.patcher))
        self.since = ran_guard.snapshot(_wrappers(self.dm))


_WINDOW: contextvars.ContextVar = contextvars.ContextVar("lora_runtime_window", default=None)


def kept_key(want, p) -> tuple:
    """What must be equal for a sampling to resume the adapters the last one left on: the intent
    (files, strengths, schedules, blocks, mode, tier, restore memory), the content each file had
    when planned, and the layers the host patches itself."""
    return (want, tuple((pa.name, pa.adapter.content_hash, tuple(pa.adapter.notes)) for pa in p.adapters),
            tuple(sorted(p.merge_refusals.items())), p.layer_refusal is not None)


def on_detach(patcher, unpatch_all: bool) -> None:
    """The host detaches a loaded MODEL of ours: on an unload (``unpatch_all``) the adapters kept on
    its weights come off; on a detach before a load they stay only if the load is this sampling's
    own, with the same adapters (ComfyUI detaches a loaded model before it loads it again, and
    every loaded clone of a base before another clone of it loads)."""
    try:
        dm = patcher.get_model_object("diffusion_model")
    except AttributeError:
        return
    state = resident.kept(dm)
    if state is None:
        return
    window = _WINDOW.get()
    if unpatch_all:
        why = "the host unloaded the model"
        if window is not None and window.dm is dm and window.report is not None and not any(
                w.merged for w in state.injector.wrappers.values()):
            # unloaded while this very sampling runs it (dynamic VRAM frees a model in use when another
            # loads, and the sampling goes on casting its weights): nothing of ours is in its weights,
            # so the adapters stay until the sampling ends, then come off
            window.evict_after = why
            return
    elif window is None or window.dm is not dm or window.key != state.key:
        why = "another MODEL on the same weights is being loaded"
    else:
        return
    try:
        resident.evict(dm, why)
    except LoraRuntimeError as e:  # never into the host's unload loop: the next sampling of this model says it
        log.error("LoRA runtime: %s", e)


def outer_sample_wrapper(executor, *args, **kwargs):
    """OUTER_SAMPLE wrapper (executor.class_obj: the guider; args = (noise, latent_image, sampler, sigmas,
    ...)): the window of one sampling; every exit restores what PREPARE_SAMPLING applied."""
    patcher = getattr(getattr(executor, "class_obj", None), "model_patcher", None)
    want = read(patcher) if patcher is not None else None
    if want is None or not want.touches_model:
        return executor(*args, **kwargs)
    sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
    p = _plan(patcher, want)
    if sigmas is not None:
        _schedules(p, sigmas, patcher)  # a malformed schedule fails here, before anything is applied
    window = _Window(patcher, want, p)
    token = _WINDOW.set(window)
    try:
        with window.stack:
            return executor(*args, **kwargs)
    finally:
        _WINDOW.reset(token)
        if window.evict_after:
            try:
                resident.evict(window.dm, window.evict_after)
            except LoraRuntimeError as e:  # the next sampling of this model says it
                log.error("LoRA runtime: %s", e)


def prepare_sampling_wrapper(executor, *args, **kwargs):
    """PREPARE_SAMPLING wrapper (args = (model, noise_shape, conds, ...)): the host loads and patches
    the model; then our adapters go on, before anything else of the sampling runs."""
    out = executor(*args, **kwargs)
    window = _WINDOW.get()
    model = args[0] if args else kwargs.get("model")
    if window is not None and window.report is None and model is window.patcher:
        window.apply()
    return out


def sampler_sample_wrapper(executor, *args, **kwargs):
    """SAMPLER_SAMPLE wrapper: args = (guider, sigmas, extra_args, callback, noise, latent, mask, disable_pbar).
    Inside a window the adapters are already on; else (a host path without one) they go on here."""
    guider, sigmas = args[0], args[1]
    patcher = guider.model_patcher
    want = read(patcher)
    if not want.touches_model:
        return executor(*args, **kwargs)
    steps = max(1, len(sigmas) - 1)
    window = _WINDOW.get()
    if window is not None and window.patcher is patcher and window.report is not None:
        p, dm, t0, since = window.plan, window.dm, window.t0, window.since
        state = contextlib.nullcontext(window.report)
    else:
        p = _plan(patcher, want)
        dm = patcher.get_model_object("diffusion_model")
        t0 = since = None
        state = None
    schedules = _schedules(p, sigmas, patcher)  # a malformed schedule fails here, before anything is applied
    if state is None:
        t0 = time.perf_counter()
        state = applied(dm, p, cache=decision_cache_for(dm))
    first = _FirstCall(dm, since)
    with state as applied_report, sampling_schedules(schedules):
        t_sample = time.perf_counter()
        graphs = compile_watch.graphs_compiled()
        token = _FIRST_CALL.set(first)
        try:
            out = executor(*args, **kwargs)
        finally:
            _FIRST_CALL.reset(token)
        graphs = compile_watch.graphs_compiled() - graphs
        sample_seconds = time.perf_counter() - t_sample
    r = report_mod.build(applied_report if p.adapters else None, mode=want.mode.value, tier=want.tier.value,
                         host=host.NAME, sample_seconds=sample_seconds, steps=steps, schedules=schedules,
                         graphs_compiled=graphs, clip=report_mod.clip_lines(want.adapters),
                         ran_check=first.findings,
                         host_patched=report_mod.host_patched_entry(p.merge_refusals,
                                                                    {pa.name: list(pa.layers) for pa in p.adapters}))
    r["total_seconds"] = round(time.perf_counter() - t0, 4)
    setattr(patcher, _REPORT_ATTR, r)
    log.info("%s", report_mod.text(r))
    host.send_report(r)
    return out


def _schedules(p, sigmas, patcher) -> SamplingSchedules | None:
    """The strength schedules / branches of the planned adapters against this run's sigmas, or
    None when every adapter has a constant strength on both branches."""
    entries = {pa.name: (pa.spec.schedule, pa.spec.branch) for pa in p.adapters
               if pa.spec.schedule is not None or pa.spec.branch is not Branch.BOTH}
    if not entries:
        return None
    try:
        ms = patcher.get_model_object("model_sampling")
    except AttributeError:
        ms = None
    return SamplingSchedules(entries, sigmas, getattr(ms, "percent_to_sigma", None))  # errors: "Load LoRA Adapter (name)"


def apply_model_wrapper(executor, *args, **kwargs):
    """APPLY_MODEL wrapper: args = (x, t, c_concat, c_crossattn, control, transformer_options), once per
    model call. Inside a sampling with schedules, sets this call's per-adapter factors from the call's
    sigma (``transformer_options["sigmas"]``, else `t`) and batch layout (``["cond_or_uncond"]``)."""
    opts = args[5] if len(args) > 5 else kwargs.get("transformer_options") or {}
    sigma = opts.get("sigmas") if isinstance(opts, dict) else None
    if sigma is None and len(args) > 1:
        sigma = args[1]
    cond_or_uncond = opts.get("cond_or_uncond") if isinstance(opts, dict) else None
    first = _FIRST_CALL.get()
    with model_call_context(args[0], sigma, cond_or_uncond):
        if first is None or first.done:
            return executor(*args, **kwargs)
        first.done = True  # did every adapted layer run? (a host path may skip a layer's forward)
        wrappers = _wrappers(first.dm)
        out, first.findings = ran_guard.first_call(lambda: executor(*args, **kwargs), wrappers, first.dm,
                                                   since=first.since)
        return out
