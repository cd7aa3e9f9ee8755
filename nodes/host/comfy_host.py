"""Host functions backed by a real ComfyUI (imported only when `comfy` is importable).

Sampling goes through ComfyUI's own `common_ksampler` (its seeded noise, sigma
schedules, samplers, progress bar and interruption), so the LoRA Sampler gives
exactly what ComfyUI's KSampler gives for the same weights.
"""
from __future__ import annotations

import logging
import os
import weakref

import comfy.model_management
import comfy.patcher_extension
import comfy.samplers
import folder_paths

from ...lora_runtime.files import host_keys

log = logging.getLogger(__name__)

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


def diffusion_model(model):
    """The nn.Module whose layers the adapters go on. Nothing is loaded or patched here:
    names and shapes are all the coverage check needs, and the adapters are applied
    inside sampling (nodes/lifecycle.py), after ComfyUI has loaded the model. The module is
    remembered with its ComfyUI model, whose key map then places the adapters' keys."""
    dm = model.get_model_object("diffusion_model")
    _remember(dm, getattr(model, "model", None))
    return dm


# --- ComfyUI's own key map (lora_runtime.files.host_keys) -------------------------------
# Inside ComfyUI, ComfyUI decides where an adapter key goes: `comfy.lora.model_lora_keys_unet`
# of the model at hand (its class's own renames, row slices and swapped halves), read at run
# time, and `comfy.lora_convert.convert_lora` on the file's keys first, as its LoraLoader does.
# The pack's tables place only what that map does not know.

_OWNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # diffusion model -> ref(BaseModel)
_KEY_MAPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # BaseModel -> HostKeyMap

# ComfyUI model class (comfy.model_base, or any subclass: the nearest in the MRO) -> the pack's family
# table for it; a class not named here gets none of the tables (ComfyUI's own map and the model's names)
COMFY_FAMILIES = {"Flux": "Flux", "HunyuanVideo": "HunyuanVideo", "Lumina2": "Z-Image", "QwenImage": "Qwen-Image",
                  "LTXV": "LTX-Video", "LTXAV": "LTX-Video", "WAN21": "Wan"}


def _remember(dm, base) -> None:
    if base is not None and getattr(base, "diffusion_model", None) is dm:
        try:
            _OWNERS[dm] = weakref.ref(base)
        except TypeError:
            pass


def base_model_of(dm):
    """The ComfyUI model (comfy.model_base.BaseModel) whose diffusion model is `dm`, or None: the
    one remembered by `diffusion_model`, else one of ComfyUI's loaded models."""
    ref = _OWNERS.get(dm)
    base = ref() if ref is not None else None
    if base is not None and getattr(base, "diffusion_model", None) is dm:
        return base
    for lm in list(getattr(comfy.model_management, "current_loaded_models", None) or ()):
        patcher = getattr(lm, "model", None)
        base = getattr(patcher, "model", None)
        if base is not None and getattr(base, "diffusion_model", None) is dm:
            _remember(dm, base)
            return base
    return None


def model_family(base) -> str:
    """The pack's family table for a ComfyUI model, by its class ('' = none)."""
    for cls in type(base).__mro__:
        if cls.__name__ in COMFY_FAMILIES:
            return COMFY_FAMILIES[cls.__name__]
    return ""


def key_map(dm):
    """ComfyUI's key map for the model whose diffusion model is `dm`, as a `host_keys.HostKeyMap`
    (cached per model), or None when the model is not known here."""
    base = base_model_of(dm)
    if base is None:
        return None
    hm = _KEY_MAPS.get(base)
    if hm is None:
        import comfy.lora
        import comfy.lora_convert
        import comfy.utils

        raw = comfy.lora.model_lora_keys_unet(base, {})
        swap = getattr(comfy.utils, "swap_scale_shift", None)
        config = getattr(base, "model_config", None)
        hm = host_keys.from_key_map(
            raw, host="ComfyUI", model_class=type(config).__name__ if config is not None else type(base).__name__,
            base_class=type(base).__name__, family=model_family(base), swap_functions=[swap] if swap else [],
            convert=getattr(comfy.lora_convert, "convert_lora", None), source="comfy.lora.model_lora_keys_unet")
        _KEY_MAPS[base] = hm
        log.debug("LoRA runtime: %s has %d entries (%d not usable)", hm.who, len(hm.entries), len(hm.skipped))
    return hm


host_keys.set_provider(key_map)


