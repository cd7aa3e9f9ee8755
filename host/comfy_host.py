"""Host functions backed by a real ComfyUI (imported only when `comfy` is importable).

Sampling goes through ComfyUI's own `common_ksampler` (its seeded noise, sigma
schedules, samplers, progress bar and interruption), so the LoRA Sampler gives
exactly what ComfyUI's KSampler gives for the same weights.
"""
from __future__ import annotations

import os

import comfy.model_management
import comfy.samplers
import folder_paths

InterruptProcessingException = comfy.model_management.InterruptProcessingException


def lora_names() -> list[str]:
    return folder_paths.get_filename_list("loras")


def resolve_lora(name: str) -> str:
    if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise ValueError(f"loras name {name!r} escapes the loras folder; pick a file from the list")
    path = folder_paths.get_full_path("loras", name)
    if path is None:
        raise FileNotFoundError(f"loras file {name!r} not found in {folder_paths.get_folder_paths('loras')}")
    roots = [os.path.realpath(p) for p in folder_paths.get_folder_paths("loras")]
    if not any(os.path.realpath(path).startswith(r + os.sep) for r in roots):
        raise ValueError(f"loras name {name!r} resolves outside the loras folder; move the file into it")
    return path


def _weights_need_load(model) -> bool:
    """Whether the module weights do not (yet) hold exactly `model`'s own ComfyUI weight
    patches: another patcher's patch set is applied (e.g. a LoraLoader branch sampled
    before), or this patcher has patches that are not applied yet."""
    inner = getattr(model, "model", None)
    mine = getattr(model, "patches_uuid", None)
    if inner is None or mine is None or not hasattr(inner, "current_weight_patches_uuid"):
        return True  # a ComfyUI we do not know: let model management decide
    current = inner.current_weight_patches_uuid
    if current is not None:
        return current != mine
    return bool(getattr(model, "patches", None))


def diffusion_model(model):
    """The nn.Module whose layers the adapters go on, with its weights in `model`'s state.

    ComfyUI applies weight patches (its own LoraLoader etc.) lazily, when a patcher is
    loaded for sampling, and takes another patcher's patches off first by putting the
    backed-up Parameters back (``unpatch_model`` -> ``set_attr_param``). If the pack
    wrapped or merged before that, ComfyUI's unpatch would either fail on our wrapper
    (KeyError "attribute 'weight' already exists") or replace a merged weight under us:
    the adapter silently dropped, and our restore written into the wrong weights. So
    when the weights do not hold this patcher's patch state, let ComfyUI load it now;
    the load inside sampling then finds it loaded and leaves the weights alone.
    """
    if _weights_need_load(model):
        comfy.model_management.load_models_gpu([model])
    return model.get_model_object("diffusion_model")


def sample(model, *, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent, denoise=1.0) -> dict:
    import nodes as comfy_nodes  # ComfyUI's top-level nodes module (ours is imported relatively)

    return comfy_nodes.common_ksampler(model, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                                       latent, denoise=denoise)[0]


def sampler_names() -> list[str]:
    return list(comfy.samplers.KSampler.SAMPLERS)


def scheduler_names() -> list[str]:
    return list(comfy.samplers.KSampler.SCHEDULERS)
