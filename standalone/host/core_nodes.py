"""The ComfyUI core node types the pack's workflows use, for the bundled host.

Same class names, input names, types and widget defaults, RETURN_TYPES,
FUNCTION and CATEGORY as ComfyUI's, so a workflow saved in ComfyUI runs here
unchanged (and vice versa). Implementations are the bundled host's own: a Wan
2.1 DiT on the CPU in float32 (which is also what ComfyUI computes in on the
CPU), the flow sampler in `sampling.py`.
"""
from __future__ import annotations

import logging
import os
import random

import torch

from . import folder_paths, model_management
# the weight dtype: a per-run option (options.using, execute_prompt(unet_dtype=...)),
# $LORA_RUNTIME_UNET_DTYPE only its default; re-exported here
from .options import UNET_DTYPE_ENV, unet_dtype  # noqa: F401
from .model_patcher import (APPLY_MODEL, OUTER_SAMPLE, PREPARE_SAMPLING, SAMPLER_SAMPLE, BundledModel,
                            BundledModelPatcher, ModelSamplingFlow, run_wrapped)
from .png_metadata import save_png
from .progress import ProgressBar, throw_exception_if_processing_interrupted

log = logging.getLogger(__name__)

MAX_RESOLUTION = 16384  # ComfyUI's nodes.MAX_RESOLUTION
WAN21_DEFAULT_SHIFT = 8.0  # WAN21_T2V.sampling_settings
FLOW_MULTIPLIER = 1000.0

# ComfyUI's comfy.samplers.KSampler lists; used only when sampling.py is absent
# (so INPUT_TYPES still works, e.g. for UI->API conversion).
_FALLBACK_SAMPLERS = ["euler"]
_FALLBACK_SCHEDULERS = ["simple", "sgm_uniform", "karras", "exponential", "ddim_uniform",
                        "beta", "normal", "linear_quadratic", "kl_optimal"]


def _sampling():
    from . import sampling  # written alongside; imported lazily so the executor works without it
    return sampling


def _sampler_names() -> list[str]:
    try:
        return list(_sampling().SAMPLER_NAMES)
    except ImportError:
        return list(_FALLBACK_SAMPLERS)


def _scheduler_names() -> list[str]:
    try:
        return list(_sampling().SCHEDULER_NAMES)
    except ImportError:
        return list(_FALLBACK_SCHEDULERS)


class UNETLoader:
    WEIGHT_DTYPES = ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "unet_name": (folder_paths.get_filename_list("diffusion_models"),),
            "weight_dtype": (list(cls.WEIGHT_DTYPES),),
        }}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load_unet"
    CATEGORY = "advanced/loaders"

    def load_unet(self, unet_name, weight_dtype):
        if weight_dtype != "default":
            # The CPU computes in float32 (as ComfyUI's does); fp8 storage would change results.
            raise ValueError(f"weight_dtype {weight_dtype!r} is not supported by the bundled host "
                             f"(CPU, float32); use 'default'")
        from . import latent_format
        from .wan21 import load_wan_checkpoint
        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        log.info("loading diffusion model %s", path)
        wan = load_wan_checkpoint(path, dtype=unet_dtype())
        wan.eval()
        model = BundledModel(wan, ModelSamplingFlow(WAN21_DEFAULT_SHIFT, FLOW_MULTIPLIER),
                             latent_format=latent_format, model_type="wan21")
        return (BundledModelPatcher(model),)


class CLIPLoader:
    """ComfyUI's CLIPLoader; the bundled host loads one kind: a CLIP-L text model
    (``type`` stable_diffusion) in `clip.TinyClipTextModel`'s layout, from text_encoders."""
    TYPES = ["stable_diffusion"]

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"clip_name": (folder_paths.get_filename_list("text_encoders"),),
                             "type": (list(cls.TYPES),)},
                "optional": {"device": (["default", "cpu"], {"advanced": True})}}

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load_clip"
    CATEGORY = "advanced/loaders"

    def load_clip(self, clip_name, type="stable_diffusion", device="default"):
        from safetensors.torch import load_file

        from .clip import BundledCLIP, TinyClipTextModel
        if type not in self.TYPES:
            raise ValueError(f"CLIP type {type!r} is not supported by the bundled host; it loads "
                             f"{', '.join(self.TYPES)} (a CLIP-L text model)")
        path = folder_paths.get_full_path_or_raise("text_encoders", clip_name)
        try:
            model = TinyClipTextModel.from_state_dict(load_file(path))
        except (ValueError, RuntimeError, KeyError) as e:
            raise ValueError(f"{clip_name}: not a CLIP-L text model the bundled host can load ({e})") from None
        return (BundledCLIP(model),)


