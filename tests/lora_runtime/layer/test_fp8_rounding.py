"""The host's stochastic fp8 rounding, read as an exact table (`layer/fp8_rounding.py`)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

ck = pytest.importorskip("comfy_kitchen")

from comfyui_lora_runtime.standalone.host import quant_formats  # noqa: E402
from comfyui_lora_runtime.lora_runtime.layer import fp8_rounding as fr  # noqa: E402
from comfyui_lora_runtime.lora_runtime.layer import quantized_rows as qr  # noqa: E402

HOST_FP8 = {"TensorCoreFP8E4M3Layout": torch.float8_e4m3fn, "TensorCoreFP8E5M2Layout": torch.float8_e5m2}


def _weight(layout: str):
    quant_formats.require_comfy_kitchen()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 256, generator=g)
    w[150, 9] = 9.0
    return quant_formats._quantized_tensor_class().from_float(w, layout, scale="recalculate")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_table_is_the_kitchens_rounding_for_every_half_and_every_byte(dtype):
    """Every finite float16 value with every one of the 256 bytes: the table's outcome is the kitchen's
    `stochastic_rounding_fp8`, bit for bit (16.7 M cases; NaN where the kitchen gives NaN: float16
    values past e5m2's largest, which no merge's scaled values reach), and its odds are the count of
    bytes that draw the high outcome. Wrong answer: a table whose first high byte is one later."""
    table = fr.rounding_table(dtype)
    h = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.float16).copy())
    h = h[h.isfinite()]
    ups = torch.zeros(h.numel(), dtype=torch.int32)
    for k in range(256):
        byte = torch.full(h.shape, k, dtype=torch.uint8)
        got = ck.stochastic_rounding_fp8(h, byte, dtype).float()
        want = table.draw(h.float(), byte).float()
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)) and torch.equal(got.isnan(), want.isnan()), k
        ups += (got != table.at(table.low, table.index(h.float()))).int()
    i = table.index(h.float())
    real = ~table.at(table.low, i).isnan()
    assert int((~real).sum()) == (10 if dtype == torch.float8_e5m2 else 0)
    assert torch.equal(table.at(table.p_high, i)[real], ups[real].float() / 256)
    late = dataclasses.replace(table, k_min=table.k_min + 1)
    byte = 255 - (torch.arange(h.numel()) % 256).to(torch.uint8)
    assert not torch.equal(late.draw(h.float(), byte).float(), ck.stochastic_rounding_fp8(h, byte, dtype).float())


def test_only_a_layout_that_draws_as_the_table_predicts_is_modelled(monkeypatch, caplog):
    """The host's fp8 layouts (ComfyUI's: bytes from a seeded generator, the kitchen's rounding) are
    modelled; comfy-kitchen's own fp8 class (it ignores the seed: rounds to nearest), no seed, and a
    host class whose seeded rounding draws otherwise (a float draw per element) are not."""
    for layout in HOST_FP8:
        assert fr.model_for(_weight(layout), 5) is not None
        assert qr.expected_rounding(_weight(layout), 5) is not None
        assert qr.expected_rounding(_weight(layout), 0) is None
    assert qr.expected_rounding(_weight("TensorCoreFP8Layout"), 5) is None
    assert fr.model_for(_weight("TensorWiseINT8Layout"), 5) is None  # not an fp8 layout: never probed
    import comfy_kitchen.tensor.base as ck_base
    base = ck_base.get_layout_class("TensorCoreFP8E4M3Layout")

    def quantize(cls, tensor, scale=None, stochastic_rounding=0, **kw):
        scale = tensor.abs().amax().float() / 448.0
        g = torch.Generator().manual_seed(int(stochastic_rounding))
        x = (tensor / scale).half()
        noise = (torch.rand(x.shape, generator=g) - 0.5).half() / 8
        return (x + noise * x.abs()).float().clamp(-448, 448).to(torch.float8_e4m3fn), cls.Params(
            scale=scale, orig_dtype=tensor.dtype, orig_shape=tuple(tensor.shape))

    def toward_zero(cls, tensor, scale=None, stochastic_rounding=0, **kw):  # the kitchen's draw, another nearest
        if stochastic_rounding:
            return base.quantize.__func__(cls, tensor, scale=scale, stochastic_rounding=stochastic_rounding, **kw)
        qdata, params = base.quantize.__func__(cls, tensor, scale=scale, **kw)
        back = qdata.float() * params.scale
        lower = torch.where(back.abs() > (tensor.abs() + 1e-12), qdata.view(torch.uint8) - 1, qdata.view(torch.uint8))
        return lower.to(torch.uint8).view(qdata.dtype), params

    other = type("OtherFP8Layout", (base,), {"quantize": classmethod(quantize)})
    nearest = type("TruncatingFP8Layout", (base,), {"quantize": classmethod(toward_zero)})
    monkeypatch.setitem(ck_base.LAYOUTS, "OtherFP8Layout", other)
    monkeypatch.setitem(ck_base.LAYOUTS, "TruncatingFP8Layout", nearest)
    monkeypatch.setattr(fr, "_MODELS", {})
    monkeypatch.setattr(fr, "FP8_LAYOUTS", fr.FP8_LAYOUTS + ("OtherFP8Layout", "TruncatingFP8Layout"))  # probed
    q = _weight("TensorCoreFP8E4M3Layout")
    with caplog.at_level("DEBUG", logger=fr.__name__):
        assert fr.model_for(type(q)(q._qdata, "OtherFP8Layout", q._params), 5) is None
        assert "is not the kitchen's byte draw" in caplog.text  # refused for its draw
        caplog.clear()
        assert fr.model_for(type(q)(q._qdata, "TruncatingFP8Layout", q._params), 5) is None
    assert "rounds to nearest otherwise" in caplog.text  # its draw passed: its nearest did not
    assert fr.model_for(q, 5) is not None


@pytest.mark.parametrize("layout", list(HOST_FP8))
def test_a_seeded_fp8_merge_drawn_from_the_table_is_the_layouts_own(layout, monkeypatch):
    """The merge's re-quantization with a seed, drawn through the table, is the layout's own seeded
    `requantize_from_float`: the same bytes, scale and params, bit for bit (a merged weight of 300 x
    256, chunks of 1/8 of it). Wrong answer: the same merge with another seed (other bytes)."""
    from comfyui_lora_runtime.lora_runtime.layer import quantized_merge as qm
    monkeypatch.setattr(fr, "CHUNK_ELEMENTS", 300 * 256 // 8)
    q = _weight(layout)
    merged = q.dequantize().float() + torch.randn(300, 256, generator=torch.Generator().manual_seed(4)) * 0.05
    assert fr.model_for(q, 1234) is not None  # the probe (once per layout) before counting
    drawn = []
    real = fr._drawn
    monkeypatch.setattr(fr, "_drawn", lambda *a: drawn.append(1) or real(*a))
    mine = qm.requantized(q, merged, 1234)
    assert len(drawn) == 1  # the table's path, not the layout's
    own = q.requantize_from_float(merged, scale="recalculate", stochastic_rounding=1234)
    assert fr._same(mine, own)
    other = q.requantize_from_float(merged, scale="recalculate", stochastic_rounding=1235)
    assert not fr._same(mine, other)
    assert torch.equal(qm.requantized(q, merged, 0)._qdata.view(torch.uint8),
                       q.requantize_from_float(merged, scale="recalculate")._qdata.view(torch.uint8))
