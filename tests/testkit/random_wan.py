"""A random-weight Wan 2.1 T2V diffusion model in ComfyUI's key layout at any width: the
reference tiny Wan's recipe (``shared/reference/README.md``) at other dims. Used where the
reference d128 model does not fit (layouts that need a width that is a multiple of 256) and by
the bench (Wan-1.3B dims).

Contract
- `wan_shapes(dim, ffn, blocks)`: every tensor name -> shape (no prefix; in/out 16 channels,
  patch 1x2x2, text_dim 4096, freq_dim 256); ComfyUI reads ``dim // 128`` heads from it.
- `block_linears(dim, ffn, blocks)`: (layer, in, out) of every block linear (self/cross-attention
  q k v o, ffn.0, ffn.2), in the order `testkit.lora_assets.write_kohya_lora` takes as `modules`.
- `write_random_wan(path, dim, ffn, blocks)`: the model as safetensors, bf16.
"""
from __future__ import annotations

import math
from pathlib import Path

TEXT_DIM, FREQ_DIM, IN_CH = 4096, 256, 16
SEED = 20251011


def wan_shapes(dim: int, ffn: int, blocks: int) -> dict[str, tuple[int, ...]]:
    s = {"patch_embedding.weight": (dim, IN_CH, 1, 2, 2), "patch_embedding.bias": (dim,),
         "text_embedding.0.weight": (dim, TEXT_DIM), "text_embedding.0.bias": (dim,),
         "text_embedding.2.weight": (dim, dim), "text_embedding.2.bias": (dim,),
         "time_embedding.0.weight": (dim, FREQ_DIM), "time_embedding.0.bias": (dim,),
         "time_embedding.2.weight": (dim, dim), "time_embedding.2.bias": (dim,),
         "time_projection.1.weight": (6 * dim, dim), "time_projection.1.bias": (6 * dim,),
         "head.head.weight": (IN_CH * 4, dim), "head.head.bias": (IN_CH * 4,), "head.modulation": (1, 2, dim)}
    for b in range(blocks):
        p = f"blocks.{b}."
        for attn in ("self_attn", "cross_attn"):
            for n in "qkvo":
                s[f"{p}{attn}.{n}.weight"], s[f"{p}{attn}.{n}.bias"] = (dim, dim), (dim,)
            s[f"{p}{attn}.norm_q.weight"] = s[f"{p}{attn}.norm_k.weight"] = (dim,)
        s[f"{p}ffn.0.weight"], s[f"{p}ffn.0.bias"] = (ffn, dim), (ffn,)
        s[f"{p}ffn.2.weight"], s[f"{p}ffn.2.bias"] = (dim, ffn), (dim,)
        s[f"{p}norm3.weight"], s[f"{p}norm3.bias"] = (dim,), (dim,)
        s[f"{p}modulation"] = (1, 6, dim)
    return s


def block_linears(dim: int, ffn: int, blocks: int) -> list[tuple[str, int, int]]:
    out = []
    for b in range(blocks):
        for attn in ("self_attn", "cross_attn"):
            out += [(f"blocks.{b}.{attn}.{n}", dim, dim) for n in "qkvo"]
        out += [(f"blocks.{b}.ffn.0", dim, ffn), (f"blocks.{b}.ffn.2", ffn, dim)]
    return out


def write_random_wan(path: Path, dim: int, ffn: int, blocks: int) -> None:
    """Keys sorted, one generator (seed 20251011); norms 1 + 0.1 r, biases 0.1 r, modulations
    r / sqrt(dim), other weights r / sqrt(fan_in); bf16."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(SEED)
    sd = {}
    for k, shape in sorted(wan_shapes(dim, ffn, blocks).items()):
        r = torch.randn(shape, generator=g)
        if k.endswith(("norm_q.weight", "norm_k.weight", "norm3.weight")):
            v = 1 + 0.1 * r
        elif k.endswith(".bias"):
            v = 0.1 * r
        elif k.endswith("modulation"):
            v = r / math.sqrt(dim)
        else:
            v = r / math.sqrt(math.prod(shape[1:]))
        sd[k] = v.to(torch.bfloat16)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path))
