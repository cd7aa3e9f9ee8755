"""Host functions backed by the bundled stand-in (no ComfyUI installed)."""
from __future__ import annotations

from ...standalone.host import folder_paths, progress
from ...standalone.host.model_patcher import (APPLY_MODEL, ON_DEEPCLONE_MULTIGPU, ON_DETACH, OUTER_SAMPLE,  # noqa: F401
                                              PREPARE_SAMPLING, SAMPLER_SAMPLE)
from ...standalone.host.core_nodes import _sampler_names, _scheduler_names, sample_with_progress
from ...standalone.host.progress import InterruptProcessingException  # noqa: F401


def lora_names() -> list[str]:
    return folder_paths.get_filename_list("loras")


def resolve_lora(name: str) -> str:
    """Absolute path of a file in the loras folder; ValueError/FileNotFoundError say why not."""
    return folder_paths.get_full_path_or_raise("loras", name)


def diffusion_model(model):
    return model.get_model_object("diffusion_model")


def send_report(report: dict) -> None:
    """The bundled host has no frontend: reports go to its listeners (the CLI, tests)."""
    progress.emit_event("lora_runtime.report", {"node": progress.current_node_id(), "report": report})


def sample(model, *, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent, denoise=1.0) -> dict:
    return sample_with_progress(model, seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name,
                                scheduler=scheduler, positive=positive, negative=negative, latent=latent,
                                denoise=denoise)


def sampler_names() -> list[str]:
    return _sampler_names()


def scheduler_names() -> list[str]:
    return _scheduler_names()


def apply_clip_lora(clip, adapter, strength: float):
    """(a clone of `clip` with the adapter's text-encoder layers patched on at `strength`,
    {file layer: weight keys patched}, {file layer: why not applied}). `clip` is untouched."""
    from ...standalone.host.clip import load_lora, lora_key_map

    model = clip.cond_stage_model
    patches, skipped = load_lora(adapter.text_encoder, lora_key_map(model), model)
    new = clip.clone()
    taken = set(new.add_patches(patches, strength))
    key_map = lora_key_map(model)
    applied = {s: [key_map[s]] for s in adapter.text_encoder if s not in skipped and key_map[s] in taken}
    for s in adapter.text_encoder:
        if s not in applied and s not in skipped:
            skipped[s] = "the CLIP did not take the patch"
    return new, applied, skipped


def requant_seed(layer: str) -> int:
    """The bundled host re-quantizes a merged weight by rounding to nearest (seed 0)."""
    return 0
