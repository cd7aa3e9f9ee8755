"""A sample of a host-quantized weight's rows: read, and re-quantized as a whole-tensor merge would.

Contract
- `row_wise(w)`: True for the layouts whose re-quantization (``requantize_from_float`` with the scale
  recalculated) treats each row on its own, given the tensor's largest ``|value|``: per-tensor fp8 and
  int8, mxfp8, nvfp4, and the convrot / asymmetric 4-bit layouts (their scales are per row or per
  block of a row). Other layouts are measured on every row.
- `grid_round_rows(w, exact, amax, seed)`: what a merge of a whole fp32 weight whose largest ``|value|``
  is `amax` leaves in the rows `exact` holds: the rows are re-quantized together with one extra row
  holding `amax`, so the layout's recalculated scale is the whole merge's. Round to nearest (seed 0):
  bit for bit the rows of the whole merge; stochastic (seed > 0): the same grid, other random draws.
- `elementwise(w)`: the layout dequantizes as stored value times one scalar scale (per-tensor fp8,
  int8 without rotation): then `dequantized_rows(w, rows)` reads only those rows (bit for bit the
  rows of the whole dequantization) and `stored_row_absmax(w)` reads each row's largest ``|value|``
  from the stored bytes, exactly, without dequantizing; `elements_at_least(w, t, limit, rows)` finds
  the elements whose |value| is at least `t` the same way, reading only `rows` when given (None past
  `limit` of them), and `dequantized_at(w, rows, cols)` reads them.
- `row_local(w)`: the row-wise layouts with no scale spanning the tensor (mxfp8, the 4-bit ones):
  rows re-quantized alone are the whole merge's rows. `dequantized_tiles(w, tiles)` reads whole
  tiles of rows of a layout whose swizzled scales come in tiles of `tile_rows(w)` rows (mxfp8: 128)
  without dequantizing the rest, bit for bit the rows of the whole dequantization.
- `block_width(w)`: the columns a row-wise layout quantizes together (per-tensor fp8 / int8: 1,
  nvfp4: 16, mxfp8: 32), or None when whole rows must go together; blocks of any rows, laid out as
  the rows of a tensor of that width, re-quantize as in the whole tensor (`grid_round_rows`).
- `top_step(w, amax)`: an upper bound of one grid step anywhere in the tensor when its largest
  ``|value|`` is `amax` (how far a re-quantization can move a value), or None when unknown.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .base_weight import dequantized, quant_layout

_FP8_LAYOUTS = ("TensorCoreFP8Layout", "TensorCoreFP8E4M3Layout", "TensorCoreFP8E5M2Layout")
ROW_WISE_LAYOUTS = frozenset(_FP8_LAYOUTS + (
    "TensorWiseINT8Layout", "TensorCoreMXFP8Layout", "TensorCoreNVFP4Layout",
    "TensorCoreConvRotW4A4Layout", "AsymW4A8Int8Layout"))
# the largest grid step relative to the largest value, per storage: per-tensor fp8 puts amax at the dtype's
# max (e4m3: 448, step 32 in its top binade; e5m2: 57344, step 8192), int8 at 127 (step 1); mxfp8's
# power-of-two block scale can sit up to 2x above its block's max (e4m3 elements)
_FP8_STEP = {torch.float8_e4m3fn: 32 / 448, torch.float8_e5m2: 8192 / 57344}
_RELATIVE_STEP = {"TensorWiseINT8Layout": 1 / 127, "TensorCoreMXFP8Layout": 2 * 32 / 448}


_BLOCK = {"TensorWiseINT8Layout": 1, "TensorCoreMXFP8Layout": 32, "TensorCoreNVFP4Layout": 16}


def block_width(w) -> int | None:
    """The columns `w`'s layout quantizes together, or None (whole rows)."""
    layout = quant_layout(w)
    if layout in _FP8_LAYOUTS:
        return 1
    if layout == "TensorWiseINT8Layout" and getattr(w._params, "convrot", False):
        return None
    return _BLOCK.get(layout)


# layouts whose scales belong to blocks of one row and none spans the tensor (re-quantizing rows
# alone gives the whole merge's rows); with the rows per tile of their swizzled scale layout (None:
# rows are read from the whole dequantization)
_ROW_LOCAL = {"TensorCoreMXFP8Layout": 128, "TensorCoreConvRotW4A4Layout": None, "AsymW4A8Int8Layout": None}


def row_local(w) -> bool:
    """Does re-quantizing `w` treat each row on its own, with no scale spanning the tensor? (2-D only)"""
    return quant_layout(w) in _ROW_LOCAL and len(w.shape) == 2


def tile_rows(w) -> int | None:
    """The rows one tile of a `row_local` weight's scales covers (read together), or None."""
    return _ROW_LOCAL.get(quant_layout(w))


