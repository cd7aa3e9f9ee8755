"""LoCon with a Tucker core (``lora_mid``) on a convolution: merged and dynamic equal the
delta computed independently (an explicit sum of rank-1 terms in fp64), not the wrong
answers (the base alone, or the core ignored). Files built here at test time."""
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from comfyui_lora_runtime.lora_runtime import AdapterFormatError, AdapterSpec, applied, plan


class ConvModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x):
        return self.patch(x)


def _t(*shape, seed, scale=0.3):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


R, ALPHA = 3, 1.5


def _expected_delta(up, mid, down):
    """sum over m, n of up[:, m] (x) down[n, :] (x) mid[m, n]: one rank-1 term at a time, fp64."""
    up2, down2 = up.double().reshape(up.shape[0], R), down.double().reshape(R, down.shape[1])
    out = torch.zeros(up.shape[0], down.shape[1], *mid.shape[2:], dtype=torch.float64)
    for m in range(R):
        for n in range(R):
            out += up2[:, m, None, None, None] * down2[n, None, :, None, None] * mid.double()[m, n][None, None]
    return out * (ALPHA / R)


@pytest.mark.parametrize("mode", ["dynamic", "merge"])
def test_locon_tucker_mid_on_a_conv(tmp_path, mode):
    m = ConvModel()
    w0, b0 = m.patch.weight.detach().clone(), m.patch.bias.detach().clone()
    down, mid, up = _t(R, 4, 1, 1, seed=1), _t(R, R, 3, 3, seed=2), _t(8, R, 1, 1, seed=3)
    save_file({"lora_unet_patch.lora_down.weight": down, "lora_unet_patch.lora_mid.weight": mid,
               "lora_unet_patch.lora_up.weight": up, "lora_unet_patch.alpha": torch.tensor(ALPHA)},
              str(tmp_path / "tucker.safetensors"))
    x = _t(2, 4, 6, 6, seed=4, scale=1.0)
    delta = _expected_delta(up, mid, down)
    truth = F.conv2d(x.double(), w0.double() + delta, b0.double(), padding=1)
    no_core = (up.double().reshape(8, R) @ down.double().reshape(R, 4)).reshape(8, 4, 1, 1) * (ALPHA / R)
    wrong = F.conv2d(x.double(), w0.double() + F.pad(no_core, (1, 1, 1, 1)), b0.double(), padding=1)
    with torch.no_grad(), applied(m, plan(m, [AdapterSpec(str(tmp_path / "tucker.safetensors"))], mode, "exact"),
                                  fusion_backend=None):
        y = m(x)
    scale = truth.abs().max()
    err = (y.double() - truth).abs().max() / scale
    assert err < 1e-5, float(err)  # fp32 factors and conv: float32 rounding only
    assert (F.conv2d(x, w0, b0, padding=1).double() - truth).abs().max() / scale > 1e-2   # base alone
    assert (wrong - truth).abs().max() / scale > 1e-2                                    # core ignored
    assert torch.equal(m.patch.weight, w0) and torch.equal(m.patch.bias, b0)


def test_a_mid_that_does_not_fit_the_down_factor_is_refused_naming_the_file(tmp_path):
    m = ConvModel()
    w0 = m.patch.weight.detach().clone()
    save_file({"lora_unet_patch.lora_down.weight": _t(R, 4, 1, 1, seed=1),
               "lora_unet_patch.lora_mid.weight": _t(R, R + 1, 3, 3, seed=2),
               "lora_unet_patch.lora_up.weight": _t(8, R, 1, 1, seed=3)}, str(tmp_path / "bad_mid.safetensors"))
    with pytest.raises(AdapterFormatError, match=r"bad_mid.safetensors.*lora_unet_patch.*lora_mid"):
        with applied(m, plan(m, [AdapterSpec(str(tmp_path / "bad_mid.safetensors"))], "merge", "exact"),
                     fusion_backend=None):
            pass
    assert torch.equal(m.patch.weight, w0)