# --- the wrapper hooks of ComfyUI's own ModelPatcher (registered in host/__init__.py) ----
SAMPLER_SAMPLE = comfy.patcher_extension.WrappersMP.SAMPLER_SAMPLE
# Around CFGGuider.outer_sample (model load, condition processing, sampling, cleanup), and around
# sampler_helpers.prepare_sampling (where load_models_gpu loads and patches the model)
OUTER_SAMPLE = comfy.patcher_extension.WrappersMP.OUTER_SAMPLE
PREPARE_SAMPLING = comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING
# Per model call: BaseModel.apply_model(x, t, c_concat, c_crossattn, control, transformer_options, **kw),
# with transformer_options["sigmas"] and ["cond_or_uncond"] set by the sampler for that call.
APPLY_MODEL = comfy.patcher_extension.WrappersMP.APPLY_MODEL
# ModelPatcher.detach(unpatch_all) callback: an unload (True), or load_models_gpu detaching a loaded
# clone of a base before it loads that base's patcher again or another clone of it (False)
ON_DETACH = comfy.patcher_extension.CallbacksMP.ON_DETACH
# ModelPatcher.deepclone_multigpu(new_load_device) callback fn(patcher, clone): core's multi-GPU nodes build
# a clone on a freshly loaded copy of the model per extra device; None on a ComfyUI without it (0.3.64)
ON_DEEPCLONE_MULTIGPU = getattr(comfy.patcher_extension.CallbacksMP, "ON_DEEPCLONE_MULTIGPU", None)


REPORT_EVENT = "lora_runtime.report"


def send_report(report: dict) -> None:
    """Send a runtime report to the client that queued the prompt, for the node that is
    executing (a stock KSampler too): the web extension shows it on that node."""
    try:
        from comfy_execution.utils import get_executing_context
        from server import PromptServer
    except ImportError:
        return
    server = getattr(PromptServer, "instance", None)
    if server is None:
        return
    ctx = get_executing_context()
    node = ctx.node_id if ctx is not None else getattr(server, "last_node_id", None)
    data = {"node": node, "display_node": node, "prompt_id": getattr(ctx, "prompt_id", None), "report": report}
    server.send_sync(REPORT_EVENT, data, getattr(server, "client_id", None))


def sample(model, *, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent, denoise=1.0) -> dict:
    import nodes as comfy_nodes  # ComfyUI's top-level nodes module (ours is imported relatively)

    return comfy_nodes.common_ksampler(model, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                                       latent, denoise=denoise)[0]


def sampler_names() -> list[str]:
    return list(comfy.samplers.KSampler.SAMPLERS)


def scheduler_names() -> list[str]:
    return list(comfy.samplers.KSampler.SCHEDULERS)


def apply_clip_lora(clip, adapter, strength: float):
    """ComfyUI's own CLIP path of LoraLoader (`comfy.sd.load_lora_for_models`), for the file's
    text-encoder tensors only: its key map of this CLIP (CLIP-L/G, T5, ...), its conversion,
    its `load_lora` and ``clip.clone().add_patches``. Returns (the patched clone, {file layer:
    weight keys ComfyUI patched}, {file layer: why not}); `clip` is untouched."""
    import comfy.lora
    import comfy.lora_convert

    key_map = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, {})
    tensors = adapter.text_encoder_tensors
    loaded = comfy.lora.load_lora(comfy.lora_convert.convert_lora(dict(tensors)), key_map, log_missing=False)
    new = clip.clone()
    taken = set(new.add_patches(loaded, strength))
    applied, skipped = {}, {}
    for stem, la in adapter.text_encoder.items():  # which file layers ComfyUI took: each one on its own
        own = comfy.lora.load_lora(comfy.lora_convert.convert_lora({k: tensors[k] for k in la.keys}), key_map,
                                   log_missing=False)
        targets = sorted(k for k in own if k in taken)
        if targets:
            applied[stem] = targets
        else:
            skipped[stem] = ("no such layer in this CLIP (ComfyUI's key map for it has no entry)" if not own
                             else "this CLIP did not take the patch")
    return new, applied, skipped


def requant_seed(layer: str) -> int:
    """ComfyUI's stochastic-rounding seed for a merge into the quantized weight of `layer` (a
    module name inside the diffusion model), as its own LoRA merge seeds it."""
    import comfy.model_patcher
    import comfy.utils
    fn = getattr(comfy.utils, "string_to_seed", None) or comfy.model_patcher.string_to_seed  # 0.33 / 0.3.x
    return int(fn(f"diffusion_model.{layer}.weight"))
