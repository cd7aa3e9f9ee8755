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


def _rebuild(t, a, b):
    """Factor [out, in, k...] = sum_ij a[i, :] (x) b[j, :] (x) t[i, j]: one rank-1 term at a time, fp64."""
    out = torch.zeros(a.shape[1], b.shape[1], *t.shape[2:], dtype=torch.float64)
    for i in range(t.shape[0]):
        for j in range(t.shape[1]):
            out += a.double()[i][:, None, None, None] * b.double()[j][None, :, None, None] * t.double()[i, j][None, None]
    return out


def _kron_blocks(w1, w2):
    """kron(w1, w2) for a conv w2, block by block."""
    o1, i1 = w1.shape
    o2, i2 = w2.shape[:2]
    out = torch.zeros(o1 * o2, i1 * i2, *w2.shape[2:], dtype=torch.float64)
    for p in range(o1):
        for q in range(i1):
            out[p * o2:(p + 1) * o2, q * i2:(q + 1) * i2] = w1.double()[p, q] * w2
    return out


def _run(m, path, mode, x):
    with torch.no_grad(), applied(m, plan(m, [AdapterSpec(str(path))], mode, "exact"), fusion_backend=None):
        return m(x)


@pytest.mark.parametrize("mode", ["dynamic", "merge"])
@pytest.mark.parametrize("kind", ["loha", "lokr", "lokr_full_w2"])
def test_loha_and_lokr_tucker_cores_on_a_conv(tmp_path, mode, kind):
    m = ConvModel()
    w0, b0 = m.patch.weight.detach().clone(), m.patch.bias.detach().clone()
    r, alpha = 2, 3.0
    if kind == "loha":
        t1, t2 = _t(r, r, 3, 3, seed=1), _t(r, r, 3, 3, seed=2)
        a1, b1, a2, b2 = _t(r, 8, seed=3), _t(r, 4, seed=4), _t(r, 8, seed=5), _t(r, 4, seed=6)
        sd = {"hada_t1": t1, "hada_t2": t2, "hada_w1_a": a1, "hada_w1_b": b1, "hada_w2_a": a2, "hada_w2_b": b2}
        delta = _rebuild(t1, a1, b1) * _rebuild(t2, a2, b2) * (alpha / r)    # ComfyUI: alpha / hada_w1_b rows
        wrong = _rebuild(t1, a1, b1) * (alpha / r)                           # one Hadamard factor dropped
    else:
        w1 = _t(2, 2, seed=7)                                                # out 8 = 2 x 4, in 4 = 2 x 2
        if kind == "lokr":
            t2, a2, b2 = _t(r, r, 3, 3, seed=8), _t(r, 4, seed=9), _t(r, 2, seed=10)
            sd = {"lokr_w1": w1, "lokr_t2": t2, "lokr_w2_a": a2, "lokr_w2_b": b2}
            w2 = _rebuild(t2, a2, b2)
            scale = alpha / r                                                # ComfyUI: alpha / lokr_w2_b rows
        else:
            w2 = _t(4, 2, 3, 3, seed=11).double()
            sd = {"lokr_w1": w1, "lokr_w2": w2.float()}
            scale = 1.0                                                      # no factorised side: alpha unused
        delta = _kron_blocks(w1, w2) * scale
        wrong = _kron_blocks(w1, w2) * (alpha if scale == 1.0 else 1.0)      # the wrong scale
    sd = {f"lora_unet_patch.{k}": v.contiguous() for k, v in sd.items()}
    sd["lora_unet_patch.alpha"] = torch.tensor(alpha)
    p = tmp_path / f"{kind}.safetensors"
    save_file(sd, str(p))
    x = _t(2, 4, 6, 6, seed=12, scale=1.0)
    truth = F.conv2d(x.double(), w0.double() + delta, b0.double(), padding=1)
    y = _run(m, p, mode, x)
    scale_ref = truth.abs().max()
    err = (y.double() - truth).abs().max() / scale_ref
    assert err < 1e-5, float(err)   # fp32 factors and conv: float32 rounding only
    assert (F.conv2d(x.double(), w0.double() + wrong, b0.double(), padding=1) - truth).abs().max() / scale_ref > 1e-2
    assert (F.conv2d(x, w0, b0, padding=1).double() - truth).abs().max() / scale_ref > 1e-2
    assert torch.equal(m.patch.weight, w0) and torch.equal(m.patch.bias, b0)


def test_a_5d_loha_core_on_a_conv3d(tmp_path):
    """Wan's patch_embedding is a Conv3d: hada_t1/t2 are 5-D [r, r, kt, kh, kw]."""
    m = nn.Module()
    torch.manual_seed(0)
    m.patch = nn.Conv3d(4, 8, (1, 2, 2), stride=(1, 2, 2))
    w0, b0 = m.patch.weight.detach().clone(), m.patch.bias.detach().clone()
    r, alpha = 2, 2.0
    t1, t2 = _t(r, r, 1, 2, 2, seed=1), _t(r, r, 1, 2, 2, seed=2)
    a1, b1, a2, b2 = _t(r, 8, seed=3), _t(r, 4, seed=4), _t(r, 8, seed=5), _t(r, 4, seed=6)

    def rebuild(t, a, b):
        out = torch.zeros(8, 4, 1, 2, 2, dtype=torch.float64)
        for i in range(r):
            for j in range(r):
                out += (a.double()[i][:, None] * b.double()[j][None, :]).reshape(8, 4, 1, 1, 1) * t.double()[i, j]
        return out
    delta = rebuild(t1, a1, b1) * rebuild(t2, a2, b2) * (alpha / r)
    sd = {"hada_t1": t1, "hada_t2": t2, "hada_w1_a": a1, "hada_w1_b": b1, "hada_w2_a": a2, "hada_w2_b": b2}
    sd = {f"diffusion_model.patch.{k}": v for k, v in sd.items()}
    sd["diffusion_model.patch.alpha"] = torch.tensor(alpha)
    save_file(sd, str(tmp_path / "loha3d.safetensors"))
    x = _t(1, 4, 2, 4, 4, seed=7, scale=1.0)
    truth = F.conv3d(x.double(), w0.double() + delta, b0.double(), stride=(1, 2, 2))
    for mode in ("dynamic", "merge"):
        with torch.no_grad(), applied(m, plan(m, [AdapterSpec(str(tmp_path / "loha3d.safetensors"))], mode, "exact"),
                                      fusion_backend=None):
            y = m.patch(x)
        s = truth.abs().max()
        assert (y.double() - truth).abs().max() / s < 1e-5, mode
        assert (F.conv3d(x, w0, b0, stride=(1, 2, 2)).double() - truth).abs().max() / s > 1e-2
        assert torch.equal(m.patch.weight, w0) and torch.equal(m.patch.bias, b0)
