"""The LoRA runtime around every sampler that samples a MODEL our nodes touched.

Our nodes record an `Intent` on a MODEL clone and `register` this module's wrapper on
it. The wrapper rides on ComfyUI's own ModelPatcher hook ``WrappersMP.SAMPLER_SAMPLE``
(the bundled host's patcher has the same hook), so ComfyUI's KSampler,
KSamplerAdvanced, SamplerCustom(Advanced), other packs' samplers and our LoRA Sampler
all run the same lifecycle:

    ComfyUI: prepare_sampling -> load_models_gpu (its own weight patches applied,
             object patches and injections in place) -> pre_run
      our wrapper: plan -> apply (attach / merge / mount fusions) on the device and
                   dtype ComfyUI chose -> the sampler's own loop -> restore
    ComfyUI: cleanup

Why SAMPLER_SAMPLE and not OUTER_SAMPLE: OUTER_SAMPLE runs before ComfyUI loads the
model, so a merge there would be undone or doubled by ComfyUI's own patching.

Contract
- `register(patcher)` is idempotent; clones inherit the wrapper (ComfyUI copies
  wrapper lists on clone) and each clone carries its own Intent.
- The wrapper reads the Intent of the patcher being sampled (``guider.model_patcher``,
  the exact MODEL object the sampler node received). No adapters and the default tier:
  it calls straight through.
- Every exit restores: merged weights bit for bit, forwards and fusion sites put back,
  also on error, interrupt or out-of-memory; the error then propagates unchanged.
- The report (the dict the LoRA Sampler shows) is stored on the patcher
  (`last_report`), logged, and sent to the frontend for the node that is executing
  (`host.send_report`), so a stock KSampler gets the badge and the LoRA Runtime Report
  node can put it in the prompt's history.
"""
from __future__ import annotations

import contextvars
import logging
import time

from .. import host
from ..lora_runtime import applied, compile_watch, plan
from ..lora_runtime.layer import ran_guard
from ..lora_runtime.layer.schedule import Branch, SamplingSchedules, model_call_context, sampling_schedules
from ..lora_runtime.layer.wrapper import attached_wrapper
from . import intent as intent_mod
from . import report as report_mod
from .caches import ADAPTERS, decision_cache_for

log = logging.getLogger(__name__)

WRAPPER_KEY = "comfyui_lora_runtime"
_FIRST_CALL: contextvars.ContextVar = contextvars.ContextVar("lora_runtime_first_call", default=None)


class _FirstCall:
    """The ran check of one sampling: done on its first model call (ran_guard)."""

    def __init__(self, dm):
        self.dm = dm
        self.done = False
        self.findings: list[dict] = []
_REPORT_ATTR = "_lora_runtime_report"


def is_registered(patcher) -> bool:
    return host.has_wrappers(patcher, WRAPPER_KEY)


def register(patcher) -> None:
    """Make every sampling of `patcher` (and of its later clones) run the LoRA runtime."""
    compile_watch.install()  # a torch.compile recompile-limit fallback is named on the report
    host.add_wrappers(patcher, WRAPPER_KEY, sampler_sample_wrapper, apply_model_wrapper)


def last_report(patcher) -> dict | None:
    """The report of the last sampling of this exact MODEL object, or None."""
    return getattr(patcher, _REPORT_ATTR, None)


def clear_report(patcher) -> None:
    setattr(patcher, _REPORT_ATTR, None)


def store_report(patcher, report: dict) -> None:
    """Keep `report` as the last report of this MODEL object (a sampler that sampled a clone of it)."""
    setattr(patcher, _REPORT_ATTR, report)


COMFY_PATCHED = ("ComfyUI patches this weight itself (a LoraLoader or other model patch upstream) and may "
                 "put its own backup back into it if it offloads the layer mid-run, so our adapter stays "
                 "dynamic on it")


def host_patched_layers(patcher) -> dict[str, str]:
    """Layers whose weight the host patches itself (ComfyUI ``patcher.patches`` keys
    ``diffusion_model.<layer>.weight``): a merge there is refused, the layer stays dynamic."""
    out = {}
    for key in getattr(patcher, "patches", None) or {}:
        k = key[0] if isinstance(key, tuple) else key
        if isinstance(k, str) and k.startswith("diffusion_model.") and k.endswith(".weight"):
            out[k[len("diffusion_model."):-len(".weight")]] = COMFY_PATCHED
    return out


def sampler_sample_wrapper(executor, *args, **kwargs):
    """SAMPLER_SAMPLE wrapper: args = (guider, sigmas, extra_args, callback, noise, latent, mask, disable_pbar)."""
    guider, sigmas = args[0], args[1]
    patcher = guider.model_patcher
    want = intent_mod.read(patcher)
    if not want.touches_model:
        return executor(*args, **kwargs)
    steps = max(1, len(sigmas) - 1)
    dm = patcher.get_model_object("diffusion_model")
    p = plan(dm, want.specs(), want.mode, want.tier, loader=ADAPTERS.load, restore=want.restore)
    p.merge_refusals = host_patched_layers(patcher)
    p.requant_seed = host.requant_seed
    schedules = _schedules(p, sigmas, patcher)  # a malformed schedule fails here, before anything is applied
    t0 = time.perf_counter()
    first = _FirstCall(dm)
    with applied(dm, p, cache=decision_cache_for(dm)) as applied_report, sampling_schedules(schedules):
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
                         ran_check=first.findings)
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
        wrappers = [w for m in first.dm.modules() for w in [attached_wrapper(m)] if w is not None]
        out, first.findings = ran_guard.first_call(lambda: executor(*args, **kwargs), wrappers, first.dm)
        return out
