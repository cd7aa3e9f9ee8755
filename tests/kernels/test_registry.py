"""The kernel backend registry: auto never picks the interpreter or a backend whose
device check failed, an impossible request says why, unknown names are refused,
use_backend forces "auto", the shared argument checks and plain-weight guard."""
import pytest
import torch
from torch import nn

from comfyui_lora_runtime.kernels import registry
from comfyui_lora_runtime.kernels.linear_gelu_tanh import linear_gelu_tanh, linear_gelu_tanh_torch
from comfyui_lora_runtime.kernels.lora_linear import lora_linear, lora_linear_torch
from comfyui_lora_runtime.kernels.registry import KernelUnavailableError, resolve, use_backend
from comfyui_lora_runtime.lora_runtime.layer.base_weight import fused_read_reason

CPU = torch.zeros(2, 3)


def test_every_op_has_its_backends_in_priority_order():
    assert [b.name for b in registry.backends("linear_gelu_tanh")] == ["cublaslt", "triton", "torch"]
    assert [b.name for b in registry.backends("lora_linear")] == [
        "delta_first", "kconcat_cached", "kconcat_rebuilt", "triton", "torch"]
    for op in ("linear_gelu_tanh", "lora_linear"):
        for b in registry.backends(op):
            assert b.dtypes and b.devices and {"bias", "gelu"} <= b.capabilities and b.description, b


def test_a_backend_cannot_register_twice():
    b = registry.get("lora_linear", "torch")
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(b)


def test_auto_on_cpu(monkeypatch):
    # linear+GELU: cuBLASLt is CUDA only and the interpreter is never a speed path
    assert resolve("linear_gelu_tanh", "auto", CPU, CPU).name == "torch"
    monkeypatch.setattr(registry, "interpreting", lambda: True)
    assert resolve("linear_gelu_tanh", "auto", CPU).name == "torch"
    # the LoRA op: the cuBLAS-shaped torch path of highest priority
    assert resolve("lora_linear", "auto", CPU).name == "delta_first"


def test_torch_is_always_honoured():
    assert resolve("linear_gelu_tanh", "torch", CPU).name == "torch"
    assert resolve("lora_linear", "torch", CPU.bfloat16()).name == "torch"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(registry, "interpreting", lambda: False)
    with pytest.raises(KernelUnavailableError, match="CUDA.*TRITON_INTERPRET") as info:
        resolve("lora_linear", "triton", CPU, None)
    assert isinstance(info.value, RuntimeError)
    # the public op says the same, before touching any kernel
    with pytest.raises(KernelUnavailableError):
        lora_linear(CPU, torch.zeros(4, 3), None, torch.zeros(1, 3), torch.zeros(4, 1), 0.5, backend="triton")


def test_triton_on_cpu_when_interpreting(monkeypatch):
    if not registry.triton_importable():
        pytest.skip("triton is not installed")
    monkeypatch.setattr(registry, "interpreting", lambda: True)
    assert resolve("linear_gelu_tanh", "triton", CPU, None).name == "triton"


def test_triton_missing(monkeypatch):
    monkeypatch.setattr(registry, "triton_importable", lambda: False)
    with pytest.raises(KernelUnavailableError, match="pip install"):
        resolve("linear_gelu_tanh", "triton", CPU)
    assert resolve("linear_gelu_tanh", "auto", CPU).name == "torch"


def test_cublaslt_is_refused_on_cpu_with_the_reason():
    with pytest.raises(KernelUnavailableError, match="runs on cuda, not cpu"):
        linear_gelu_tanh(CPU, torch.zeros(4, 3), None, backend="cublaslt")


def test_unknown_names_are_quoted():
    with pytest.raises(ValueError, match="'cuda'"):
        resolve("linear_gelu_tanh", "cuda", CPU)
    with pytest.raises(ValueError, match="'delta_first'"):  # a backend of the other op
        resolve("linear_gelu_tanh", "delta_first", CPU)
    with pytest.raises(ValueError, match="unknown kernel op"):
        registry.backends("conv_gelu")
    with pytest.raises(ValueError, match="no op has a backend"):
        with use_backend("warp"):
            pass


