"""LightX2V's extractor names modulation deltas ``blocks.N.diff_m`` and ``head.diff_m``
(the parameter is ``blocks.N.modulation`` / ``head.modulation``); other exporters write
``blocks.N.modulation.diff_m``. Both are applied to the same parameter, in every mode, and
restored bit for bit. Files built here at test time."""
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from comfyui_lora_runtime.lora_runtime import AdapterMatchError, AdapterSpec, applied, plan


class WanMod(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.blocks = nn.ModuleList([nn.Module(), nn.Module()])
        for b in self.blocks:
            b.modulation = nn.Parameter(torch.randn(1, 6, 16, generator=g) / 4)
            b.ffn = nn.Sequential(nn.Linear(16, 16))
        self.head = nn.Module()
        self.head.modulation = nn.Parameter(torch.randn(1, 2, 16, generator=g) / 4)
        self.head.head = nn.Linear(16, 16)


def _d(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("mode", ["dynamic", "merge", "auto"])
@pytest.mark.parametrize("prefix", ["diffusion_model.", "", "lora_unet_"])
def test_blocks_n_diff_m_and_head_diff_m_reach_the_modulation(tmp_path, mode, prefix):
    m = WanMod().to(torch.bfloat16)
    snap = {k: v.detach().clone() for k, v in m.state_dict().items()}
    d0, d1, dh = _d(1, 6, 16, seed=1), _d(1, 6, 16, seed=2), _d(1, 2, 16, seed=3)
    sep = "_" if prefix.endswith("_") else "."
    t = {f"{prefix}blocks{sep}0.diff_m": d0,                  # LightX2V
         f"{prefix}blocks{sep}1{sep}modulation.diff_m": d1,   # the long form, in the same file
         f"{prefix}head.diff_m": dh,
         f"{prefix}blocks{sep}0{sep}ffn{sep}0.lora_down.weight": _d(2, 16, seed=4),
         f"{prefix}blocks{sep}0{sep}ffn{sep}0.lora_up.weight": _d(16, 2, seed=5)}
    p = tmp_path / "lightx2v.safetensors"
    save_file(t, str(p))
    with applied(m, plan(m, [AdapterSpec(str(p), 1.0)], mode, "lossless"), fusion_backend=None) as rep:
        got = {k: getattr(mod, "modulation").detach().clone() for k, mod in
               (("blocks.0", m.blocks[0]), ("blocks.1", m.blocks[1]), ("head", m.head))}
        assert {x["param"] for x in rep.params} == {"blocks.0.modulation", "blocks.1.modulation", "head.modulation"}
        assert rep.coverage[0].keys_applied == rep.coverage[0].keys_total == 5
    for name, delta in (("blocks.0", d0), ("blocks.1", d1), ("head", dh)):
        base = snap[f"{name}.modulation"]
        want = (base.float() + delta).bfloat16()   # fp32 sum, one rounding (the merge contract)
        assert torch.equal(got[name], want), name
        assert not torch.equal(got[name], base), name   # the wrong answer: the delta left out
    for k, v in m.state_dict().items():
        assert torch.equal(v, snap[k]), k


def test_diff_m_on_a_module_without_a_modulation_is_still_refused_by_name(tmp_path):
    m = WanMod()
    snap = {k: v.detach().clone() for k, v in m.state_dict().items()}
    p = tmp_path / "stray.safetensors"
    save_file({"diffusion_model.blocks.0.ffn.diff_m": _d(1, 16, seed=1),
               "diffusion_model.blocks.0.ffn.0.lora_down.weight": _d(2, 16, seed=4),
               "diffusion_model.blocks.0.ffn.0.lora_up.weight": _d(16, 2, seed=5),
               "diffusion_model.blocks.1.ffn.0.lora_down.weight": _d(2, 16, seed=6),
               "diffusion_model.blocks.1.ffn.0.lora_up.weight": _d(16, 2, seed=7)}, str(p))
    with pytest.raises(AdapterMatchError, match=r"stray.safetensors.*blocks\.0\.ffn"):
        with applied(m, plan(m, [AdapterSpec(str(p), 1.0)], "merge", "exact"), fusion_backend=None):
            pass
    assert all(torch.equal(v, snap[k]) for k, v in m.state_dict().items())
