"""Reading and re-quantizing a sample of a quantized weight's rows (`layer.quantized_rows`).

Reference: the whole weight, dequantized and re-quantized whole by its own layout (real
comfy-kitchen ``QuantizedTensor`` weights). Wrong answer: re-quantizing the rows alone, at the
scale their own largest value gives."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("comfy_kitchen")

from comfyui_lora_runtime.standalone.host import quant_formats  # noqa: E402
from comfyui_lora_runtime.lora_runtime.layer import quantized_rows as qr  # noqa: E402
from comfyui_lora_runtime.lora_runtime.layer.base_weight import dequantized, quant_layout  # noqa: E402

ELEMENTWISE = ["TensorCoreFP8Layout", "TensorCoreFP8E4M3Layout", "TensorCoreFP8E5M2Layout", "TensorWiseINT8Layout"]
LAYOUTS = ELEMENTWISE + ["TensorCoreMXFP8Layout", "TensorCoreNVFP4Layout", "TensorCoreConvRotW4A4Layout",
                         "AsymW4A8Int8Layout"]
TENSOR_SCALED = ELEMENTWISE + ["TensorCoreNVFP4Layout"]  # a scale from the whole tensor's largest value
ROWS = torch.tensor([0, 7, 100, 299])


def _weight(layout: str, cols: int = 256):
    quant_formats.require_comfy_kitchen()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, cols, generator=g)
    w[150, 9] = 9.0  # the largest value, in a row the sample does not hold
    kw = {"scale": "recalculate"} if layout in ELEMENTWISE else {}
    return quant_formats._quantized_tensor_class().from_float(w, layout, **kw)


# layouts that rotate each row block (a Hadamard matmul) before rounding and after dequantizing: their
# rows re-quantized alone store the whole merge's codes bit for bit, while the per-row scales (from the
# rotated values) and the dequantized values may differ in the last bits where the CPU's matmul blocks by
# row count (oneDNN / AMX builds do): to 8 fp32 ulps of the scales and of the rows' largest value
ROTATED = ["TensorCoreConvRotW4A4Layout", "AsymW4A8Int8Layout"]
ULPS = 8 * torch.finfo(torch.float32).eps


def _same_rows(q, exact: torch.Tensor, got: torch.Tensor) -> bool:
    """Are `got` (the ROWS of `exact` re-quantized alone and dequantized) the whole merge's ROWS? Bit for
    bit; for a ROTATED layout, its stored codes bit for bit, its scales and values to the rotation's fp32
    rounding."""
    whole_q = q.requantize_from_float(exact, scale="recalculate")
    whole = dequantized(whole_q)[ROWS]
    if quant_layout(q) not in ROTATED:
        return torch.equal(got, whole)
    alone_q = q.requantize_from_float(exact[ROWS], scale="recalculate")
    n = exact.shape[0]
    params = [(a.float(), (w[ROWS] if w.dim() and w.shape[0] == n else w).float())
              for a, w in zip(vars(alone_q._params).values(), vars(whole_q._params).values()) if torch.is_tensor(w)]
    return (torch.equal(alone_q._qdata, whole_q._qdata[ROWS])
            and all(torch.allclose(a, w, rtol=ULPS, atol=0) for a, w in params)
            and torch.allclose(got, whole, rtol=0, atol=ULPS * float(whole.abs().max())))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_requantize_as_the_whole_merge_does(layout):
    q = _weight(layout)
    assert qr.row_wise(q)
    full = dequantized(q)
    exact = full + 0.01 * torch.randn(full.shape, generator=torch.Generator().manual_seed(2))
    amax = exact.abs().amax()
    assert _same_rows(q, exact, qr.grid_round_rows(q, exact[ROWS], amax))  # round to nearest: bit for bit
    # the wrong answer, the rows at their own largest value: off wherever a scale spans the tensor
    alone = dequantized(q.requantize_from_float(exact[ROWS], scale="recalculate"))
    assert _same_rows(q, exact, alone) == (layout not in TENSOR_SCALED)


@pytest.mark.parametrize("layout", ELEMENTWISE)
def test_elementwise_layouts_read_rows_and_elements_from_their_bytes(layout):
    q = _weight(layout)
    assert qr.elementwise(q)
    full = dequantized(q)
    assert torch.equal(qr.dequantized_rows(q, ROWS), full[ROWS])
    assert torch.equal(qr.stored_row_absmax(q), full.abs().amax(dim=1))
    t = float(full.abs().flatten().kthvalue(full.numel() - 40).values)  # about the 40 largest
    rows, cols = qr.elements_at_least(q, t, limit=10_000)
    want = torch.nonzero(full.abs() >= t, as_tuple=True)
    assert torch.equal(rows, want[0]) and torch.equal(cols, want[1]) and 0 < rows.numel() < full.numel() // 50
    assert torch.equal(qr.dequantized_at(q, rows, cols), full[rows, cols])
    assert qr.elements_at_least(q, t, limit=rows.numel() - 1) is None
    # among some rows only (only those are read): the same elements, restricted to them
    some = torch.unique(rows)[::2]
    r2, c2 = qr.elements_at_least(q, t, limit=10_000, rows=some)
    keep = torch.isin(rows, some)
    assert torch.equal(r2, rows[keep]) and torch.equal(c2, cols[keep]) and 0 < r2.numel() < rows.numel()
    # one threshold per row: each row's own elements at least its own threshold
    ts = torch.linspace(0.5 * t, 1.5 * t, some.numel())
    r3, c3 = qr.elements_at_least(q, ts, limit=10_000, rows=some)
    want = torch.nonzero(full[some].abs() >= ts[:, None], as_tuple=True)
    assert torch.equal(r3, some[want[0]]) and torch.equal(c3, want[1]) and r3.numel() != r2.numel()


@pytest.mark.parametrize("layout", ELEMENTWISE)
def test_the_value_table_is_the_layouts_own_dequantization(layout):
    """Every element looked up in the weight's `value_table` equals its dequantized value, bit for bit.
    Wrong answer: the table of the same bytes at another tensor scale."""
    q = _weight(layout)
    full = dequantized(q)
    rows, cols = torch.nonzero(torch.ones_like(full, dtype=torch.bool), as_tuple=True)
    table = qr.value_table(q)
    assert table.shape == (256,) and table.dtype == torch.float32
    assert torch.equal(qr.dequantized_at(q, rows, cols, table), full.reshape(-1))
    twice = quant_formats._quantized_tensor_class().from_float(full * 2, layout, scale="recalculate")
    other = qr.value_table(twice)
    assert not torch.equal(qr.dequantized_at(q, rows, cols, other), full.reshape(-1))


@pytest.mark.parametrize("layout", ELEMENTWISE)
def test_rows_read_as_one_multiply_are_the_layouts_own(layout):
    """Where every stored code's value is the code in fp32 times the scale (`linear_scale`, checked
    against the value table), rows read as that multiply equal the layout's dequantized rows bit for
    bit. Wrong answers: a scale one ulp off, and a table one entry off (then no scale is returned)."""
    q = _weight(layout)
    full = dequantized(q)
    table = qr.value_table(q)
    scale = qr.linear_scale(q, table)
    assert scale is not None and scale.dtype == torch.float32
    every = torch.arange(300)
    assert torch.equal(qr.dequantized_rows(q, every, scale), full)
    assert torch.equal(qr.dequantized_rows(q, ROWS, scale), full[ROWS])
    off = torch.nextafter(scale, torch.tensor(float("inf")))
    assert not torch.equal(qr.dequantized_rows(q, every, off), full)
    bent = table.clone()
    bent[3] = torch.nextafter(bent[3], torch.tensor(float("inf")))
    assert qr.linear_scale(q, bent) is None


@pytest.mark.parametrize("cols", [256, 200])  # whole 64-byte blocks, and a short last block
@pytest.mark.parametrize("layout", ELEMENTWISE)
def test_elements_found_from_block_maxima_are_every_byte_s(layout, cols, monkeypatch):
    """The block index (each byte block's largest stored magnitude: at most 64 strided columns) finds
    the same elements as reading every byte, for one threshold, one per row and one per row and
    block, by reading the hit blocks alone or the rows whole, in row-major order. Reference: the
    dequantized weight's |values| against the thresholds; wrong answer: the rows' lowest threshold
    applied to every block."""
    q = _weight(layout, cols)
    full = dequantized(q)
    blocks = qr.stored_blocks(q)
    nblk, of = qr.byte_blocks(cols), qr.block_of(cols)
    assert nblk == -(-cols // qr.BYTE_BLOCK) and int(torch.bincount(of).max()) <= qr.BYTE_BLOCK
    top = torch.zeros(full.shape[0], nblk).scatter_reduce(1, of.expand(full.shape), full.abs(), "amax")
    contiguous = torch.zeros(full.shape[0], nblk * qr.BYTE_BLOCK)
    contiguous[:, :cols] = full.abs()
    assert torch.equal(qr.stored_row_absmax(q, blocks), full.abs().amax(dim=1))
    assert torch.equal(qr.stored_row_absmax(q, blocks[:, :1]), top[:, 0])  # wrong: one block
    assert not torch.equal(qr.stored_row_absmax(q, blocks[:, :1]), full.abs().amax(dim=1))
    assert torch.equal(qr.blocks_max(full[7].abs()), top[7])
    assert not torch.equal(top, contiguous.reshape(full.shape[0], nblk, -1).amax(dim=2))  # wrong: adjacent columns
    if layout == "TensorWiseINT8Layout":
        assert torch.equal(blocks.float() * q._params.scale.float(), top)
    t = float(full.abs().flatten().kthvalue(full.numel() - 200).values)
    rows = torch.arange(0, full.shape[0], 3)
    g = torch.Generator().manual_seed(4)
    per_block = t * (0.5 + torch.rand(rows.numel(), nblk, generator=g))
    cases = [(t, None), (torch.linspace(0.6 * t, 1.4 * t, rows.numel()), rows), (per_block, rows)]
    for share in (1, 10 ** 9):  # hit blocks read alone; rows read whole
        monkeypatch.setattr(qr, "BLOCK_READ_SHARE", share)
        for thr, sel in cases:
            got = qr.elements_at_least(q, thr, 10 ** 6, sel, blocks)
            sub = full.abs() if sel is None else full[sel].abs()
            tt = torch.as_tensor(thr, dtype=torch.float32)
            need = tt[:, of] if tt.dim() == 2 else tt.reshape(-1, 1)
            r, c = torch.nonzero(sub >= need, as_tuple=True)
            want = (r if sel is None else sel[r], c)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and 0 < r.numel() < sub.numel() // 10
            assert qr.elements_at_least(q, thr, r.numel() - 1, sel, blocks) is None
        lowest = qr.elements_at_least(q, per_block.amin(dim=1), 10 ** 6, rows, blocks)
        assert lowest[0].numel() > got[0].numel()  # the wrong answer finds more


def test_int8_is_modelled_only_for_the_kitchens_own_class(monkeypatch):
    """Per-tensor int8's stochastic rounding is modelled for comfy-kitchen's own int8 class with a seed;
    not without a seed, not for a host's replacement class (its rounding is not known), and not for
    comfy-kitchen's own fp8 class (it ignores seeds)."""
    q = _weight("TensorWiseINT8Layout")
    assert qr.expected_rounding(q, 5) and not qr.expected_rounding(q, 0)
    assert qr.expected_rounding(_weight("TensorCoreFP8Layout"), 5) is None
    import comfy_kitchen.tensor as ck_tensor
    kitchen = ck_tensor.get_layout_class("TensorWiseINT8Layout")
    replaced = type("TensorWiseINT8Layout", (kitchen,), {"quantize": classmethod(lambda cls, t, **kw: None)})
    with monkeypatch.context() as m:
        m.setattr(ck_tensor, "get_layout_class", lambda name: replaced)
        assert not qr.expected_rounding(q, 5)


@pytest.mark.parametrize("layout", ["TensorWiseINT8Layout", "TensorCoreFP8E4M3Layout", "TensorCoreFP8E5M2Layout"])
def test_stochastic_rounding_is_measured_as_its_expectation(layout):
    """Per-tensor int8 and fp8 merged with the host's stochastic rounding: the rows left rounded to
    nearest on the whole merge's grid (the layout's own rounding without a seed, bit for bit), and the
    expected squared error of its stochastic rounding, against the mean of 400 of the layout's own
    seeded draws (to 4 standard errors of that mean). Wrong answer: the round-to-nearest error (about
    half as large)."""
    q = _weight(layout)
    g = torch.Generator().manual_seed(6)
    exact, amax = torch.randn(40, 256, generator=g), torch.tensor(9.5)
    measured = slice(0, 30)
    rounded, e = qr.expected_rounding(q, 5)(exact, amax, measured)
    assert torch.equal(rounded, qr.grid_round_rows(q, exact, amax, 0))
    draws = torch.tensor([float((qr.grid_round_rows(q, exact, amax, s)[measured] - exact[measured]).square().sum())
                          for s in range(1, 401)], dtype=torch.float64)
    assert abs(e - float(draws.mean())) <= 4 * float(draws.std()) / 400 ** 0.5
    nearest = float((rounded[measured] - exact[measured]).square().sum())
    assert e > 1.5 * nearest


@pytest.mark.parametrize("share", [0.0005, 0.01, 0.2, 0.6])
def test_sparse_nonzero_is_nonzero(share):
    """A mask's True elements read word by word (or element by element where most words hold one)
    are torch.nonzero's, in its order; None past the limit. Wrong answer: the transposed mask's."""
    g = torch.Generator().manual_seed(5)
    for shape in ((97, 131), (64, 256)):  # a size that is not a whole number of 8-byte words
        mask = torch.rand(shape, generator=g) < share
        mask[-1, -1] = True  # one in the tail
        want = torch.nonzero(mask, as_tuple=True)
        got = qr._sparse_nonzero(mask, mask.numel())
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert qr._sparse_nonzero(mask, want[0].numel() - 1) is None
        flipped = torch.nonzero(mask.t().contiguous(), as_tuple=True)
        assert not (torch.equal(got[0], flipped[1]) and torch.equal(got[1], flipped[0]))


@pytest.mark.parametrize("layout", LAYOUTS[4:])
def test_block_layouts_are_not_read_by_element(layout):
    assert not qr.elementwise(_weight(layout))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_row_local_layouts(layout):
    """A layout is row-local exactly when rows re-quantized alone are the whole merge's rows (the
    wrong answer: a tensor-scaled layout called row-local)."""
    q = _weight(layout)
    assert qr.row_local(q) == (layout not in TENSOR_SCALED)
    full = dequantized(q)
    exact = full + 0.01 * torch.randn(full.shape, generator=torch.Generator().manual_seed(2))
    alone = qr.grid_round_rows(q, exact[ROWS], None)
    assert _same_rows(q, exact, alone) == qr.row_local(q)


@pytest.mark.parametrize("layout", ["TensorCoreMXFP8Layout", "TensorCoreNVFP4Layout"])
def test_swizzled_layouts_read_any_rows_alone(layout):
    """Rows of a layout whose block scales are stored swizzled (128-row tiles), read as a weight of
    their own, are bit for bit those rows of the whole dequantization (any rows, any order, a tile's
    partial tail); nvfp4's row bound from its scales is never below a row's largest value, and
    close to it (the wrong answer, the per-tensor scale alone, is far)."""
    q = _weight(layout)
    assert qr.swizzled(q)
    full = dequantized(q)
    for rows in (ROWS, torch.tensor([299, 3, 150]), torch.arange(128, 300), torch.tensor([5])):
        got = qr.dequantized_rows(q, rows)
        assert torch.equal(got, full[rows]), rows
    assert not torch.equal(qr.dequantized_rows(q, ROWS), full[(ROWS + 1) % full.shape[0]])
    if layout == "TensorCoreNVFP4Layout":
        bound, top = qr.row_bound(q), full.abs().amax(dim=1)
        assert bool((bound >= top).all()) and float((bound / top).max()) < 2.0
        # single 16-element blocks: bounded from their scales, and read alone bit for bit
        blocks = full.abs().reshape(full.shape[0], -1, qr.NVFP4_BLOCK).amax(dim=2)
        bound = qr.block_bound(q, torch.arange(full.shape[0]))
        assert bool((bound >= blocks).all()) and float((bound / blocks).max()) < 2.0
        rows, at = torch.tensor([0, 150, 299, 131, 150, 7]), torch.tensor([0, 0, 15, 8, 1, 3])
        want = torch.stack([full[r, b * 16:(b + 1) * 16] for r, b in zip(rows.tolist(), at.tolist())])
        assert qr.reads_blocks(q) and torch.equal(qr.dequantized_blocks(q, rows, at), want)
        assert not torch.equal(qr.dequantized_blocks(q, rows, (at + 1) % 16), want)  # the wrong answer: the next block
