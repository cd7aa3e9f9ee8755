"""Backend choice: auto never picks the interpreter, an impossible "triton"
request says why, unknown names are refused."""
import pytest
import torch

from comfyui_lora_runtime.kernels import _dispatch
from comfyui_lora_runtime.kernels._dispatch import KernelUnavailableError, resolve_backend
from comfyui_lora_runtime.kernels.lora_linear import lora_linear

CPU = torch.zeros(2, 3)


def test_auto_on_cpu_is_torch(monkeypatch):
    assert resolve_backend("auto", CPU, CPU) == "torch"
    monkeypatch.setattr(_dispatch, "interpreting", lambda: True)
    assert resolve_backend("auto", CPU) == "torch"  # never the (slow) interpreter


def test_torch_is_always_honoured():
    assert resolve_backend("torch", CPU) == "torch"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(_dispatch, "interpreting", lambda: False)
    with pytest.raises(KernelUnavailableError, match="CUDA.*TRITON_INTERPRET") as info:
        resolve_backend("triton", CPU, None)
    assert isinstance(info.value, RuntimeError)
    # the public op says the same, before touching any kernel
    with pytest.raises(KernelUnavailableError):
        lora_linear(CPU, torch.zeros(4, 3), None, torch.zeros(1, 3), torch.zeros(4, 1), 0.5, backend="triton")


def test_triton_on_cpu_when_interpreting(monkeypatch):
    if not _dispatch.triton_importable():
        pytest.skip("triton is not installed")
    monkeypatch.setattr(_dispatch, "interpreting", lambda: True)
    assert resolve_backend("triton", CPU, None) == "triton"


def test_triton_missing(monkeypatch):
    monkeypatch.setattr(_dispatch, "triton_importable", lambda: False)
    with pytest.raises(KernelUnavailableError, match="pip install"):
        resolve_backend("triton", CPU)
    assert resolve_backend("auto", CPU) == "torch"


def test_unknown_backend_is_quoted():
    with pytest.raises(ValueError, match="'cuda'"):
        resolve_backend("cuda", CPU)


def test_interpreting_reads_the_environment(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _dispatch.interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not _dispatch.interpreting()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not _dispatch.interpreting()


def test_triton_importable_is_cached():
    first = _dispatch.triton_importable()
    assert _dispatch.triton_importable() is first
    assert _dispatch.triton_importable.cache_info().hits >= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_cuda_is_triton():
    t = torch.zeros(2, 3, device="cuda")
    assert resolve_backend("auto", t, None) == ("triton" if _dispatch.triton_importable() else "torch")
    with pytest.raises(KernelUnavailableError):  # mixed devices are never honoured
        resolve_backend("triton", t, CPU)
