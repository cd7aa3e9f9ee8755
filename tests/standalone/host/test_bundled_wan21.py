"""The bundled Wan 2.1 DiT against ComfyUI 0.3.64's first model call on the tiny checkpoint."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from comfyui_lora_runtime.standalone.host.wan21 import WanConfig, WanModel, load_wan_checkpoint

FORWARD_ATOL = 1e-5  # README: fp32 forward with a float32 timestep embedding lands at ~1.1e-6


def test_config_from_checkpoint(tiny_wan):
    assert tiny_wan.config == WanConfig(
        dim=128, ffn_dim=512, num_layers=2, num_heads=1, in_dim=16, out_dim=16,
        text_dim=4096, freq_dim=256, patch_size=(1, 2, 2), eps=1e-6,
    )
    assert all(p.dtype == torch.float32 for p in tiny_wan.parameters())


def test_module_names_and_linear_types(tiny_wan, ref_dir):
    from safetensors import safe_open

    with safe_open(str(ref_dir / "tiny_wan_d128_l2.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert set(tiny_wan.state_dict()) == keys
    for i in range(2):
        block = tiny_wan.blocks[i]
        for attn in (block.self_attn, block.cross_attn):
            for name in ("q", "k", "v", "o"):
                assert type(getattr(attn, name)) is nn.Linear
        assert type(block.ffn[0]) is nn.Linear and type(block.ffn[2]) is nn.Linear
        assert isinstance(block.ffn[1], nn.GELU) and block.ffn[1].approximate == "tanh"
    # a LoRA engine swaps layers by name with setattr; the forward must use the swapped module
    block = tiny_wan.blocks[0]
    original = block.ffn[2]
    calls = []

    class Spy(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            calls.append(x.shape)
            return self.inner(x)

    setattr(block.ffn, "2", Spy(original))
    try:
        tiny_wan(torch.zeros(1, 16, 1, 2, 2), torch.tensor([500.0]), torch.zeros(1, 1, 4096))
    finally:
        setattr(block.ffn, "2", original)
    assert len(calls) == 1


@torch.no_grad()
def test_first_call_matches_comfyui(tiny_wan, load_ref):
    ref = load_ref("model_first_call")
    out = tiny_wan(ref["x"], ref["timestep"], ref["context"])
    assert out.dtype == torch.float32 and out.shape == (1, 16, 1, 8, 8)
    torch.testing.assert_close(out, ref["model_output"], atol=FORWARD_ATOL, rtol=0)
    torch.testing.assert_close(ref["x"] - out * ref["sigma"], ref["denoised"], atol=FORWARD_ATOL, rtol=0)

    # the positive row of the cfg batch [negative, positive]
    both = tiny_wan(
        torch.cat([ref["x"], ref["x"]]),
        torch.cat([ref["timestep"], ref["timestep"]]),
        torch.cat([torch.zeros_like(ref["context"]), ref["context"]]),
    )
    torch.testing.assert_close(both[1:], ref["model_output_cond_row_in_cfg_batch"], atol=FORWARD_ATOL, rtol=0)

    # wrong answers are far outside the tolerance
    assert (both[:1] - ref["model_output"]).abs().max() > 100 * FORWARD_ATOL  # negative row
    wrong_t = tiny_wan(ref["x"], ref["timestep"] * 0.5, ref["context"])
    assert (wrong_t - ref["model_output"]).abs().max() > 100 * FORWARD_ATOL
    padded = torch.cat([ref["context"], torch.zeros(1, 508, 4096)], dim=1)
    assert (tiny_wan(ref["x"], ref["timestep"], padded) - ref["model_output"]).abs().max() > 100 * FORWARD_ATOL


@torch.no_grad()
def test_forward_without_biases_differs(tiny_wan, load_ref):
    ref = load_ref("model_first_call")
    model = WanModel(tiny_wan.config)
    sd = {k: (torch.zeros_like(v) if k.endswith(".bias") else v) for k, v in tiny_wan.state_dict().items()}
    model.load_state_dict(sd, strict=True)
    out = model(ref["x"], ref["timestep"], ref["context"])
    assert (out - ref["model_output"]).abs().max() > 1000 * FORWARD_ATOL


@torch.no_grad()
def test_odd_spatial_size_is_padded_and_cropped(tiny_wan):
    x = torch.randn(1, 16, 1, 7, 5, generator=torch.Generator().manual_seed(3))
    out = tiny_wan(x, torch.tensor([700.0]), torch.randn(1, 3, 4096, generator=torch.Generator().manual_seed(4)))
    assert out.shape == x.shape and torch.isfinite(out).all()


def test_loader_prefix_and_key_errors(tmp_path, tiny_wan):
    from safetensors.torch import save_file

    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in tiny_wan.state_dict().items()}
    prefixed = tmp_path / "prefixed.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in sd.items()}, str(prefixed))
    again = load_wan_checkpoint(prefixed)
    for k, v in again.state_dict().items():
        assert torch.equal(v, tiny_wan.state_dict()[k]), k

    broken = dict(sd)
    broken.pop("blocks.1.ffn.2.bias")
    broken["blocks.1.extra.weight"] = torch.zeros(1)
    path = tmp_path / "broken.safetensors"
    save_file(broken, str(path))
    with pytest.raises(ValueError) as err:
        load_wan_checkpoint(path)
    msg = str(err.value)
    assert "broken.safetensors" in msg and "blocks.1.ffn.2.bias" in msg and "blocks.1.extra.weight" in msg

    with pytest.raises(ValueError, match="safetensors"):
        load_wan_checkpoint(tmp_path / "model.ckpt")
