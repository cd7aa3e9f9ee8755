"""Adapter files the integration tests write: the reference tiny Wan's 20 Linear layers,
kohya keys, a fixed generator per seed (same seed -> same tensors in every test file)."""
import math

import torch
from safetensors.torch import save_file

DIM, FFN, BLOCKS = 128, 512, 2  # the reference tiny Wan (tests/data/comfyui-0.3.64)


def _wan_modules():
    for b in range(BLOCKS):
        for attn in ("self_attn", "cross_attn"):
            for p in ("q", "k", "v", "o"):
                yield f"blocks.{b}.{attn}.{p}", DIM, DIM
        yield f"blocks.{b}.ffn.0", DIM, FFN
        yield f"blocks.{b}.ffn.2", FFN, DIM


def write_kohya_lora(path, *, seed, rank, alpha, up_scale=0.5, dtype=torch.float32, modules=None):
    """kohya/ComfyUI keys: diffusion_model.<module>.lora_down.weight [r,in], .lora_up.weight
    [out,r], .alpha. Sized so that the update is about half the weight's own scale."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, fan_in, fan_out in (modules or _wan_modules()):
        down = torch.randn(rank, fan_in, generator=g) / math.sqrt(fan_in)
        up = torch.randn(fan_out, rank, generator=g) * (up_scale * math.sqrt(rank) / alpha)  # var(dW) = up_scale^2/in
        sd[f"diffusion_model.{name}.lora_down.weight"] = down.to(dtype)
        sd[f"diffusion_model.{name}.lora_up.weight"] = up.to(dtype)
        sd[f"diffusion_model.{name}.alpha"] = torch.tensor(float(alpha))
    save_adapter_file(sd, path)


def save_adapter_file(sd, path, *, header_low_byte_0x80=False):
    """save_file, padding the metadata so that the header length's low byte is (or is not)
    0x80: lora_runtime's pickle sniffing refuses valid files whose first byte is 0x80
    (see test_safetensors_file_whose_first_byte_is_0x80_loads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for pad in range(512):
        save_file(sd, str(path), metadata={"written_by": "comfyui-lora-runtime integration tests",
                                            "pad": "x" * pad})
        if (path.read_bytes()[0] == 0x80) == header_low_byte_0x80:
            return
    raise AssertionError("could not steer the safetensors header length")
