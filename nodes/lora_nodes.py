"""The pack's LoRA nodes. Thin: validate, clone the MODEL, record intent, call the engine.

Only the LoRA Sampler touches weights, and only while it samples: it plans the
adapters recorded on its MODEL, applies them (wrap / merge / mount fusions), runs the
host's sampler, and restores every weight bit for bit on the way out — also when
sampling fails or is interrupted.
"""
from __future__ import annotations

import logging
import time

from .. import host
from ..lora_runtime import AdapterSpec, LoraRuntimeError, applied, match_adapter, plan
from ..lora_runtime.settings import STRENGTH_MAX, STRENGTH_MIN, MergeMode, Tier
from . import intent, report
from .caches import ADAPTERS, decision_cache_for

log = logging.getLogger(__name__)

CATEGORY = "loaders/lora runtime"


class LoadLoraAdapter:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The diffusion model the adapter is for. It is cloned, never changed."}),
            "lora_name": (host.lora_names(), {"tooltip": "A .safetensors LoRA from the loras folder "
                                                          "(kohya, PEFT/diffusers, Wan trainer dialects)."}),
            "strength": ("FLOAT", {"default": 1.0, "min": STRENGTH_MIN, "max": STRENGTH_MAX, "step": 0.01,
                                   "tooltip": "How strongly to apply the adapter; 0 turns it off, "
                                              "negative values invert it."}),
        }}

    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The model with this adapter added (applied when the LoRA Sampler runs).",)
    FUNCTION = "load"
    CATEGORY = CATEGORY
    DESCRIPTION = "Adds a LoRA adapter to the model. Chain several to stack adapters."

    @classmethod
    def VALIDATE_INPUTS(cls, lora_name):
        try:
            host.resolve_lora(lora_name)
        except (ValueError, FileNotFoundError) as e:
            return str(e)
        return True

    def load(self, model, lora_name, strength):
        path = host.resolve_lora(lora_name)
        adapter = ADAPTERS.load(path)
        _, coverage = match_adapter(adapter, host.diffusion_model(model))  # zero matches raises here
        current = intent.read(model)
        entry = {"name": lora_name, "path": path, "strength": float(strength)}
        out = intent.with_changes(model, adapters=current["adapters"] + [entry])
        return {"ui": {"lora_coverage": [coverage.to_dict()]}, "result": (out,)}


class LoraMergeMode:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL",),
            "mode": ([m.value for m in MergeMode], {"default": MergeMode.AUTO.value, "tooltip":
                     "auto: merge unless a merge would round away more than half of the adapters' update; "
                     "merge: always fold into the weights; dynamic: never touch the weights."}),
        }}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "set_mode"
    CATEGORY = CATEGORY
    DESCRIPTION = "How the LoRA Sampler applies the adapters on this model."

    def set_mode(self, model, mode):
        return (intent.with_changes(model, mode=MergeMode(mode).value),)


class LoraQualityTier:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL",),
            "tier": ([t.value for t in Tier], {"default": Tier.LOSSLESS.value, "tooltip":
                     "exact: bit-identical to the eager reference; lossless: no measurable loss, fused "
                     "kernels allowed; high: close (PSNR >= 30 dB), approximations allowed."}),
        }}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "set_tier"
    CATEGORY = CATEGORY
    DESCRIPTION = "What the LoRA Sampler guarantees about its numerics on this model."

    def set_tier(self, model, tier):
        return (intent.with_changes(model, tier=Tier(tier).value),)


class LoraSampler:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The model with its adapters, merge mode and tier."}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 0xffffffffffffffff, "control_after_generate": True,
                             "tooltip": "The random seed for the noise."}),
            "steps": ("INT", {"default": 20, "min": 1, "max": 10000, "tooltip": "Denoising steps."}),
            "cfg": ("FLOAT", {"default": 5.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01,
                              "tooltip": "Classifier-free guidance scale; 1.0 skips the negative."}),
            "sampler_name": (host.sampler_names(), {"tooltip": "The sampling algorithm."}),
            "scheduler": (host.scheduler_names(), {"tooltip": "The sigma schedule."}),
            "positive": ("CONDITIONING", {"tooltip": "What to include."}),
            "negative": ("CONDITIONING", {"tooltip": "What to exclude."}),
            "latent_image": ("LATENT", {"tooltip": "The latent to denoise."}),
            "denoise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                  "tooltip": "How much of the latent to replace."}),
        }}

    RETURN_TYPES = ("LATENT",)
    OUTPUT_TOOLTIPS = ("The denoised latent.",)
    FUNCTION = "sample"
    CATEGORY = CATEGORY
    DESCRIPTION = ("KSampler that applies the model's LoRA adapters exactly (measured merge decision, "
                   "guarded fused kernels) and restores every weight afterwards.")

    def sample(self, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
               denoise=1.0):
        want = intent.read(model)
        dm = host.diffusion_model(model)
        specs = [AdapterSpec(a["path"], a["strength"], a["name"]) for a in want["adapters"]]
        p = plan(dm, specs, want["mode"], want["tier"], loader=ADAPTERS.load)
        t0 = time.perf_counter()
        with applied(dm, p, cache=decision_cache_for(dm)) as applied_report:
            t_sample = time.perf_counter()
            latent = host.sample(model, seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name,
                                 scheduler=scheduler, positive=positive, negative=negative, latent=latent_image,
                                 denoise=denoise)
            sample_seconds = time.perf_counter() - t_sample
        r = report.build(applied_report if specs else None, mode=want["mode"], tier=want["tier"], host=host.NAME,
                         sample_seconds=sample_seconds, steps=steps)
        r["total_seconds"] = round(time.perf_counter() - t0, 4)
        log.info("%s", report.text(r))
        return {"ui": {"lora_report": [r]}, "result": (latent,)}


NODE_CLASS_MAPPINGS = {
    "LoraRuntimeLoadAdapter": LoadLoraAdapter,
    "LoraRuntimeMergeMode": LoraMergeMode,
    "LoraRuntimeQualityTier": LoraQualityTier,
    "LoraRuntimeSampler": LoraSampler,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "LoraRuntimeLoadAdapter": "Load LoRA Adapter",
    "LoraRuntimeMergeMode": "LoRA Merge Mode",
    "LoraRuntimeQualityTier": "LoRA Quality Tier",
    "LoraRuntimeSampler": "LoRA Sampler",
}
