"""Host functions backed by the bundled stand-in (no ComfyUI installed)."""
from __future__ import annotations

from .bundled import folder_paths, progress
from .bundled.model_patcher import APPLY_MODEL, SAMPLER_SAMPLE  # noqa: F401  (the wrapper hooks)
from .bundled.core_nodes import _sampler_names, _scheduler_names, sample_with_progress
from .bundled.progress import InterruptProcessingException  # noqa: F401


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
