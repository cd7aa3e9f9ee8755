"""Host functions backed by a real ComfyUI (imported only when `comfy` is importable).

Sampling goes through ComfyUI's own `common_ksampler` (its seeded noise, sigma
schedules, samplers, progress bar and interruption), so the LoRA Sampler gives
exactly what ComfyUI's KSampler gives for the same weights.
"""
from __future__ import annotations

import os

import comfy.model_management
import comfy.patcher_extension
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


def diffusion_model(model):
    """The nn.Module whose layers the adapters go on. Nothing is loaded or patched here:
    names and shapes are all the coverage check needs, and the adapters are applied
    inside sampling (nodes/lifecycle.py), after ComfyUI has loaded the model."""
    return model.get_model_object("diffusion_model")


# --- the wrapper hooks of ComfyUI's own ModelPatcher (registered in host/__init__.py) ----
SAMPLER_SAMPLE = comfy.patcher_extension.WrappersMP.SAMPLER_SAMPLE
# Around CFGGuider.outer_sample (model load, condition processing, sampling, cleanup), and around
# sampler_helpers.prepare_sampling (where load_models_gpu loads and patches the model)
OUTER_SAMPLE = comfy.patcher_extension.WrappersMP.OUTER_SAMPLE
PREPARE_SAMPLING = comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING
# Per model call: BaseModel.apply_model(x, t, c_concat, c_crossattn, control, transformer_options, **kw),
# with transformer_options["sigmas"] and ["cond_or_uncond"] set by the sampler for that call.
APPLY_MODEL = comfy.patcher_extension.WrappersMP.APPLY_MODEL


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
