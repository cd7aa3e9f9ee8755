"""TinyCodec: the embedded model's "VAE", a PCA of 8x8x3 pixel patches.

Contract
--------
* Images are ComfyUI IMAGE tensors ``[B, 64, 64, 3]`` float 0..1; latents are
  ComfyUI LATENT samples ``[B, 16, 1, 8, 8]`` (Wan 2.1 layout: 16 channels,
  one frame, 8x8 spatial = one latent pixel per 8x8 image patch).
* Each 8x8x3 patch is projected on 16 principal components (``components``
  ``[16, 192]``, patch ``mean`` ``[192]``), divided by ONE shared ``scale`` so
  the latent has unit variance overall. That single-scale latent is what the
  diffusion model is trained on ("model space").
* ComfyUI applies Wan 2.1's per-channel mean/std around the model
  (``process_in`` before, ``process_out`` after sampling), so the codec's raw
  latents are ``encode = process_out(coeffs / scale)`` and
  ``decode(x) = patches(process_in(x) * scale)``; the model then sees exactly
  the single-scale latent.
* Decoding projects back on the components and then applies a fitted tone
  curve (``tone`` ``[64]``: the mean true pixel value per bin of the linear
  reconstruction over ``[TONE_LO, TONE_HI]``, read with linear interpolation):
  the glyphs are flat colour on black, so this sharpens the blur the 16
  components leave (+1.7 dB) at no cost.
* ``fit(images)`` computes the PCA (float64 eigendecomposition of the patch
  covariance) and the tone curve; ``save``/``load`` use safetensors (float32).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..host.bundled import latent_format

logger = logging.getLogger(__name__)

PATCH = 8
IMAGE_SIZE = 64
GRID = IMAGE_SIZE // PATCH
LATENT_CHANNELS = 16
PATCH_DIM = PATCH * PATCH * 3
TONE_BINS = 64
TONE_LO, TONE_HI = -0.3, 1.3


def to_patches(images: torch.Tensor) -> torch.Tensor:
    """[B, 64, 64, 3] -> [B, 8, 8, 192] (row-major patch grid, pixels y, x, c)."""
    b = images.shape[0]
    x = images.reshape(b, GRID, PATCH, GRID, PATCH, 3).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, GRID, GRID, PATCH_DIM)


def from_patches(patches: torch.Tensor) -> torch.Tensor:
    """[B, 8, 8, 192] -> [B, 64, 64, 3]."""
    b = patches.shape[0]
    x = patches.reshape(b, GRID, GRID, PATCH, PATCH, 3).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, IMAGE_SIZE, IMAGE_SIZE, 3)


class TinyCodec:
    """PCA patch codec between IMAGE [B, 64, 64, 3] and LATENT [B, 16, 1, 8, 8]."""

    def __init__(self, components: torch.Tensor, mean: torch.Tensor, scale: float, tone: torch.Tensor | None = None):
        if tuple(components.shape) != (LATENT_CHANNELS, PATCH_DIM) or tuple(mean.shape) != (PATCH_DIM,):
            raise ValueError(f"codec tensors have shapes {tuple(components.shape)}, {tuple(mean.shape)}; "
                             f"expected ({LATENT_CHANNELS}, {PATCH_DIM}) and ({PATCH_DIM},)")
        if tone is not None and tuple(tone.shape) != (TONE_BINS,):
            raise ValueError(f"codec tone curve has shape {tuple(tone.shape)}; expected ({TONE_BINS},)")
        self.components = components.to(torch.float32).contiguous()  # [16, 192], orthonormal rows
        self.mean = mean.to(torch.float32).contiguous()  # [192]
        self.scale = float(scale)
        self.tone = None if tone is None else tone.to(torch.float32).contiguous()  # [64] or None (linear)

    # -- fitting / files -----------------------------------------------------------
    @classmethod
    def fit(cls, images: torch.Tensor) -> "TinyCodec":
        """PCA over every 8x8x3 patch of ``images`` [N, 64, 64, 3] float 0..1."""
        p = to_patches(images.to(torch.float64)).reshape(-1, PATCH_DIM)  # [N*64, 192]
        mean = p.mean(0)
        cov = (p - mean).T @ (p - mean) / p.shape[0]
        evals, evecs = torch.linalg.eigh(cov)  # ascending
        comps = evecs[:, torch.argsort(evals, descending=True)[:LATENT_CHANNELS]].T  # [16, 192]
        # a deterministic sign: the largest-magnitude entry of each component is positive
        idx = comps.abs().argmax(1)
        comps = comps * torch.sign(comps.gather(1, idx[:, None]))
        coeffs = (p - mean) @ comps.T  # [N*64, 16]
        scale = float(coeffs.pow(2).mean().sqrt())  # ONE shared scale: unit variance overall
        kept = float(evals.sort(descending=True).values[:LATENT_CHANNELS].sum() / evals.sum())
        logger.info("codec fit on %d patches: %.4f of the variance kept, scale %.4f", p.shape[0], kept, scale)
        linear = cls(comps.to(torch.float32), mean.to(torch.float32), scale)
        rec = linear._linear_images(linear.encode_model(images.to(torch.float32)))  # unclamped
        bins = _tone_bin(rec).flatten()
        sums = torch.zeros(TONE_BINS, dtype=torch.float64).index_add_(0, bins, images.flatten().to(torch.float64))
        counts = torch.bincount(bins, minlength=TONE_BINS).to(torch.float64)
        centres = torch.linspace(TONE_LO, TONE_HI, 2 * TONE_BINS + 1, dtype=torch.float64)[1::2].clamp(0, 1)
        tone = torch.where(counts > 0, sums / counts.clamp(min=1), centres)  # empty bin: identity (clamped)
        return cls(linear.components, linear.mean, scale, tone.to(torch.float32))

    def save(self, path) -> None:
        from safetensors.torch import save_file

        sd = {"components": self.components, "mean": self.mean,
              "scale": torch.tensor([self.scale], dtype=torch.float32)}
        if self.tone is not None:
            sd["tone"] = self.tone
        save_file(sd, str(path), metadata={"format": "tiny_codec_pca8"})  # one key: byte-reproducible header

    @classmethod
    def load(cls, path) -> "TinyCodec":
        from safetensors.torch import load_file

        path = Path(path)
        if path.suffix != ".safetensors":
            raise ValueError(f"{path}: the codec is stored as .safetensors")
        sd = load_file(str(path))
        try:
            return cls(sd["components"], sd["mean"], float(sd["scale"].reshape(-1)[0]), sd.get("tone"))
        except KeyError as exc:
            raise ValueError(f"{path}: not a TinyCodec file (missing {exc})") from None

    # -- model-space (single scale) ------------------------------------------------
    def encode_model(self, images: torch.Tensor) -> torch.Tensor:
        """IMAGE [B, 64, 64, 3] -> model-space latent [B, 16, 1, 8, 8] (what the DiT sees)."""
        p = to_patches(images.to(torch.float32))  # [B, 8, 8, 192]
        z = (p - self.mean) @ self.components.T / self.scale  # [B, 8, 8, 16]
        return z.permute(0, 3, 1, 2).unsqueeze(2).contiguous()

    def decode_model(self, z: torch.Tensor) -> torch.Tensor:
        """Model-space latent [B, 16, 1, 8, 8] -> IMAGE [B, 64, 64, 3] clamped to 0..1."""
        if z.ndim != 5 or z.shape[1] != LATENT_CHANNELS or tuple(z.shape[3:]) != (GRID, GRID):
            raise ValueError(f"latent must be [B, {LATENT_CHANNELS}, 1, {GRID}, {GRID}], got {tuple(z.shape)}")
        rec = self._linear_images(z)
        if self.tone is None:
            return rec.clamp(0.0, 1.0)
        pos = ((rec - TONE_LO) / (TONE_HI - TONE_LO) * TONE_BINS - 0.5).clamp(0, TONE_BINS - 1)
        i0 = pos.floor().long().clamp(max=TONE_BINS - 2)
        frac = pos - i0
        return (self.tone[i0] * (1 - frac) + self.tone[i0 + 1] * frac).clamp(0.0, 1.0)

    def _linear_images(self, z: torch.Tensor) -> torch.Tensor:
        # model-space latent [B, 16, 1, 8, 8] -> unclamped linear reconstruction [B, 64, 64, 3]
        c = z[:, :, 0].to(torch.float32).permute(0, 2, 3, 1)  # [B, 8, 8, 16]
        return from_patches(c * self.scale @ self.components + self.mean)  # [B, 64, 64, 3]

    # -- ComfyUI (VAE space) ---------------------------------------------------------
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """IMAGE [B, 64, 64, 3] -> LATENT samples [B, 16, 1, 8, 8] (VAE space)."""
        if images.ndim != 4 or tuple(images.shape[1:]) != (IMAGE_SIZE, IMAGE_SIZE, 3):
            raise ValueError(f"images must be [B, {IMAGE_SIZE}, {IMAGE_SIZE}, 3], got {tuple(images.shape)}")
        return latent_format.process_out(self.encode_model(images))

    def decode(self, samples: torch.Tensor) -> torch.Tensor:
        """LATENT samples [B, 16, 1, 8, 8] (VAE space) -> IMAGE [B, 64, 64, 3] float 0..1."""
        if samples.ndim == 4:
            samples = samples.unsqueeze(2)
        return self.decode_model(latent_format.process_in(samples.to(torch.float32)))


def _tone_bin(x: torch.Tensor) -> torch.Tensor:
    return ((x - TONE_LO) / (TONE_HI - TONE_LO) * TONE_BINS).floor().clamp(0, TONE_BINS - 1).long()


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two images in 0..1 over the whole batch."""
    mse = float((a.to(torch.float64) - b.to(torch.float64)).pow(2).mean())
    return float("inf") if mse == 0 else 10.0 * torch.log10(torch.tensor(1.0 / mse)).item()