def test_mixed_devices_are_refused():
    meta = torch.zeros(2, 3, device="meta")
    with pytest.raises(KernelUnavailableError, match="several devices"):
        resolve("lora_linear", "torch", CPU, meta)


def test_use_backend_forces_auto_only_for_ops_that_have_it():
    x, w, a, bb = torch.randn(5, 3), torch.randn(4, 3), torch.randn(2, 3), torch.randn(4, 2)
    with use_backend("torch"):
        assert resolve("lora_linear", "auto", x).name == "torch"
        assert torch.equal(lora_linear(x, w, None, a, bb, 0.5), lora_linear_torch(x, w, None, a, bb, 0.5))
    with use_backend("kconcat_rebuilt"):
        assert resolve("lora_linear", "auto", x).name == "kconcat_rebuilt"
        assert resolve("linear_gelu_tanh", "auto", x).name == "torch"  # no such backend: as before
        assert resolve("lora_linear", "delta_first", x).name == "delta_first"  # a named request wins
    assert registry.forced_backend() is None
    assert resolve("lora_linear", "auto", x).name == "delta_first"


def test_validate_is_shared_by_both_ops():
    x, w = torch.zeros(2, 3), torch.zeros(4, 3)
    for call in (lambda: linear_gelu_tanh(x, torch.zeros(4, 5)),
                 lambda: lora_linear(x, torch.zeros(4, 5), None, torch.zeros(1, 5), torch.zeros(4, 1), 1.0)):
        with pytest.raises(ValueError, match="do not fit"):
            call()
    with pytest.raises(TypeError, match="weight dtype"):
        linear_gelu_tanh(x, w.double())
    with pytest.raises(TypeError, match="not supported"):
        linear_gelu_tanh(x.double(), w.double())
    with pytest.raises(ValueError, match="per rank"):
        lora_linear(x, w, None, torch.zeros(2, 3), torch.zeros(4, 2), torch.ones(3))
    assert registry.validate("op", x, w, None) is None
    s = registry.validate("op", x, w, None, torch.zeros(2, 3), torch.zeros(4, 2), torch.ones(2, dtype=torch.float16))
    assert s.dtype == torch.float32 and s.is_contiguous()


class Quantized(nn.Linear):
    quant_state = object()


@pytest.mark.parametrize("layer,why", [
    (nn.Linear(3, 4), ""),
    (nn.Conv1d(3, 4, 1), "Conv1d"),
    (Quantized(3, 4), "quant_state"),
    (nn.Linear(3, 4).to(torch.float64), "float64"),
])
def test_plain_weight_reason(layer, why):
    got = fused_read_reason(layer)
    assert (got == "") if not why else (why in got), got


def test_measured_choice_is_per_bucket_and_only_on_cuda():
    calls = []
    mc = registry.MeasuredChoice()
    paths = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    assert mc.pick(("k",), paths, torch.device("cpu")) == ("a", None)  # first path, nothing timed
    assert calls == [] and mc.choices == {}


def test_interpreting_reads_the_environment(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registry.interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not registry.interpreting()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not registry.interpreting()


def test_triton_importable_is_cached():
    first = registry.triton_importable()
    assert registry.triton_importable() is first
    assert registry.triton_importable.cache_info().hits >= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_cuda():
    t = torch.zeros(2, 3, device="cuda")
    lt = registry.get("linear_gelu_tanh", "cublaslt").why_not(t.device, t.dtype)
    want = "cublaslt" if not lt else ("triton" if registry.triton_importable() else "torch")
    assert resolve("linear_gelu_tanh", "auto", t, None).name == want
    with pytest.raises(KernelUnavailableError):  # mixed devices are never honoured
        resolve("linear_gelu_tanh", "triton", t, CPU)
