"""Wan 2.1 latent format: per-channel normalisation between VAE and model space.

Contract
--------
* ``process_in(latent)``:  VAE-space -> model-space, ``(latent - mean) * scale_factor / std``.
* ``process_out(latent)``: model-space -> VAE-space, ``latent * std / scale_factor + mean``.
* Latents are ``[B, 16, T, H, W]``; the constants broadcast as ``[1, 16, 1, 1, 1]``
  and are cast to the latent's device and dtype. The operation order matches
  ComfyUI's ``latent_formats.Wan21`` so float32 results agree bit for bit.
"""
from __future__ import annotations

import torch

LATENT_CHANNELS = 16
SCALE_FACTOR = 1.0

# Per-channel statistics of the Wan 2.1 VAE latent space (data, as published).
LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)
LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)


def _stat(values: tuple[float, ...], like: torch.Tensor) -> torch.Tensor:
    # -> [1, 16, 1, ..., 1] matching like.ndim, float32 first as ComfyUI stores it
    t = torch.tensor(values, dtype=torch.float32)
    t = t.view(1, LATENT_CHANNELS, *([1] * (like.ndim - 2)))
    return t.to(device=like.device, dtype=like.dtype)


def _check(latent: torch.Tensor) -> None:
    if latent.ndim < 2 or latent.shape[1] != LATENT_CHANNELS:
        raise ValueError(f"Wan 2.1 latents need {LATENT_CHANNELS} channels in dim 1, got shape {tuple(latent.shape)}")


def process_in(latent: torch.Tensor) -> torch.Tensor:
    """VAE-space latent -> model-space latent."""
    _check(latent)
    return (latent - _stat(LATENTS_MEAN, latent)) * SCALE_FACTOR / _stat(LATENTS_STD, latent)


def process_out(latent: torch.Tensor) -> torch.Tensor:
    """Model-space latent -> VAE-space latent."""
    _check(latent)
    return latent * _stat(LATENTS_STD, latent) / SCALE_FACTOR + _stat(LATENTS_MEAN, latent)
