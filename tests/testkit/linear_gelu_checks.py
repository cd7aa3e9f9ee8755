"""linear_gelu_tanh's test inputs and checks: shapes, inputs, the fp64 ground truth and the
comparison with the fp32 torch reference. Shared by its kernel tests and the launch-config
candidates."""
import torch
import torch.nn.functional as F

from comfyui_lora_runtime.kernels.linear_gelu_tanh import linear_gelu_tanh_eager, linear_gelu_tanh_torch
from testkit.compare import assert_close, assert_within_relative_rule, order_atol

# x shape, N. Odd sizes so every tile edge is ragged (interpreter tiles: 16 x 32 x 32).
SHAPES = [((9, 41), 341), ((1, 16), 32), ((33, 64), 70), ((2, 5, 41), 100)]
LOW = [torch.float16, torch.bfloat16]
# fp32: kernel and reference both sum K <= 64 fp32 products, in different orders
# (a few ulps), and torch's 0.5u(1+tanh) cancels for u << 0 where ours does not.
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
# Low precision vs the fp32 reference: both round nearly the same fp32 value once,
# so they may land one ulp apart where it sits next to a rounding boundary.
ULP_RTOL = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def make(x_shape, n, dtype, device, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = x_shape[-1]
    x = torch.randn(x_shape, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5 * 1.5
    b = torch.randn(n, generator=g) * 0.5 if bias else None
    cast = lambda t: None if t is None else t.to(dtype).to(device)  # noqa: E731
    return cast(x), cast(w), cast(b)


def truth64(x, w, b):
    y = F.linear(x.double(), w.double(), None if b is None else b.double())
    return F.gelu(y, approximate="tanh")


def check(y, x, w, b, name):
    ref = linear_gelu_tanh_torch(x, w, b)
    assert y.dtype == x.dtype and y.shape == ref.shape, name
    order = order_atol(x, w)  # the two sum the same fp32 products in different orders
    if x.dtype == torch.float32:
        assert_close(y, ref, atol=FP32_TOL["atol"] + order, rtol=FP32_TOL["rtol"], name=name)
    else:
        assert_close(y, ref, atol=1e-6 + order, rtol=ULP_RTOL[x.dtype], name=name + " vs fp32 ref")
        assert_within_relative_rule(y, linear_gelu_tanh_eager(x, w, b), truth64(x, w, b), name=name)
