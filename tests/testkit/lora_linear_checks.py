"""lora_linear's test inputs and checks: adapter sets, inputs, the fp64 ground truth, the
comparison with the fp32 torch reference and with the wrong answers. Shared by the kernel
tests of lora_linear, its cuBLAS paths and the launch-config candidates."""
import torch
import torch.nn.functional as F

from comfyui_lora_runtime.kernels.lora_linear import lora_linear_eager, lora_linear_torch
from testkit.compare import assert_close, assert_differs, assert_within_relative_rule, order_atol

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
