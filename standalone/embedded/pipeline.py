"""Prompt -> KSampler -> image for the embedded model, the way ComfyUI runs it.

``generate(model, text_encoder, codec, prompts, seed=...)`` encodes every prompt
(one conditioning row per image) and the empty negative, runs the bundled
KSampler (flow/CONST, shift 8, euler, simple) on an empty ``[B, 16, 1, 8, 8]``
latent with one seeded noise draw, and decodes the process_out'ed LATENT with
the codec. Returns IMAGE ``[B, 64, 64, 3]`` float 0..1.
"""
from __future__ import annotations

import logging

import torch

from . import DEFAULT_CFG, DEFAULT_SAMPLER, DEFAULT_SCHEDULER, DEFAULT_SHIFT, DEFAULT_STEPS
from ..host.sampling import ksampler

logger = logging.getLogger(__name__)


def empty_latent(batch: int) -> dict:
    """ComfyUI's EmptyHunyuanLatentVideo-style LATENT for 64x64, one frame."""
    return {"samples": torch.zeros(batch, 16, 1, 8, 8)}


@torch.no_grad()
def generate(model, text_encoder, codec, prompts: list[str], *, seed: int = 0, steps: int = DEFAULT_STEPS,
             cfg: float = DEFAULT_CFG, shift: float = DEFAULT_SHIFT, sampler_name: str = DEFAULT_SAMPLER,
             scheduler: str = DEFAULT_SCHEDULER, negative: str = "") -> torch.Tensor:
    """IMAGE [B, 64, 64, 3] for B prompts, sampled in one batch."""
    positive = text_encoder.encode_batch(list(prompts))  # [B, L, 4096]
    neg = text_encoder.encode(negative)  # [1, L, 4096]
    out = ksampler(model, seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name, scheduler=scheduler,
                   positive=[[positive, {}]], negative=[[neg, {}]], latent=empty_latent(len(prompts)),
                   shift=shift)
    return codec.decode(out["samples"])


def mean_abs_diff_255(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean absolute difference of two IMAGE batches on the 0..255 pixel scale."""
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().mean() * 255.0)
