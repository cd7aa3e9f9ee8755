"""linear_gelu_tanh: the Triton kernel (interpreted on CPU, compiled on CUDA)
against its fp32 torch reference and an fp64 ground truth."""
import pytest
import torch
import torch.nn.functional as F
from testkit.compare import assert_close, assert_differs, assert_within_relative_rule
from testkit.linear_gelu_checks import FP32_TOL, LOW, SHAPES, check, make, truth64

from comfyui_lora_runtime.kernels.linear_gelu_tanh import (linear_gelu_tanh, linear_gelu_tanh_eager,
                                                           linear_gelu_tanh_torch)


@pytest.mark.parametrize("x_shape,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_matches_reference(kernel_device, x_shape, n, dtype, bias):
    x, w, b = make(x_shape, n, dtype, kernel_device, bias)
    y = linear_gelu_tanh(x, w, b, backend="triton")
    name = f"linear_gelu_tanh {dtype} x{x_shape} N={n} bias={bias}"
    check(y, x, w, b, name)
    # Not the wrong answers: GELU skipped, or the bias dropped.
    no_gelu = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert_differs(y, no_gelu, min_abs=0.1, name=name + " vs no GELU")
    if bias:
        assert_differs(y, linear_gelu_tanh_torch(x, w, None), min_abs=0.1, name=name + " vs no bias")


def test_reference_is_within_torch_lowp_error():
    # The reference itself obeys the rule it sets for the kernel (fp32 math, one rounding).
    x, w, b = make((9, 41), 341, torch.bfloat16, "cpu")
    assert_within_relative_rule(linear_gelu_tanh_torch(x, w, b), linear_gelu_tanh_eager(x, w, b),
                                truth64(x, w, b), name="reference bf16")


# numpy warns about inf * 0 and inf - inf inside the interpreter; those NaNs are the point.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_special_values_agree(kernel_device):
    x, w, b = make((9, 41), 70, torch.float32, kernel_device)
    x[1, 3] = float("nan")    # row 1 all NaN
    x[4, 0] = float("inf")    # row 4: +-inf by sign of w, then gelu(-inf) = NaN
    x[6, :] = -1e4            # large negative pre-activations: gelu -> -0, no NaN
    y = linear_gelu_tanh(x, w, b, backend="triton")
    ref = linear_gelu_tanh_torch(x, w, b)
    assert torch.isnan(y[1]).all()
    assert torch.isinf(y[4]).any() and torch.isnan(y[4]).any()
    assert_close(y, ref, **FP32_TOL, name="specials")


def test_torch_backend_is_the_reference():
    x, w, b = make((2, 5, 41), 100, torch.bfloat16, "cpu")
    assert torch.equal(linear_gelu_tanh(x, w, b, backend="torch"), linear_gelu_tanh_torch(x, w, b))
    assert torch.equal(linear_gelu_tanh(x, w, b), linear_gelu_tanh_torch(x, w, b))  # auto on CPU


def test_bad_shapes_are_refused():
    x, w, b = make((9, 41), 70, torch.float32, "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        linear_gelu_tanh(x, w[:, :40], b)
    with pytest.raises(ValueError, match="bias"):
        linear_gelu_tanh(x, w, b[:69])
    with pytest.raises(TypeError, match="weight dtype"):
        linear_gelu_tanh(x, w.half(), b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_large():
    x, w, b = make((512, 1536), 2048, torch.bfloat16, "cuda")
    y = linear_gelu_tanh(x, w, b)  # auto: Triton on CUDA
    check(y, x, w, b, "cuda bf16 512x1536x2048")
