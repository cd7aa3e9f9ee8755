"""lora_linear: the LoRA-aware fused kernel (interpreted on CPU, compiled on CUDA)
against its fp32 torch reference, an fp64 ground truth and the wrong answers
(base weight alone, GELU off, one scale for all adapters)."""
import pytest
import torch
from testkit.compare import assert_close
from testkit.lora_linear_checks import ADAPTERS, LOW, ULP_RTOL, check, check_not_wrong, make
from torch.utils._python_dispatch import TorchDispatchMode

from comfyui_lora_runtime.kernels.lora_linear import lora_linear, lora_linear_torch


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("adapters", list(ADAPTERS))
@pytest.mark.parametrize("gelu", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_every_branch(kernel_device, dtype, adapters, gelu, bias):
    args = make((9, 41), 341, dtype, kernel_device, adapters=adapters, bias=bias)
    y = lora_linear(*args, gelu=gelu, backend="triton")
    name = f"lora_linear {dtype} {adapters} gelu={gelu} bias={bias}"
    check(y, args, gelu, name)
    check_not_wrong(y, args, gelu, adapters, name)


@pytest.mark.parametrize("x_shape,n", [((1, 16), 32), ((33, 64), 70), ((2, 5, 41), 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shapes(kernel_device, x_shape, n, dtype):
    args = make(x_shape, n, dtype, kernel_device, adapters="several")
    y = lora_linear(*args, gelu=True, backend="triton")
    name = f"lora_linear {dtype} x{x_shape} N={n}"
    check(y, args, True, name)
    check_not_wrong(y, args, True, "several", name)


@pytest.mark.parametrize("r", [16, 40])  # one full rank tile; then two and a ragged third
def test_rank_tiles(kernel_device, r):
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(9, 41, generator=g), torch.randn(70, 41, generator=g) / 6, torch.randn(70, generator=g)
    a, bb = torch.randn(r, 41, generator=g) / 6, torch.randn(70, r, generator=g) / r ** 0.5
    args = tuple(t.to(kernel_device) for t in (x, w, b, a, bb)) + (0.6,)
    y = lora_linear(*args, gelu=True, backend="triton")
    check(y, args, True, f"rank {r}")
    check_not_wrong(y, args, True, "one", f"rank {r}")


def test_r0_equals_linear(kernel_device):
    # No adapter: bit-for-bit the same math as the base fused linear(+GELU).
    from comfyui_lora_runtime.kernels.linear_gelu_tanh import linear_gelu_tanh
    x, w, b, a, bb, _ = make((9, 41), 341, torch.float32, kernel_device, adapters="none")
    y = lora_linear(x, w, b, a, bb, 0.7, gelu=True, backend="triton")
    assert torch.equal(y, linear_gelu_tanh(x, w, b, backend="triton"))


def test_fp32_adapter_on_bf16_model(kernel_device):
    # Adapters often ship in fp32 while the model runs in bf16: read them as fp32.
    x, w, b, a, bb, s = make((9, 41), 341, torch.bfloat16, kernel_device, adapters="several")
    args = (x, w, b, a.float(), bb.float(), s)
    y = lora_linear(*args, gelu=True, backend="triton")
    assert_close(y, lora_linear_torch(*args, gelu=True), atol=1e-6, rtol=ULP_RTOL[torch.bfloat16],
                 name="fp32 adapter on bf16")


class _CountMul(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.muls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.mul:
            self.muls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("scale,muls", [(1.0, 0), (0.7, 1)])
def test_unit_scale_is_not_multiplied(scale, muls):
    x, w, b, a, bb, _ = make((9, 41), 70, torch.float32, "cpu")
    with _CountMul() as counter:
        lora_linear(x, w, b, a, bb, scale, backend="torch")
    assert counter.muls == muls


def test_bad_arguments_are_refused():
    x, w, b, a, bb, s = make((9, 41), 70, torch.float32, "cpu", adapters="several")
    with pytest.raises(ValueError, match="lora_b"):
        lora_linear(x, w, b, a, bb[:, :5], s)
    with pytest.raises(ValueError, match="lora_a"):
        lora_linear(x, w, b, a[:, :40], bb, s)
    with pytest.raises(ValueError, match="one factor per rank"):
        lora_linear(x, w, b, a, bb, s[:3])
    with pytest.raises(TypeError, match="scale"):
        lora_linear(x, w, b, a, bb, "0.5")


def test_torch_backend_is_the_reference():
    args = make((2, 5, 41), 100, torch.bfloat16, "cpu", adapters="several")
    assert torch.equal(lora_linear(*args, gelu=True, backend="torch"), lora_linear_torch(*args, gelu=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_large(dtype):
    args = make((512, 1536), 2048, dtype, "cuda", adapters="several")
    y = lora_linear(*args, gelu=True, backend="triton")
    check(y, args, True, f"cuda {dtype} 512x1536x2048 R=21")
    check_not_wrong(y, args, True, "several", "cuda")
