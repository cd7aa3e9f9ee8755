"""lora_linear: the LoRA-aware fused kernel (interpreted on CPU, compiled on CUDA)
against its fp32 torch reference, an fp64 ground truth and the wrong answers
(base weight alone, GELU off, one scale for all adapters)."""
import pytest
import torch
import torch.nn.functional as F
from testkit.compare import assert_close, assert_differs, assert_within_relative_rule, order_atol
from torch.utils._python_dispatch import TorchDispatchMode

from comfyui_lora_runtime.kernels.lora_linear import lora_linear, lora_linear_eager, lora_linear_torch

LOW = [torch.float16, torch.bfloat16]
# fp32: kernel and reference sum K + R <= 90 fp32 products in different orders
# (a few ulps), and torch's GELU formula cancels for u << 0 where ours does not.
FP32_TOL = dict(atol=2e-5, rtol=1e-5)
# Low precision vs the fp32 reference: both round nearly the same fp32 value once,
# so they may land one ulp apart next to a rounding boundary.
ULP_RTOL = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}

# adapter set -> (ranks of each adapter, strength of each); "none" is R = 0.
ADAPTERS = {
    "none": ((), ()),
    "one": ((7,), (0.7,)),
    "one_unit": ((8,), (1.0,)),              # scale exactly 1.0: the multiply is skipped
    "several": ((4, 12, 5), (0.8, -0.5, 1.3)),  # per-rank scale tensor, R = 21
}


def make(x_shape, n, dtype, device, *, adapters="one", bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = x_shape[-1]
    ranks, strengths = ADAPTERS[adapters]
    r = sum(ranks)
    x = torch.randn(x_shape, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5 * 1.5
    b = torch.randn(n, generator=g) * 0.5 if bias else None
    # Deltas as large as the base output, so dropping one cannot hide in the tolerance.
    a = torch.randn(r, k, generator=g) / k ** 0.5
    bb = torch.randn(n, r, generator=g) / max(r, 1) ** 0.5 * 1.5
    if len(ranks) > 1:  # each adapter's strength repeated over its ranks
        scale = torch.cat([torch.full((rk,), s) for rk, s in zip(ranks, strengths)]).to(device)
    else:
        scale = strengths[0] if ranks else 0.7
    cast = lambda t: None if t is None else t.to(dtype).to(device)  # noqa: E731
    return cast(x), cast(w), cast(b), cast(a), cast(bb), scale


def truth64(x, w, b, a, bb, scale, gelu):
    xd = x.double()
    y = F.linear(xd, w.double(), None if b is None else b.double())
    if a.shape[0]:
        h = F.linear(xd, a.double())
        h = h * (scale.double() if isinstance(scale, torch.Tensor) else scale)
        y = y + F.linear(h, bb.double())
    return F.gelu(y, approximate="tanh") if gelu else y


def check(y, args, gelu, name):
    x = args[0]
    ref = lora_linear_torch(*args, gelu=gelu)
    assert y.dtype == x.dtype and y.shape == ref.shape, name
    order = order_atol(x, args[1], args[3], args[4], args[5])  # fp32 sums in different orders
    if x.dtype == torch.float32:
        assert_close(y, ref, atol=FP32_TOL["atol"] + order, rtol=FP32_TOL["rtol"], name=name)
    else:
        assert_close(y, ref, atol=1e-6 + order, rtol=ULP_RTOL[x.dtype], name=name + " vs fp32 ref")
        assert_within_relative_rule(y, lora_linear_eager(*args, gelu=gelu), truth64(*args, gelu),
                                    name=name)


def check_not_wrong(y, args, gelu, adapters, name):
    x, w, b, a, bb, scale = args
    if adapters != "none":  # never the base weight alone
        base = lora_linear_torch(x, w, b, a[:0], bb[:, :0], 1.0, gelu=gelu)
        assert_differs(y, base, min_abs=0.1, name=name + " vs base only")
    if isinstance(scale, torch.Tensor):  # the per-rank factors matter
        flat = lora_linear_torch(x, w, b, a, bb, float(scale.mean()), gelu=gelu)
        assert_differs(y, flat, min_abs=0.1, name=name + " vs one mean scale")
    other = lora_linear_torch(*args, gelu=not gelu)
    assert_differs(y, other, min_abs=0.1, name=name + f" vs gelu={not gelu}")
    if b is not None:
        assert_differs(y, lora_linear_torch(x, w, None, a, bb, scale, gelu=gelu), min_abs=0.1,
                       name=name + " vs no bias")


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
