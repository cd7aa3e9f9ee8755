"""The cuBLAS-shaped LoRA paths (K-concatenation with [W | B] cached or rebuilt, delta
first) against an fp64 ground truth under the `lossless` rule (RMS and max error at most
1.5x the eager chain's, mean error at most 0.25x its RMS), against the wrong answers
(adapter off, one mean scale, GELU flipped, no bias), and the K-concat cache's keying."""
import pytest
import torch

from comfyui_lora_runtime.kernels import registry
from comfyui_lora_runtime.kernels.lora_linear import lora_linear, lora_linear_eager, lora_linear_torch
from comfyui_lora_runtime.kernels.lora_linear_cublas import cached_bytes, lora_linear_kconcat
from testkit.compare import MulCounter
from testkit.fixtures import assert_lossless  # contracts.md s.1 against the eager chain
from testkit.lora_linear_checks import ADAPTERS, check_not_wrong, make, truth64

BACKENDS = ["delta_first", "kconcat_cached", "kconcat_rebuilt"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adapters", list(ADAPTERS))
@pytest.mark.parametrize("gelu", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_within_the_lossless_rule_and_not_wrong(backend, dtype, adapters, gelu, bias):
    # 512 rows: enough elements for a stable max-error statistic
    args = make((4, 128, 64), 96, dtype, "cpu", adapters=adapters, bias=bias)
    state = {}
    y = lora_linear(*args, gelu=gelu, backend=backend, state=state)
    name = f"{backend} {dtype} {adapters} gelu={gelu} bias={bias}"
    assert y.dtype == dtype and y.shape == (4, 128, 96), name
    assert_lossless(y, lora_linear_eager(*args, gelu=gelu), truth64(*args, gelu), name)
    check_not_wrong(y, args, gelu, adapters, name)
    if backend == "kconcat_cached" and adapters != "none":
        assert cached_bytes(state) == 96 * (64 + args[3].shape[0]) * args[0].element_size()
    else:
        assert cached_bytes(state) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_adapter_on_bf16_model(backend):
    x, w, b, a, bb, s = make((256, 41), 70, torch.bfloat16, "cpu", adapters="several")
    args = (x, w, b, a.float(), bb.float(), s)
    y = lora_linear(*args, gelu=True, backend=backend)
    assert_lossless(y, lora_linear_eager(*args, gelu=True), truth64(*args, True), backend)


def test_cached_wb_is_reused_across_strengths_and_rebuilt_when_the_weight_changes():
    x, w, b, a, bb, _ = make((64, 41), 70, torch.float32, "cpu")
    state = {}
    y1 = lora_linear_kconcat(x, w, b, a, bb, 0.7, state=state)
    first = state["wb"][1]
    y2 = lora_linear_kconcat(x, w, b, a, bb, 0.3, state=state)  # a new strength lives in h only
    assert state["wb"][1] is first and not torch.equal(y1, y2)
    assert torch.equal(y2, lora_linear_kconcat(x, w, b, a, bb, 0.3, state=None, keep=False))
    with torch.no_grad():
        w.add_(1.0)  # e.g. a merge wrote into the weight: the cache must not serve the old W
    y3 = lora_linear_kconcat(x, w, b, a, bb, 0.3, state=state)
    assert state["wb"][1] is not first
    assert torch.allclose(y3, lora_linear_torch(x, w, b, a, bb, 0.3), atol=1e-4)
    bb2 = bb.clone()
    lora_linear_kconcat(x, w, b, a, bb2, 0.3, state=state)  # another adapter's B
    assert torch.equal(state["wb"][1][:, 41:], bb2)



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale,muls", [(1.0, 0), (0.7, 1)])
def test_unit_scale_is_not_multiplied(backend, scale, muls):
    x, w, b, a, bb, _ = make((9, 41), 70, torch.float32, "cpu")
    with MulCounter() as counter:
        lora_linear(x, w, b, a, bb, scale, backend=backend)
    assert counter.muls == muls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_bf16(backend):
    args = make((4096, 1536), 2048, torch.bfloat16, "cuda", adapters="several")
    y = lora_linear(*args, gelu=True, backend=backend, state={})
    assert_lossless(y, lora_linear_eager(*args, gelu=True), truth64(*args, True), f"cuda {backend}")
    check_not_wrong(y, args, True, "several", f"cuda {backend}")


@pytest.mark.parametrize("backend", BACKENDS + ["torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_per_row_scale_rides_in_h(backend, dtype):
    """A CFG batch with a per-branch adapter: factors per row and rank ([M, R]), half the rows 0."""
    x, w, b, a, bb, s = make((4, 128, 64), 96, dtype, "cpu", adapters="several")
    rows = torch.tensor([0.0, 0.0, 1.0, 1.0]).repeat_interleave(128)  # negative rows first
    per_row = rows[:, None] * s[None, :]
    y = lora_linear(x, w, b, a, bb, per_row, gelu=True, backend=backend)
    truth = torch.cat([truth64(x[:2], w, b, a[:0], bb[:, :0], 1.0, True), truth64(x[2:], w, b, a, bb, s, True)])
    eager = torch.cat([lora_linear_eager(x[:2], w, b, a[:0], bb[:, :0], 1.0, gelu=True),
                       lora_linear_eager(x[2:], w, b, a, bb, s, gelu=True)])
    assert_lossless(y, eager, truth, backend)
    wrong = lora_linear_torch(x, w, b, a, bb, s, gelu=True)  # the mask ignored
    assert (y[:2].double() - wrong[:2].double()).abs().mean() > 30 * (y[:2].double() - truth[:2]).abs().mean()


def test_the_triton_kernel_refuses_a_per_row_scale():
    x, w, b, a, bb, s = make((8, 41), 70, torch.float32, "cpu", adapters="several")
    with pytest.raises(registry.KernelUnavailableError, match="row_scale"):
        lora_linear(x, w, b, a, bb, s.expand(8, -1), backend="triton")
    with pytest.raises(ValueError, match=r"per row and rank \[M=8"):
        lora_linear(x, w, b, a, bb, s.expand(9, -1), backend="torch")
