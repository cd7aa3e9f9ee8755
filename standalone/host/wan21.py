"""Wan 2.1 text-to-video diffusion transformer (DiT) in plain torch.

Contract
--------
* Written from the published Wan 2.1 architecture. Module and parameter names
  match ComfyUI's ``WanModel`` exactly, so a ComfyUI Wan 2.1 T2V checkpoint
  loads with ``load_state_dict(strict=True)``::

      patch_embedding (Conv3d)
      text_embedding.{0,2}       time_embedding.{0,2}       time_projection.1
      blocks.N.{self_attn,cross_attn}.{q,k,v,o,norm_q,norm_k}
      blocks.N.norm3   blocks.N.ffn.{0,2}   blocks.N.modulation
      head.head   head.modulation

  Every projection (q/k/v/o, ffn.0, ffn.2, embeddings, head) is a real
  ``nn.Linear`` so a LoRA engine can wrap it by name and ``setattr`` it back.
* The FFN is ComfyUI 0.33's ``WanFeedForward``: ``ffn.2(gelu_tanh(ffn.0(x)))`` through
  ``quant_ops.linear_input_act``, which for an int8-quantized ffn.2 (``TensorWiseINT8Layout``)
  runs comfy-kitchen's fused kernel instead of calling ffn.2's forward, as ComfyUI does.
* ``load_wan_checkpoint`` also reads ComfyUI's quantized checkpoints (``comfy_quant`` keys,
  legacy ``scaled_fp8``); those layers load as ``quant_ops.QuantLinear`` (needs comfy-kitchen).
* ``WanModel.forward(x, timestep, context)``: x ``[B, C_in, T, H, W]``,
  timestep ``[B]`` (sigma * 1000), context ``[B, L, text_dim]``; returns
  ``[B, C_out, T, H, W]`` float32. The text context is used as given (no
  padding, truncation or mask). T, H, W that are not multiples of the patch
  size are circularly padded at the end and the output is cropped back.
* Numerics follow ComfyUI on the CPU: float32 weights (a bf16 file is upcast
  at load), sinusoidal timestep embedding in float32, RoPE angles in float64
  with cos/sin cast to float32 and the rotation applied in float32.
* ``load_wan_checkpoint(path)`` reads a ``.safetensors`` file with or without
  the ``model.diffusion_model.`` key prefix.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import quant_checkpoints, quant_formats, quant_ops

logger = logging.getLogger(__name__)

COMFY_PREFIX = "model.diffusion_model."
HEAD_DIM = 128  # ComfyUI infers num_heads = dim // 128 for Wan.


@dataclass(frozen=True)
class WanConfig:
    """Shape hyper-parameters of a Wan 2.1 T2V DiT."""

    dim: int = 1536
    ffn_dim: int = 8960
    num_layers: int = 30
    num_heads: int = 12
    in_dim: int = 16
    out_dim: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    patch_size: tuple[int, int, int] = (1, 2, 2)
    eps: float = 1e-6

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor]) -> "WanConfig":
        """Infer the config from a (prefix-free) ComfyUI-layout state dict."""
        sd = strip_prefix(sd)
        try:
            pe = sd["patch_embedding.weight"]  # [dim, in_dim, pt, ph, pw]
            ffn0 = sd["blocks.0.ffn.0.weight"]  # [ffn_dim, dim]
            head = sd["head.head.weight"]  # [prod(patch) * out_dim, dim]
            text0 = sd["text_embedding.0.weight"]  # [dim, text_dim]
            time0 = sd["time_embedding.0.weight"]  # [dim, freq_dim]
        except KeyError as exc:
            raise ValueError(f"not a Wan 2.1 state dict: missing key {exc}") from None
        if any(k.startswith("img_emb.") for k in sd):
            raise ValueError("Wan image-to-video checkpoints (img_emb.*) are not supported; T2V only")
        dim, in_dim = int(pe.shape[0]), int(pe.shape[1])
        patch = tuple(int(s) for s in pe.shape[2:])
        num_layers = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
        return cls(
            dim=dim,
            ffn_dim=int(ffn0.shape[0]),
            num_layers=num_layers,
            num_heads=max(dim // HEAD_DIM, 1),
            in_dim=in_dim,
            out_dim=int(head.shape[0]) // math.prod(patch),
            text_dim=int(text0.shape[1]),
            freq_dim=int(time0.shape[1]),
            patch_size=patch,  # type: ignore[arg-type]
        )


def strip_prefix(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop ComfyUI's ``model.diffusion_model.`` prefix where present."""
    n = len(COMFY_PREFIX)
    return {(k[n:] if k.startswith(COMFY_PREFIX) else k): v for k, v in sd.items()}