class CLIPTextEncode:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "text": ("STRING", {"multiline": True, "dynamicPrompts": True, "tooltip": "The text to be encoded."}),
            "clip": ("CLIP", {"tooltip": "The CLIP model used for encoding the text."})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"
    CATEGORY = "conditioning"

    def encode(self, clip, text):
        if clip is None:
            raise RuntimeError("ERROR: clip input is invalid: None")
        return (clip.encode(text),)


class EmptyHunyuanLatentVideo:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "width": ("INT", {"default": 848, "min": 16, "max": MAX_RESOLUTION, "step": 16}),
            "height": ("INT", {"default": 480, "min": 16, "max": MAX_RESOLUTION, "step": 16}),
            "length": ("INT", {"default": 25, "min": 1, "max": MAX_RESOLUTION, "step": 4}),
            "batch_size": ("INT", {"default": 1, "min": 1, "max": 4096}),
        }}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "generate"
    CATEGORY = "latent/video"

    def generate(self, width, height, length, batch_size=1):
        latent = torch.zeros([batch_size, 16, ((length - 1) // 4) + 1, height // 8, width // 8])
        return ({"samples": latent},)


class ModelSamplingSD3:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL",),
            "shift": ("FLOAT", {"default": 3.0, "min": 0.0, "max": 100.0, "step": 0.01}),
        }}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "advanced/model"

    def patch(self, model, shift, multiplier=1000):
        m = model.clone()
        m.add_object_patch("model_sampling", ModelSamplingFlow(float(shift), float(multiplier)))
        return (m,)


class KSampler:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The model used for denoising the input latent."}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 0xffffffffffffffff,
                             "control_after_generate": True}),
            "steps": ("INT", {"default": 20, "min": 1, "max": 10000}),
            "cfg": ("FLOAT", {"default": 8.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01}),
            "sampler_name": (_sampler_names(),),
            "scheduler": (_scheduler_names(),),
            "positive": ("CONDITIONING",),
            "negative": ("CONDITIONING",),
            "latent_image": ("LATENT",),
            "denoise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01}),
        }}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "sample"
    CATEGORY = "sampling"

    def sample(self, model, seed, steps, cfg, sampler_name, scheduler, positive, negative,
               latent_image, denoise=1.0):
        return (sample_with_progress(model, seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name,
                                     scheduler=scheduler, positive=positive, negative=negative,
                                     latent=latent_image, denoise=denoise),)


class Guider:
    """What SAMPLER_SAMPLE wrappers receive first: ComfyUI passes its CFGGuider, whose
    ``model_patcher`` is the exact MODEL the sampler node got."""

    def __init__(self, model_patcher: BundledModelPatcher):
        self.model_patcher = model_patcher


