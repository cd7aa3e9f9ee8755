import shutil
from pathlib import Path

import pytest
import torch

from testkit.refdata import REF, ref_file


@pytest.fixture
def models_dir(tmp_path):
    """A loras + diffusion_models folder with the reference tiny Wan and a few adapters."""
    ref_file("tiny_wan_d128_l2.safetensors")
    from testkit.fixtures import write_kohya, write_peft
    from comfyui_lora_runtime.standalone.host.wan21 import load_wan_checkpoint

    (tmp_path / "diffusion_models").mkdir()
    (tmp_path / "loras" / "sub").mkdir(parents=True)
    shutil.copy(REF / "tiny_wan_d128_l2.safetensors", tmp_path / "diffusion_models" / "tiny_wan.safetensors")
    wan = load_wan_checkpoint(REF / "tiny_wan_d128_l2.safetensors")
    g = torch.Generator().manual_seed(11)

    def pairs(scale, r=4, only=("self_attn", "cross_attn", "ffn")):
        out = {}
        for name, m in wan.named_modules():
            if isinstance(m, torch.nn.Linear) and name.startswith("blocks.") and any(o in name for o in only):
                out[name] = (torch.randn(r, m.in_features, generator=g) * scale,
                             torch.randn(m.out_features, r, generator=g) * scale)
        return out

    write_kohya(tmp_path / "loras" / "style.safetensors", pairs(0.3), alpha=4.0)
    write_peft(tmp_path / "loras" / "sub" / "second.safetensors", pairs(0.3, only=("ffn",)), alpha=2.0)
    # |dW| ~ 2e-5, far below a bf16 ulp of these weights (~3e-4): a bf16 merge rounds it away
    write_peft(tmp_path / "loras" / "distilled.safetensors", pairs(0.003), alpha=4.0)
    torch.save({"x": torch.zeros(1)}, tmp_path / "loras" / "pickled.safetensors")
    from safetensors.torch import save_file
    save_file({"transformer.double_blocks.0.img_attn.qkv.lora_A.weight": torch.zeros(2, 8),
               "transformer.double_blocks.0.img_attn.qkv.lora_B.weight": torch.zeros(8, 2)},
              str(tmp_path / "loras" / "flux_only.safetensors"))
    return tmp_path


@pytest.fixture
def folders(models_dir, tmp_path):
    from comfyui_lora_runtime.standalone.host import folder_paths
    f = folder_paths.ModelFolders(models_dir=models_dir, output_dir=tmp_path / "out")
    with folder_paths.activated(f):
        yield f


@pytest.fixture
def base(folders):
    from comfyui_lora_runtime.standalone.host.core_nodes import UNETLoader
    return UNETLoader().load_unet("tiny_wan.safetensors", "default")[0]
