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
* Optional learned decoder (``fit_decoder``): a 3x3 conv over the latent grid and
  two 1x1 convs (16 -> 192 -> 192 -> 192 per patch) that add a correction to the
  linear reconstruction. The encoder stays the PCA (the DiT's latent space does
  not change); the decoder sees each patch's neighbours, so it can tell the
  glyph's colour and edges the 16 components blur (26 -> 31 dB on held-out
  glyphs), and it is trained on noisy latents so sampled latents decode clean.
  When present it replaces the tone curve.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from ..host import latent_format

logger = logging.getLogger(__name__)

PATCH = 8
IMAGE_SIZE = 64
GRID = IMAGE_SIZE // PATCH
LATENT_CHANNELS = 16
PATCH_DIM = PATCH * PATCH * 3
TONE_BINS = 64
TONE_LO, TONE_HI = -0.3, 1.3
DECODER_HIDDEN = 192
DECODER_KEYS = ("dec.c1.weight", "dec.c1.bias", "dec.c2.weight", "dec.c2.bias", "dec.c3.weight", "dec.c3.bias")


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
        self.decoder: dict[str, torch.Tensor] | None = None  # learned correction (DECODER_KEYS) or None

    def set_decoder(self, tensors: dict[str, torch.Tensor] | None) -> None:
        if tensors is not None:
            h = DECODER_HIDDEN
            want = {"dec.c1.weight": (h, LATENT_CHANNELS, 3, 3), "dec.c1.bias": (h,), "dec.c2.weight": (h, h, 1, 1),
                    "dec.c2.bias": (h,), "dec.c3.weight": (PATCH_DIM, h, 1, 1), "dec.c3.bias": (PATCH_DIM,)}
            for k, shape in want.items():
                if k not in tensors or tuple(tensors[k].shape) != shape:
                    got = tuple(tensors[k].shape) if k in tensors else "missing"
                    raise ValueError(f"codec decoder tensor {k}: {got}; expected {shape}")
            tensors = {k: tensors[k].to(torch.float32).contiguous() for k in DECODER_KEYS}
        self.decoder = tensors

    @staticmethod
    def decoder_correction(params: dict[str, torch.Tensor], z: torch.Tensor) -> torch.Tensor:
        """Model-space latent [B, 16, 8, 8] -> per-patch pixel correction [B, 8, 8, 192]."""
        h = F.gelu(F.conv2d(z, params["dec.c1.weight"], params["dec.c1.bias"], padding=1))
        h = F.gelu(F.conv2d(h, params["dec.c2.weight"], params["dec.c2.bias"]))
        return F.conv2d(h, params["dec.c3.weight"], params["dec.c3.bias"]).permute(0, 2, 3, 1)

    def fit_decoder(self, images: torch.Tensor, steps: int, seed: int, batch: int = 96, lr: float = 2e-3,
                    noise_std: float = 0.1, log_every: int = 250) -> None:
        """Train the learned decoder on ``images`` [N, 64, 64, 3] (float 0..1), deterministic from ``seed``.
        Half of each batch gets latent noise of a random std up to ``noise_std`` (sampled latents are noisy)."""
        import math

        gen = torch.Generator().manual_seed(seed)
        h = DECODER_HIDDEN
        c1, c2, c3 = (torch.nn.Conv2d(LATENT_CHANNELS, h, 3, padding=1), torch.nn.Conv2d(h, h, 1),
                      torch.nn.Conv2d(h, PATCH_DIM, 1))
        with torch.no_grad():  # seeded init (not the global RNG); the correction starts at zero
            for conv in (c1, c2):
                bound = 1.0 / math.sqrt(conv.weight[0].numel())
                conv.weight.copy_((torch.rand(conv.weight.shape, generator=gen) * 2 - 1) * bound)
                conv.bias.zero_()
            c3.weight.zero_()
            c3.bias.zero_()
        params = {"dec.c1.weight": c1.weight, "dec.c1.bias": c1.bias, "dec.c2.weight": c2.weight,
                  "dec.c2.bias": c2.bias, "dec.c3.weight": c3.weight, "dec.c3.bias": c3.bias}
        opt = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=0.0)
        x = images.to(torch.float32)
        z_all = self.encode_model(x)  # [N, 16, 1, 8, 8]
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
            idx = torch.randint(0, x.shape[0], (batch,), generator=gen)
            z = z_all[idx]
            noisy = torch.rand(batch, 1, 1, 1, 1, generator=gen) * noise_std * (torch.arange(batch) % 2).view(-1, 1, 1, 1, 1)
            z = z + noisy * torch.randn(z.shape, generator=gen)
            out = self._decode_with(params, z)
            loss = F.mse_loss(out, x[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % log_every == 0 or step == steps - 1:
                logger.info("codec decoder step %d/%d loss %.5f", step, steps, loss.item())
        self.set_decoder({k: v.detach().clone() for k, v in params.items()})

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
        if self.decoder is not None:
            sd.update(self.decoder)
        save_file(sd, str(path), metadata={"format": "tiny_codec_pca8"})  # one key: byte-reproducible header

    @classmethod
    def load(cls, path) -> "TinyCodec":
        from safetensors.torch import load_file

        path = Path(path)
        if path.suffix != ".safetensors":
            raise ValueError(f"{path}: the codec is stored as .safetensors")
        sd = load_file(str(path))
        try:
            codec = cls(sd["components"], sd["mean"], float(sd["scale"].reshape(-1)[0]), sd.get("tone"))
        except KeyError as exc:
            raise ValueError(f"{path}: not a TinyCodec file (missing {exc})") from None
        if any(k.startswith("dec.") for k in sd):
            try:
                codec.set_decoder({k: v for k, v in sd.items() if k.startswith("dec.")})
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
        return codec

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
        if self.decoder is not None:
            return self._decode_with(self.decoder, z).clamp(0.0, 1.0)
        rec = self._linear_images(z)
        if self.tone is None:
            return rec.clamp(0.0, 1.0)
        pos = ((rec - TONE_LO) / (TONE_HI - TONE_LO) * TONE_BINS - 0.5).clamp(0, TONE_BINS - 1)
        i0 = pos.floor().long().clamp(max=TONE_BINS - 2)
        frac = pos - i0
        return (self.tone[i0] * (1 - frac) + self.tone[i0 + 1] * frac).clamp(0.0, 1.0)

    def _decode_with(self, params: dict[str, torch.Tensor], z: torch.Tensor) -> torch.Tensor:
        # model-space latent [B, 16, 1, 8, 8] -> linear reconstruction + learned correction (unclamped)
        zz = z[:, :, 0].to(torch.float32)  # [B, 16, 8, 8]
        lin = zz.permute(0, 2, 3, 1) * self.scale @ self.components + self.mean  # [B, 8, 8, 192]
        return from_patches(lin + self.decoder_correction(params, zz))

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