def sample_with_progress(model: BundledModelPatcher, *, seed, steps, cfg, sampler_name, scheduler,
                         positive, negative, latent, denoise=1.0) -> dict:
    """Run sampling.ksampler on a patcher: its (possibly patched) diffusion model and
    shift, a ProgressBar step per sampler step, and the interruption check. The
    patcher's SAMPLER_SAMPLE wrappers run around it as ComfyUI runs them (after the
    model is ready, before any model call), with ComfyUI's argument order:
    (guider, sigmas, extra_args, callback, noise, latent_image, denoise_mask, disable_pbar)."""
    throw_exception_if_processing_interrupted()
    model_sampling = model.get_model_object("model_sampling")
    shift = float(model_sampling.shift)
    pbar = ProgressBar(steps)

    def callback(step, total, x):
        pbar.update_absolute(step + 1, total)
        throw_exception_if_processing_interrupted()

    def original(guider, sigmas, extra_args, cb, noise, latent_image, denoise_mask, disable_pbar):
        # the diffusion model is read here, inside the wrappers, as ComfyUI's sampler reads it
        return _sampling().ksampler(
            model.get_model_object("diffusion_model"), seed=seed, steps=steps, cfg=cfg,
            sampler_name=sampler_name, scheduler=scheduler, positive=positive, negative=negative,
            latent=latent_image, denoise=denoise, shift=shift, callback=cb,
            model_call_wrappers=model.get_all_wrappers(APPLY_MODEL),
            transformer_options=dict(extra_args["model_options"].get("transformer_options") or {}))

    sigmas = _sampling().flow_sigmas(steps, scheduler, shift=shift, denoise=denoise)
    guider = Guider(model)

    def prepare(patcher, noise_shape, conds, model_options=None):
        model_management.load_models_gpu([patcher])  # ComfyUI's load order (on the CPU: nothing moves)

    def outer(noise, latent_image, sampler, sigmas, denoise_mask, cb, disable_pbar, seed):
        run_wrapped(prepare, None, model.get_all_wrappers(PREPARE_SAMPLING), model, None,
                    {"positive": positive, "negative": negative}, model_options=model.model_options)
        return run_wrapped(original, None, model.get_all_wrappers(SAMPLER_SAMPLE), guider, sigmas,
                           {"model_options": model.model_options, "seed": seed}, cb, noise, latent_image,
                           denoise_mask, disable_pbar)

    with torch.no_grad():
        # ComfyUI's order: OUTER_SAMPLE around the guider's whole sampling, PREPARE_SAMPLING where it
        # loads the model, SAMPLER_SAMPLE around the sampler's loop
        return run_wrapped(outer, guider, model.get_all_wrappers(OUTER_SAMPLE), None, latent, None, sigmas, None,
                           callback, False, seed)


class SaveImage:
    def __init__(self):
        self.output_dir = folder_paths.get_output_directory()
        self.type = "output"
        self.prefix_append = ""
        self.compress_level = 4

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "images": ("IMAGE", {"tooltip": "The images to save."}),
                "filename_prefix": ("STRING", {"default": "ComfyUI"}),
            },
            "hidden": {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"},
        }

    RETURN_TYPES = ()
    FUNCTION = "save_images"
    OUTPUT_NODE = True
    CATEGORY = "image"

    def save_images(self, images, filename_prefix="ComfyUI", prompt=None, extra_pnginfo=None):
        if images.ndim != 4:
            raise ValueError(f"images must be a [B,H,W,C] batch, got shape {tuple(images.shape)}")
        filename_prefix += self.prefix_append
        folder, filename, counter, subfolder, _ = folder_paths.get_save_image_path(
            filename_prefix, self.output_dir, images.shape[2], images.shape[1])
        results = []
        for batch_number, image in enumerate(images):
            file = f"{filename.replace('%batch_num%', str(batch_number))}_{counter:05}_.png"
            save_png(os.path.join(folder, file), image, prompt, extra_pnginfo, self.compress_level)
            log.info("saved %s", os.path.join(folder, file))
            results.append({"filename": file, "subfolder": subfolder, "type": self.type})
            counter += 1
        return {"ui": {"images": results}}


class PreviewImage(SaveImage):
    def __init__(self):
        self.output_dir = folder_paths.get_temp_directory()
        self.type = "temp"
        self.prefix_append = "_temp_" + "".join(random.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5))
        self.compress_level = 1

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"images": ("IMAGE",)},
                "hidden": {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"}}


CORE_NODE_CLASS_MAPPINGS: dict[str, type] = {
    "UNETLoader": UNETLoader,
    "CLIPLoader": CLIPLoader,
    "CLIPTextEncode": CLIPTextEncode,
    "EmptyHunyuanLatentVideo": EmptyHunyuanLatentVideo,
    "ModelSamplingSD3": ModelSamplingSD3,
    "KSampler": KSampler,
    "SaveImage": SaveImage,
    "PreviewImage": PreviewImage,
}

CORE_NODE_DISPLAY_NAME_MAPPINGS: dict[str, str] = {
    "UNETLoader": "Load Diffusion Model",
    "CLIPLoader": "Load CLIP",
    "CLIPTextEncode": "CLIP Text Encode (Prompt)",
    "EmptyHunyuanLatentVideo": "EmptyHunyuanLatentVideo",
    "ModelSamplingSD3": "ModelSamplingSD3",
    "KSampler": "KSampler",
    "SaveImage": "Save Image",
    "PreviewImage": "Preview Image",
}