# --------------------------------------------------------------------------
# embeddings
# --------------------------------------------------------------------------

def sinusoidal_embedding(timestep: torch.Tensor, dim: int) -> torch.Tensor:
    """Float32 sinusoidal embedding: [cos(t*f), sin(t*f)], f = 10000^(-i/half)."""
    half = dim // 2
    pos = timestep.reshape(-1).to(torch.float32)  # [B]
    exponent = -(torch.arange(half, device=pos.device, dtype=torch.float32) / half)
    freqs = torch.pow(10000.0, exponent)  # [half] float32
    angles = torch.outer(pos, freqs)  # [B, half]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)  # [B, dim]


def rope_axes(head_dim: int) -> list[int]:
    """Split of the head dim over (frame, height, width) RoPE axes."""
    sixth = head_dim // 6
    return [head_dim - 4 * sixth, 2 * sixth, 2 * sixth]


def rope_cos_sin(grid: tuple[int, int, int], head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [S, head_dim/2] float32 for a (t, h, w) token grid, theta 10000."""
    t, h, w = grid
    axes = torch.stack(
        torch.meshgrid(
            torch.arange(t, dtype=torch.float64),
            torch.arange(h, dtype=torch.float64),
            torch.arange(w, dtype=torch.float64),
            indexing="ij",
        ),
        dim=-1,
    ).reshape(-1, 3)  # [S, 3] integer positions
    parts = []
    for i, d_axis in enumerate(rope_axes(head_dim)):
        scale = torch.linspace(0.0, (d_axis - 2) / d_axis, d_axis // 2, dtype=torch.float64)
        omega = 1.0 / (10000.0 ** scale)  # [d_axis/2] float64
        parts.append(axes[:, i : i + 1] * omega[None, :])  # [S, d_axis/2]
    angles = torch.cat(parts, dim=1)  # [S, head_dim/2] float64
    cos = torch.cos(angles).to(torch.float32).to(device)
    sin = torch.sin(angles).to(torch.float32).to(device)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive (even, odd) pairs. x: [B, S, N, D]; cos/sin: [S, D/2]."""
    xf = x.to(torch.float32)
    x0, x1 = xf[..., 0::2], xf[..., 1::2]  # [B, S, N, D/2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out0 = c * x0 - s * x1
    out1 = s * x0 + c * x1
    return torch.stack([out0, out1], dim=-1).flatten(-2).type_as(x)  # [B, S, N, D]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Multi-head softmax attention. q: [B, Sq, D]; k, v: [B, Sk, D] -> [B, Sq, D]."""
    b, sq, d = q.shape
    hd = d // heads
    q = q.view(b, sq, heads, hd).transpose(1, 2)  # [B, N, Sq, hd]
    k = k.view(b, -1, heads, hd).transpose(1, 2)
    v = v.view(b, -1, heads, hd).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v)  # [B, N, Sq, hd]
    return out.transpose(1, 2).reshape(b, sq, d)


# --------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------