@torch.no_grad()
def dequantized_tiles(w, tiles: torch.Tensor) -> torch.Tensor:
    """fp32 rows of the scale tiles `tiles` (ascending) of a `row_local` weight with `tile_rows`, read
    alone: equal to ``dequantized(w)[rows of those tiles]``. A tile's scales are `tile_rows` rows of
    the scale tensor in the tile's row order, so tiles stacked are a weight of the same layout."""
    t, rows = tile_rows(w), w.shape[0]
    q, scale = w._qdata, w._params.scale
    data, scales, n = [], [], 0
    for i in tiles.tolist():
        r0, r1 = i * t, min((i + 1) * t, rows)
        n += r1 - r0
        data.append(q[r0:r0 + (r1 - r0 + 31) // 32 * 32] if r1 - r0 < t else q[r0:r1])
        scales.append(scale[r0:r0 + t])
    if any(d.shape[0] != t for d in data[:-1]):
        raise ValueError("only the last tile may be a partial one")
    params = dataclasses.replace(w._params, scale=torch.cat(scales), orig_shape=(n, w.shape[1]),
                                 orig_dtype=torch.float32)
    return dequantized(w._copy_with(qdata=torch.cat(data), params=params))


def row_wise(w) -> bool:
    """Does re-quantizing `w`'s layout treat rows on their own, given the largest |value|? (2-D only)"""
    return quant_layout(w) in ROW_WISE_LAYOUTS and len(w.shape) == 2


def elementwise(w) -> bool:
    """Is `w` dequantized as stored value x one scalar scale, its rows stored as rows?"""
    layout = quant_layout(w)
    if layout not in _FP8_LAYOUTS + ("TensorWiseINT8Layout",) or len(w.shape) != 2:
        return False
    params = w._params
    if getattr(params, "convrot", False) or getattr(params, "transposed", False):
        return False
    tensors = [v for v in vars(params).values() if isinstance(v, torch.Tensor)]
    return tuple(w._qdata.shape) == tuple(w.shape) and all(t.numel() == 1 for t in tensors)


def _dequantized_data(w, q: torch.Tensor) -> torch.Tensor:
    """fp32 values of stored data `q` [m, k] of an `elementwise` weight, at its scale."""
    params = dataclasses.replace(w._params, orig_shape=tuple(q.shape), orig_dtype=torch.float32)
    return dequantized(w._copy_with(qdata=q, params=params))


@torch.no_grad()
def dequantized_rows(w, rows: torch.Tensor) -> torch.Tensor:
    """fp32 values of `rows` of an `elementwise` weight (equal to ``dequantized(w)[rows]``)."""
    return _dequantized_data(w, w._qdata[rows])


@torch.no_grad()
def stored_row_absmax(w) -> torch.Tensor:
    """fp32 [out]: each row's largest |value| of an `elementwise` weight, read from its stored bytes."""
    q = w._qdata
    if q.dtype not in _FP8_STEP:  # int8: |-128| does not fit int8, so the row's top is scaled here
        top = torch.maximum(q.amax(dim=1).to(torch.int16), -q.amin(dim=1).to(torch.int16))
        return top.to(torch.float32) * w._params.scale.to(torch.float32)
    top = (q.view(torch.uint8) & 0x7F).amax(dim=1).view(q.dtype)  # magnitude bits order like magnitudes
    return _dequantized_data(w, top.reshape(-1, 1)).reshape(-1)


@torch.no_grad()
def elements_at_least(w, t: float, limit: int, rows: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, cols) of the elements of an `elementwise` weight whose |value| is at least `t`, among
    `rows` (default: every row; only those are read); None when they are more than `limit`."""
    q, scale = w._qdata, float(w._params.scale)
    if rows is not None:
        q = q[rows.to(q.device)]
    if q.dtype in _FP8_STEP:  # the smallest magnitude byte whose value reaches t
        table = torch.arange(128, dtype=torch.uint8).view(q.dtype).to(torch.float32) * scale
        table = torch.where(torch.isfinite(table), table, torch.inf)
        byte = int(torch.searchsorted(table, torch.tensor([t], dtype=torch.float32)).item())
        if byte >= 128:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        hit = (q.view(torch.uint8) & 0x7F) >= byte
    else:
        k = max(1, math.ceil(t / scale * (1 - 1e-6)))  # below the exact ceiling: never miss an element
        if k > 128:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        hit = (q >= k) | (q <= -k) if k <= 127 else q == -128
    if int(hit.sum()) > limit:
        return None
    r, cols = torch.nonzero(hit, as_tuple=True)
    r = r.cpu()
    return (r if rows is None else rows.cpu()[r]), cols.cpu()


@torch.no_grad()
def dequantized_at(w, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """fp32 [m]: the values of an `elementwise` weight at (rows, cols)."""
    q = w._qdata[rows.to(w._qdata.device), cols.to(w._qdata.device)]
    return _dequantized_data(w, q.reshape(1, -1)).reshape(-1)


@torch.no_grad()
def grid_round_rows(w, exact: torch.Tensor, amax: torch.Tensor | None, seed: int = 0) -> torch.Tensor:
    """fp32 [rows, in]: the merged rows `exact` on the grid a whole merge with largest |value| `amax`
    uses (None: a `row_local` layout, whose rows need no tensor-wide value)."""
    kwargs = {"scale": "recalculate"}
    if seed:
        kwargs["stochastic_rounding"] = seed
    if amax is None:
        return dequantized(w.requantize_from_float(exact, **kwargs))
    extra = exact.new_zeros(1, exact.shape[1])
    extra[0, 0] = amax
    out = w.requantize_from_float(torch.cat([exact, extra]), **kwargs)
    return dequantized(out)[:-1]


def top_step(w, amax: float) -> float | None:
    """Upper bound of one grid step of `w`'s layout when the tensor's largest |value| is `amax`."""
    layout = quant_layout(w)
    if layout in _FP8_LAYOUTS:
        rel = _FP8_STEP.get(w._qdata.dtype)
    else:
        rel = _RELATIVE_STEP.get(layout)
    return None if rel is None else rel * amax * 1.01
