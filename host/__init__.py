"""The one module the nodes talk to: real ComfyUI when present, else the bundled host.

Real ComfyUI is detected by `comfy.model_management` being importable (the pack
sits in `ComfyUI/custom_nodes/`). Everything the nodes need goes through these
functions, so node code never cares which host runs it:

- `lora_names()`, `resolve_lora(name)`: the `loras` model folder;
- `diffusion_model(model)`: the nn.Module inside a MODEL (patcher);
- `sample(model, ...)`: the host's KSampler (seeded noise, sigmas, sampler) -> LATENT;
- `sampler_names()`, `scheduler_names()`;
- `InterruptProcessingException`: what an interrupt raises through sampling;
- `add_sampler_wrapper(model, key, fn)`, `get_sampler_wrappers(model, key)`: the
  patcher's SAMPLER_SAMPLE wrapper hook (nodes/lifecycle.py rides on it);
- `add_model_call_wrapper(model, key, fn)`, `get_model_call_wrappers(model, key)`: the
  patcher's APPLY_MODEL wrapper hook, once per model call, whose transformer_options
  carry that call's ``sigmas`` and ``cond_or_uncond`` (strength schedules, branches);
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
    from .comfy_host import (InterruptProcessingException, add_sampler_wrapper, diffusion_model,  # noqa: F401
                             add_model_call_wrapper, get_model_call_wrappers, get_sampler_wrappers, lora_names, resolve_lora, sample, sampler_names, scheduler_names,
                             send_report)
    NAME = "comfyui"
else:
    from .bundled_host import (InterruptProcessingException, add_sampler_wrapper, diffusion_model,  # noqa: F401
                               add_model_call_wrapper, get_model_call_wrappers, get_sampler_wrappers, lora_names, resolve_lora, sample, sampler_names,
                               scheduler_names, send_report)
    NAME = "bundled"