class WanSelfAttention(nn.Module):
    """q/k/v/o projections with RMS-normalised q and k (+ RoPE for self-attention)."""

    def __init__(self, dim: int, num_heads: int, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = nn.RMSNorm(dim, eps=eps, elementwise_affine=True)
        self.norm_k = nn.RMSNorm(dim, eps=eps, elementwise_affine=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [B, S, D]
        b, s, d = x.shape
        n, hd = self.num_heads, self.head_dim
        q = apply_rope(self.norm_q(self.q(x)).view(b, s, n, hd), cos, sin)
        k = apply_rope(self.norm_k(self.k(x)).view(b, s, n, hd), cos, sin)
        v = self.v(x)
        y = attention(q.reshape(b, s, d), k.reshape(b, s, d), v, n)
        return self.o(y)


class WanCrossAttention(WanSelfAttention):
    """Text cross-attention (T2V): queries from x, keys/values from context."""

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # x: [B, S, D]; context: [B, L, D]
        q = self.norm_q(self.q(x))
        k = self.norm_k(self.k(context))
        v = self.v(context)
        return self.o(attention(q, k, v, self.num_heads))


class WanFeedForward(nn.Sequential):
    """[Linear, GELU(tanh), Linear] (keys ffn.0.*, ffn.2.*), the GELU folded into the
    down-projection as ComfyUI 0.33 does: ``quant_ops.linear_input_act(self[2], self[0](x),
    "gelu_tanh")``. For a plain Linear that is ``self[2](gelu_tanh(self[0](x)))``, the same
    numbers as the Sequential; an int8-quantized ffn.2 runs comfy-kitchen's kernel without its
    forward being called. ``self[1]`` is kept for the layout and is not called."""

    def forward(self, x):
        return quant_ops.linear_input_act(self[2], self[0](x), "gelu_tanh")


class WanAttentionBlock(nn.Module):
    """adaLN-modulated self-attention, cross-attention and GELU(tanh) FFN."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        dim = cfg.dim
        self.norm1 = nn.LayerNorm(dim, eps=cfg.eps, elementwise_affine=False)
        self.self_attn = WanSelfAttention(dim, cfg.num_heads, cfg.eps)
        self.norm3 = nn.LayerNorm(dim, eps=cfg.eps, elementwise_affine=True)
        self.cross_attn = WanCrossAttention(dim, cfg.num_heads, cfg.eps)
        self.norm2 = nn.LayerNorm(dim, eps=cfg.eps, elementwise_affine=False)
        self.ffn = WanFeedForward(
            nn.Linear(dim, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, dim)
        )
        self.modulation = nn.Parameter(torch.zeros(1, 6, dim))

    def forward(self, x, e, context, cos, sin):
        # x: [B, S, D]; e: [B, 6, D] (time projection); context: [B, L, D]
        mod = (self.modulation.to(x.dtype) + e).unsqueeze(2)  # [B, 6, 1, D]
        shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = mod.unbind(1)  # each [B, 1, D]
        y = self.self_attn(shift_sa + self.norm1(x) * (1 + scale_sa), cos, sin)
        x = x + y * gate_sa
        x = x + self.cross_attn(self.norm3(x), context)
        y = self.ffn(shift_ff + self.norm2(x) * (1 + scale_ff))
        return x + y * gate_ff


class Head(nn.Module):
    """Final adaLN-modulated LayerNorm + linear to patch pixels."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=False)
        self.head = nn.Linear(cfg.dim, math.prod(cfg.patch_size) * cfg.out_dim)
        self.modulation = nn.Parameter(torch.zeros(1, 2, cfg.dim))

    def forward(self, x, e):
        # x: [B, S, D]; e: [B, D] (time embedding)
        mod = (self.modulation.to(x.dtype) + e.unsqueeze(1)).unsqueeze(2)  # [B, 2, 1, D]
        shift, scale = mod.unbind(1)  # each [B, 1, D]
        return self.head(shift + self.norm(x) * (1 + scale))  # [B, S, prod(patch)*C_out]


class WanModel(nn.Module):
    """Wan 2.1 T2V DiT with ComfyUI's parameter names."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.config = cfg
        d = cfg.dim
        if d % cfg.num_heads:
            raise ValueError(f"dim {d} is not divisible by num_heads {cfg.num_heads}")
        self.patch_embedding = nn.Conv3d(cfg.in_dim, d, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.text_embedding = nn.Sequential(
            nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d)
        )
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList([WanAttentionBlock(cfg) for _ in range(cfg.num_layers)])
        self.head = Head(cfg)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        # x: [B, C_in, T, H, W]; timestep: [B]; context: [B, L, text_dim]
        cfg = self.config
        if x.ndim != 5:
            raise ValueError(f"x must be [B, C, T, H, W], got shape {tuple(x.shape)}")
        b, _, t, h, w = x.shape
        dtype = self.patch_embedding.weight.dtype
        x = _pad_to_patch(x, cfg.patch_size)

        x = self.patch_embedding(x.to(dtype))  # [B, D, t', h', w']
        grid = tuple(int(s) for s in x.shape[2:])
        x = x.flatten(2).transpose(1, 2)  # [B, S, D]
        cos, sin = rope_cos_sin(grid, cfg.dim // cfg.num_heads, x.device)

        timestep = timestep.reshape(-1)
        if timestep.numel() == 1 and b > 1:
            timestep = timestep.expand(b)
        e = self.time_embedding(sinusoidal_embedding(timestep, cfg.freq_dim).to(dtype))  # [B, D]
        e6 = self.time_projection(e).unflatten(1, (6, cfg.dim))  # [B, 6, D]

        ctx = self.text_embedding(context.to(dtype))  # [B, L, D]
        for block in self.blocks:
            x = block(x, e6, ctx, cos, sin)

        x = self.head(x, e)  # [B, S, pt*ph*pw*C_out]
        out = self._unpatchify(x, grid)  # [B, C_out, T', H', W']
        return out[:, :, :t, :h, :w].to(torch.float32)

    def _unpatchify(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        # x: [B, S, pt*ph*pw*C] with C fastest -> [B, C, t*pt, h*ph, w*pw]
        pt, ph, pw = self.config.patch_size
        c = self.config.out_dim
        gt, gh, gw = grid
        x = x.reshape(x.shape[0], gt, gh, gw, pt, ph, pw, c)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # [B, C, gt, pt, gh, ph, gw, pw]
        return x.reshape(x.shape[0], c, gt * pt, gh * ph, gw * pw)


def _pad_to_patch(x: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """Circularly pad T, H, W at the end up to multiples of the patch size."""
    pad: list[int] = []
    for size, p in zip(reversed(x.shape[2:]), reversed(patch)):
        pad += [0, (p - size % p) % p]  # F.pad lists the last dim first
    if not any(pad):
        return x
    return F.pad(x, pad, mode="circular")


def load_wan_checkpoint(path, dtype: torch.dtype = torch.float32, device="cpu") -> WanModel:
    """Build a WanModel from a ComfyUI-layout Wan 2.1 T2V ``.safetensors`` file.

    A file with ComfyUI-quantized layers (``*.comfy_quant`` keys, ``_quantization_metadata``,
    or a legacy ``scaled_fp8`` marker) loads those Linears as `quant_ops.QuantLinear` (their
    weights reporting `dtype`); that needs comfy-kitchen, and without it the error names the
    file and the package to install."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: only .safetensors checkpoints are supported")
    raw, metadata = quant_checkpoints.read_safetensors(path)
    quantized = quant_checkpoints.has_quantized_layers(raw, metadata)
    if quantized:
        quant_formats.require_comfy_kitchen(str(path))
        raw = quant_checkpoints.convert_old_quants(raw, metadata, prefixes=("", COMFY_PREFIX))
    sd = strip_prefix(raw)
    try:
        cfg = WanConfig.from_state_dict(quant_checkpoints.shape_view(sd) if quantized else sd)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    with torch.device("meta"):
        model = WanModel(cfg)
    if quantized:
        quant_checkpoints.load_quantized_state_dict(model, sd, dtype=dtype, source=str(path))
    else:
        expected = set(model.state_dict().keys())
        missing = sorted(expected - sd.keys())
        unexpected = sorted(sd.keys() - expected)
        if missing or unexpected:
            raise ValueError(
                f"{path}: state dict does not match a Wan 2.1 T2V model ({cfg}); "
                f"missing keys: {missing}; unexpected keys: {unexpected}"
            )
        sd = {k: v.to(dtype=dtype) for k, v in sd.items()}
        model.load_state_dict(sd, strict=True, assign=True)
    model = model.to(device).eval()
    model.requires_grad_(False)
    logger.info("loaded Wan 2.1 T2V %s from %s (%s%s)", cfg, path, dtype,
                ", quantized layers" if quantized else "")
    return model
