"""The cuBLASLt linear+GELU backend: its device check tells the tanh GELU from the erf
GELU (on the CPU torch._addmm_activation computes erf: the backend is never used there),
and on CUDA, where the check passes, it is within the `lossless` rule."""
import pytest
import torch
import torch.nn.functional as F

from comfyui_lora_runtime.kernels import linear_gelu_cublaslt as lt
from comfyui_lora_runtime.kernels import registry
from comfyui_lora_runtime.kernels.linear_gelu_tanh import linear_gelu_tanh, linear_gelu_tanh_eager

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch):
    monkeypatch.setattr(lt, "_CHECKED", {})


def _epilogue(gelu):
    """A model of an addmm epilogue: fp32 accumulator, bias, activation, one rounding."""
    def fake(bias, x, wt, use_gelu=False):
        return gelu(torch.addmm(bias.float(), x.float(), wt.float())).to(x.dtype)
    return fake


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_check_finds_erf_on_the_cpu(dtype):
    why = lt.epilogue_check("cpu", dtype)
    assert "computes the erf GELU" in why, why


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_check_accepts_a_tanh_epilogue_and_refuses_others(dtype, monkeypatch):
    monkeypatch.setattr(torch, "_addmm_activation", _epilogue(lambda t: F.gelu(t, approximate="tanh")))
    assert lt.epilogue_check("cpu", dtype) == ""
    lt._CHECKED.clear()
    monkeypatch.setattr(torch, "_addmm_activation", _epilogue(lambda t: t))  # no activation at all
    assert "neither" in lt.epilogue_check("cpu", dtype)
    lt._CHECKED.clear()

    def broken(*a, **k):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
    monkeypatch.setattr(torch, "_addmm_activation", broken)
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in lt.epilogue_check("cpu", dtype)


def test_the_check_runs_once_per_device_and_dtype(monkeypatch):
    calls = []
    real = torch._addmm_activation
    monkeypatch.setattr(torch, "_addmm_activation", lambda *a, **k: calls.append(1) or real(*a, **k))
    lt.epilogue_check("cpu", torch.bfloat16)
    lt.epilogue_check("cpu", torch.bfloat16)
    assert len(calls) == 1


def test_never_on_the_cpu_even_where_the_check_would_pass(monkeypatch):
    monkeypatch.setattr(torch, "_addmm_activation", _epilogue(lambda t: F.gelu(t, approximate="tanh")))
    be = registry.get("linear_gelu_tanh", "cublaslt")
    assert "not cpu" in be.why_not(torch.device("cpu"), torch.bfloat16)
    assert registry.resolve("linear_gelu_tanh", "auto", torch.zeros(2, 3)).name == "torch"


@pytest.mark.parametrize("bias", [True, False])
def test_the_call_shapes_and_bias(bias, monkeypatch):
    """The plumbing (leading dims, no bias) on a modelled tanh epilogue."""
    monkeypatch.setattr(torch, "_addmm_activation", _epilogue(lambda t: F.gelu(t, approximate="tanh")))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 5, 16, generator=g), torch.randn(24, 16, generator=g)
    b = torch.randn(24, generator=g) if bias else None
    y = lt.linear_gelu_cublaslt(x, w, b)
    assert y.shape == (2, 5, 24)
    assert torch.allclose(y, F.gelu(F.linear(x, w, b), approximate="tanh"), atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_lossless(dtype):
    why = lt.epilogue_check("cuda", dtype)
    if why:
        pytest.skip(why)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 1536, device="cuda", generator=g).to(dtype)
    w = (torch.randn(2048, 1536, device="cuda", generator=g) / 1536 ** 0.5).to(dtype)
    b = (torch.randn(2048, device="cuda", generator=g) * 0.1).to(dtype)
    y = linear_gelu_tanh(x, w, b, backend="cublaslt")
    truth = F.gelu(F.linear(x.double(), w.double(), b.double()), approximate="tanh")
    ref = linear_gelu_tanh_eager(x, w, b)
    eo, er = y.double() - truth, ref.double() - truth
    assert eo.pow(2).mean().sqrt() <= 1.5 * er.pow(2).mean().sqrt()
    assert eo.abs().max() <= 1.5 * er.abs().max()
    assert eo.mean().abs() <= 0.25 * er.pow(2).mean().sqrt()
    erf = F.gelu(F.linear(x.float(), w.float(), b.float())).to(dtype)  # the wrong GELU
    assert (y.double() - truth).abs().mean() < (erf.double() - truth).abs().mean()
