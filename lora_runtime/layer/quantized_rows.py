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
- `expected_rounding(w, seed)`: where a merge into `w` with `seed` rounds stochastically in a way known
  exactly, a function `(exact, amax, measured) -> (rows, e)`: on the whole merge's grid (largest
  |value| `amax`), the rows `exact` rounded to nearest (the layout's own rounding without a seed, bit
  for bit) and the exact expected sum of squared errors of the stochastic rounding over rows
  `measured`. No random draw. Per-tensor int8 (comfy-kitchen's class: floor(v / s + u), u uniform in
  [0, 1)): `expected_round_rows`, s^2 f (1 - f) per element, f the fraction of v / s past its floor;
  per-tensor fp8 (the host's byte draws): `fp8_rounding`. None otherwise.
- `elementwise(w)`: the layout dequantizes as stored value times one scalar scale (per-tensor fp8,
  int8 without rotation): then `dequantized_rows(w, rows)` reads only those rows (bit for bit the
  rows of the whole dequantization) and `stored_row_absmax(w)` reads each row's largest ``|value|``
  from the stored bytes, exactly, without dequantizing; `elements_at_least(w, t, limit, rows, blocks)`
  finds the elements whose |value| is at least `t` (per row, or per byte block) the same way, reading
  only `rows` when given (None past `limit` of them), and with `stored_blocks(w)`, each block's
  largest stored magnitude, only the blocks that can hold one. A row's `byte_blocks(in)` blocks are
  strided: block b holds columns b, b + n, b + 2n, ... (at most BYTE_BLOCK of them; `block_of(in)`
  maps each column to its block, `blocks_max(v)` takes a per-column vector's maxima per block); `dequantized_at(w, rows,
  cols)` reads them; `linear_scale(w, value_table(w))`, where the layout's values are each code times
  its scale in fp32, lets `dequantized_rows` read rows as that multiply, bit for bit.
- `row_local(w)`: the row-wise layouts with no scale spanning the tensor (mxfp8, the 4-bit ones):
  rows re-quantized alone are the whole merge's rows.
- `swizzled(w)`: block scales stored in the cuBLAS block-scaling layout (mxfp8, nvfp4):
  `dequantized_rows(w, rows)` reads any rows as a weight of their own (their scales laid out
  again), bit for bit the rows of the whole dequantization; `row_bound(w)` (nvfp4) bounds each
  row's largest |value| from its scales alone, `block_bound(w, rows)` each 16-element block's, and
  `dequantized_blocks(w, rows, blocks)` reads single blocks, bit for bit.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from . import fp8_rounding
from .base_weight import dequantized, quant_layout

_FP8_LAYOUTS = fp8_rounding.FP8_LAYOUTS
ROW_WISE_LAYOUTS = frozenset(_FP8_LAYOUTS + (
    "TensorWiseINT8Layout", "TensorCoreMXFP8Layout", "TensorCoreNVFP4Layout",
    "TensorCoreConvRotW4A4Layout", "AsymW4A8Int8Layout"))
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# layouts whose scales belong to blocks of one row and none spans the tensor (re-quantizing rows
# alone gives the whole merge's rows)
_ROW_LOCAL = frozenset({"TensorCoreMXFP8Layout", "TensorCoreConvRotW4A4Layout", "AsymW4A8Int8Layout"})


def row_local(w) -> bool:
    """Does re-quantizing `w` treat each row on its own, with no scale spanning the tensor? (2-D only)"""
    return quant_layout(w) in _ROW_LOCAL and len(w.shape) == 2


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


# layouts whose block scales are stored in the cuBLAS block-scaling layout: (the scale field, the
# rows the data is padded to a multiple of)
_SWIZZLED = {"TensorCoreMXFP8Layout": ("scale", 32), "TensorCoreNVFP4Layout": ("block_scale", 16)}
_FP4_MAX = 6.0  # the largest |value| of an e2m1 element


def swizzled(w) -> bool:
    """Are `w`'s block scales stored in the cuBLAS block-scaling layout (rows readable alone)?"""
    layout = quant_layout(w)
    return layout in _SWIZZLED and len(w.shape) == 2 and not getattr(w._params, "transposed", False)


def _tiled_index(rows: torch.Tensor, cols: int) -> torch.Tensor:
    """[len(rows), cols]: where entries (rows, 0..cols-1) of a scale matrix `cols` wide (a multiple
    of 4) lie in the cuBLAS block-scaling layout: 128 x 4 tiles of 512 entries in row-major tile
    order, entry (r, c) of a tile at (r % 32) * 16 + (r // 32) * 4 + c."""
    r, c = rows.reshape(-1, 1).long(), torch.arange(cols, device=rows.device).reshape(1, -1)
    return ((r // 128) * (cols // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def _scale_rows(w, rows: torch.Tensor) -> torch.Tensor:
    """The block scales of `rows` of a `swizzled` weight, one row each (uint8 view) [m, cols]."""
    field, _ = _SWIZZLED[quant_layout(w)]
    scale = getattr(w._params, field)
    flat = scale.reshape(-1).view(torch.uint8)
    return flat[_tiled_index(rows.to(flat.device), scale.shape[-1])]


@torch.no_grad()
def dequantized_rows(w, rows: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 values of `rows` of an `elementwise` or `swizzled` weight (equal to ``dequantized(w)[rows]``):
    a `swizzled` one is read as a weight of those rows alone, their scales laid out again; with an
    `elementwise` weight's `linear_scale`, as one fp32 multiply of the stored codes."""
    if scale is not None:
        return w._qdata.index_select(0, rows.to(w._qdata.device).long()).float().mul_(scale)
    if not swizzled(w):
        return _dequantized_data(w, w._qdata[rows])
    field, pad = _SWIZZLED[quant_layout(w)]
    scale = getattr(w._params, field)
    m, cols = rows.numel(), scale.shape[-1]
    own = torch.zeros((m + 127) // 128 * 128 * cols, dtype=torch.uint8, device=scale.device)
    own[_tiled_index(torch.arange(m, device=scale.device), cols)] = _scale_rows(w, rows)
    q = w._qdata[rows.to(w._qdata.device)]
    q = torch.cat([q, q.new_zeros((-m % pad,) + tuple(q.shape[1:]))])
    params = dataclasses.replace(w._params, **{field: own.reshape(-1, cols).view(scale.dtype)},
                                 orig_shape=(m, w.shape[1]), orig_dtype=torch.float32)
    return dequantized(w._copy_with(qdata=q, params=params))


@torch.no_grad()
def row_bound(w) -> torch.Tensor:
    """fp32 [out]: a bound of each row's largest |value| of an nvfp4 weight from its scales only:
    the largest element value times the per-tensor scale times the row's largest block scale (the
    product rounded as the dequantization rounds its decode scale: never below a value)."""
    bs = _scale_rows(w, torch.arange(w.shape[0], device=w._qdata.device))
    field, _ = _SWIZZLED[quant_layout(w)]
    top = bs.amax(dim=1).view(getattr(w._params, field).dtype).to(torch.float32)
    return (w._params.scale.to(torch.float32) * top * _FP4_MAX).cpu()


def reads_blocks(w) -> bool:
    """Can `w`'s 16-element blocks be bounded and read alone (`block_bound`, `dequantized_blocks`: nvfp4)?"""
    return quant_layout(w) == "TensorCoreNVFP4Layout" and swizzled(w)


NVFP4_BLOCK = 16


@torch.no_grad()
def block_bound(w, rows: torch.Tensor) -> torch.Tensor:
    """fp32 [len(rows), in / 16]: a bound of each 16-element block's largest |value| in `rows` of an
    nvfp4 weight, from its scales only (as `row_bound`, block by block)."""
    field, _ = _SWIZZLED[quant_layout(w)]
    bs = _scale_rows(w, rows.to(w._qdata.device))[:, : w.shape[1] // NVFP4_BLOCK]
    top = bs.contiguous().view(getattr(w._params, field).dtype).to(torch.float32)
    return (w._params.scale.to(torch.float32) * top * _FP4_MAX).cpu()


@torch.no_grad()
def dequantized_blocks(w, rows: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """fp32 [m, 16]: the values of blocks `blocks` [m] (block index within the row) of rows `rows` [m]
    of an nvfp4 weight, bit for bit the whole dequantization's: each block read as one row of a
    weight of its own, 64 wide (its block, then three empty ones: a block-scale row is 4 wide)."""
    field, _ = _SWIZZLED[quant_layout(w)]
    scale, dev = getattr(w._params, field), w._qdata.device
    rows, blocks, m = rows.to(dev).long(), blocks.to(dev).long(), rows.numel()
    flat = scale.reshape(-1).view(torch.uint8)
    cols = scale.shape[-1]
    at = ((rows // 128) * (cols // 4) + blocks // 4) * 512 + (rows % 32) * 16 + ((rows % 128) // 32) * 4 + blocks % 4
    own = torch.zeros((m + 127) // 128 * 128 * 4, dtype=torch.uint8, device=dev)
    own[_tiled_index(torch.arange(m, device=dev), 4)[:, 0]] = flat[at]
    half = NVFP4_BLOCK // 2  # two e2m1 values per stored byte
    q = torch.zeros(((m + 15) // 16 * 16, 2 * NVFP4_BLOCK), dtype=w._qdata.dtype, device=dev)
    q[:m, :half] = w._qdata[rows[:, None], blocks[:, None] * half + torch.arange(half, device=dev)]
    params = dataclasses.replace(w._params, **{field: own.reshape(-1, 4).view(scale.dtype)},
                                 orig_shape=(m, 4 * NVFP4_BLOCK), orig_dtype=torch.float32)
    return dequantized(w._copy_with(qdata=q, params=params))[:, :NVFP4_BLOCK]


# the byte screen's block: the largest magnitude byte of each block of at most BYTE_BLOCK columns of a
# row is kept, so a screen compares 1/BYTE_BLOCK of the bytes and reads only the blocks that can hold a
# hit. A block's columns are strided (b, b + n, ...): its maxima are elementwise maxima of contiguous
# runs of columns, which vectorize, where a maximum over a short run of adjacent bytes does not
BYTE_BLOCK = 64
# ... while at most 1/BLOCK_READ_SHARE of the blocks reach it; past that, reading the rows whole in
# place costs less than gathering blocks
BLOCK_READ_SHARE = 4
# a hit mask is read eight bytes at a time while at most 1/SPARSE_WORDS of its words hold a hit (the
# measured crossover: a fifth)
SPARSE_WORDS = 5


def _magnitudes(q: torch.Tensor) -> torch.Tensor:
    """uint8 bytes of stored data `q` (fp8 or int8) that order like its |values| (int8: |-128| is 128):
    a copy."""
    if q.dtype in _FP8_DTYPES:
        return q.view(torch.uint8) & 0x7F
    return q.abs().view(torch.uint8)


def byte_blocks(cols: int) -> int:
    """The byte blocks of a row of `cols` columns: block b holds columns b, b + n, b + 2n, ... (n blocks)."""
    return -(-cols // BYTE_BLOCK)


def block_of(cols: int) -> torch.Tensor:
    """int64 [cols]: each column's byte block."""
    return torch.arange(cols) % byte_blocks(cols)


def blocks_max(v: torch.Tensor) -> torch.Tensor:
    """[byte_blocks(len(v))]: each byte block's largest entry of a non-negative per-column vector `v`."""
    cols = v.numel()
    n = byte_blocks(cols)
    padded = v.new_zeros(-(-cols // n) * n)
    padded[:cols] = v
    return padded.reshape(-1, n).amax(dim=0)


@torch.no_grad()
def stored_blocks(w) -> torch.Tensor:
    """uint8 [out, byte_blocks(in)]: each byte block's largest magnitude byte of an `elementwise`
    weight (the index `elements_at_least` and `stored_row_absmax` read instead of every byte)."""
    mag = _magnitudes(w._qdata)
    n, cols = mag.shape
    nb = byte_blocks(cols)
    runs = mag[:, : cols // nb * nb].unflatten(1, (cols // nb, nb))  # [out, runs, block]
    while runs.shape[1] > 1:  # halves of the runs folded together in place (`mag` is a copy), an odd last into the first
        half = runs.shape[1] // 2
        if runs.shape[1] % 2:
            torch.maximum(runs[:, 0], runs[:, -1], out=runs[:, 0])
        torch.maximum(runs[:, :half], runs[:, half:2 * half], out=runs[:, :half])
        runs = runs[:, :half]
    out = runs[:, 0].contiguous()
    rest = cols - cols // nb * nb  # the first `rest` blocks hold one more column
    if rest:
        torch.maximum(out[:, :rest], mag[:, cols - rest:], out=out[:, :rest])
    return out


@torch.no_grad()
def stored_row_absmax(w, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [out]: each row's largest |value| of an `elementwise` weight, read from its stored bytes
    (or from its `stored_blocks`)."""
    top = (_magnitudes(w._qdata) if blocks is None else blocks).amax(dim=1)
    if w._qdata.dtype not in _FP8_DTYPES:  # int8: |-128| does not fit int8, so the row's top is scaled here
        return top.to(torch.float32) * w._params.scale.to(torch.float32)
    return _dequantized_data(w, top.view(w._qdata.dtype).reshape(-1, 1)).reshape(-1)


def _least_bytes(w, t: torch.Tensor) -> torch.Tensor:
    """uint8: per threshold in `t`, the smallest magnitude byte whose |value| reaches it (above every
    byte where none does: fp8 128, int8 129)."""
    q, scale = w._qdata, float(w._params.scale)
    if q.dtype in _FP8_DTYPES:
        table = torch.arange(128, dtype=torch.uint8).view(q.dtype).to(torch.float32) * scale
        table = torch.where(torch.isfinite(table), table, torch.inf).to(t.device)
        return torch.searchsorted(table, t).to(torch.uint8)
    # |stored| at least t / scale, from just below the exact ceiling: never miss an element
    return torch.clamp(torch.ceil(t / scale * (1 - 1e-6)), min=1).clamp(max=129).to(torch.uint8)


@torch.no_grad()
def elements_at_least(w, t, limit: int, rows: torch.Tensor | None = None,
                      blocks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, cols) in row-major order of the elements of an `elementwise` weight whose |value| is at
    least `t` (a float, one per row of `rows`, or one per row and byte block), among
    `rows` (default: every row; only those are read); None when they are more than `limit` (where
    per-block thresholds are read row by row: when the rows' lowest find more). With the weight's
    `stored_blocks`, only the blocks whose largest byte reaches `t` are read, while they are few."""
    q = w._qdata
    t = torch.as_tensor(t, dtype=torch.float32).cpu()
    t = t.reshape(-1, t.shape[-1] if t.dim() == 2 else 1)
    if blocks is not None:
        sub = blocks if rows is None else blocks[rows.to(q.device)]
        k = _least_bytes(w, t).to(q.device)
        hit = sub >= k
        if BLOCK_READ_SHARE * int(torch.count_nonzero(hit)) <= hit.numel():  # few blocks: read only those
            r, c = _block_hits(q, hit, k.expand(hit.shape), rows)
            return None if r.numel() > limit else (r, c)
    per_block = t if t.shape[1] > 1 else None
    t = t.amin(dim=1, keepdim=True)  # rows read at their lowest threshold, blocks held to theirs after
    sub = q
    if rows is not None and 2 * rows.numel() >= q.shape[0]:  # most rows: read them in place, the rest at inf
        every = torch.full((q.shape[0], 1), torch.inf)
        every[rows.cpu()] = t
        t = every
    elif rows is not None:
        sub = q[rows.to(q.device)]
    mag = _magnitudes(sub)
    # one threshold byte per element: a same-shape uint8 compare is vectorized, a broadcast one is not
    hit = mag >= _least_bytes(w, t).to(q.device).expand(mag.shape).contiguous()
    found = _sparse_nonzero(hit, limit)
    if found is None:
        return None
    r, cols = (x.cpu() for x in found)
    if sub is not q:
        r = rows.cpu()[r]
    if per_block is not None:
        place = r
        if rows is not None:  # each weight row's place in `rows`
            inverse = torch.zeros(q.shape[0], dtype=torch.long)
            inverse[rows.cpu()] = torch.arange(rows.numel())
            place = inverse[r]
        mag = _magnitudes(q[r.to(q.device), cols.to(q.device)]).cpu()
        keep = mag >= _least_bytes(w, per_block[place, cols % byte_blocks(q.shape[1])])
        r, cols = r[keep], cols[keep]
    return r, cols


def _sparse_nonzero(mask: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, cols) of a 2-D bool `mask`'s True elements in row-major order, None past `limit` of them:
    its bytes read eight at a time as int64 words, then only the nonzero words byte by byte."""
    flat = mask.reshape(-1)
    whole = flat.numel() // 8 * 8
    words = flat[:whole].view(torch.int64)
    held = int(torch.count_nonzero(words))
    if held > limit:  # each nonzero word holds at least one
        return None
    if SPARSE_WORDS * held > words.numel():  # most words hold one: element by element
        if int(torch.count_nonzero(mask)) > limit:
            return None
        return torch.nonzero(mask, as_tuple=True)
    at = torch.nonzero(words).reshape(-1)
    h, j = torch.nonzero(flat[:whole].view(-1, 8)[at], as_tuple=True)
    idx = torch.cat([at[h] * 8 + j, torch.nonzero(flat[whole:]).reshape(-1) + whole])
    if idx.numel() > limit:
        return None
    return idx // mask.shape[1], idx % mask.shape[1]


def _block_hits(q: torch.Tensor, hit: torch.Tensor, k: torch.Tensor, rows: torch.Tensor | None):
    """(rows, cols) in row-major order of the elements reaching their block's byte `k` inside the byte
    blocks `hit` marks."""
    i, blk = torch.nonzero(hit, as_tuple=True)
    r = i if rows is None else rows.to(q.device)[i]
    n, cols = q.shape
    nb = byte_blocks(cols)
    if cols % nb == 0:  # every block holds cols / nb columns: read through a [out, runs, block] view
        mag, inside = _magnitudes(q.view(n, cols // nb, nb)[r, :, blk]), None
    else:  # the last columns of some blocks lie past the end: read clamped and masked out
        at = blk[:, None] + nb * torch.arange(-(-cols // nb), device=q.device)
        mag, inside = _magnitudes(q[r[:, None], at.clamp(max=cols - 1)]), at < cols
    reach = mag >= k[i, blk][:, None].expand(mag.shape).contiguous()
    h, j = torch.nonzero(reach if inside is None else reach & inside, as_tuple=True)
    r, c = r[h].cpu(), (blk[h] + nb * j).cpu()
    order = torch.argsort(r * cols + c)
    return r[order], c[order]


@torch.no_grad()
def value_table(w) -> torch.Tensor:
    """fp32 [256]: an `elementwise` weight's value for each stored byte, by its own dequantization
    (one scale for the tensor: an element's value is its byte's)."""
    every = torch.arange(256, dtype=torch.int32, device=w._qdata.device).to(torch.uint8)
    return _dequantized_data(w, every.view(w._qdata.dtype).reshape(1, -1)).reshape(-1)


@torch.no_grad()
def linear_scale(w, table: torch.Tensor) -> torch.Tensor | None:
    """fp32 0-dim: the scale of an `elementwise` weight whose `value_table` is each stored code in fp32
    times that scale, bit for bit (every code checked; NaN where the code is NaN), else None."""
    scale = getattr(w._params, "scale", None)
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        return None
    scale = scale.reshape(()).to(device=table.device, dtype=torch.float32)
    codes = torch.arange(256, dtype=torch.int32, device=table.device).to(torch.uint8)
    mine = codes.view(w._qdata.dtype).float() * scale
    same = (mine == table) | (mine.isnan() & table.isnan())
    return scale if bool(same.all()) else None


@torch.no_grad()
def dequantized_at(w, rows: torch.Tensor, cols: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [m]: the values of an `elementwise` weight at (rows, cols); with its `value_table`, looked
    up there (the same values, without a dequantization call per read)."""
    q = w._qdata[rows.to(w._qdata.device), cols.to(w._qdata.device)]
    if table is not None:
        return table[q.view(torch.uint8).long()]
    return _dequantized_data(w, q.reshape(1, -1)).reshape(-1)


def expected_rounding(w, seed: int):
    """The exact expected-error model of a merge into `w` with `seed` (see the module's contract), or None."""
    if not seed or not elementwise(w):
        return None
    table = fp8_rounding.model_for(w, seed)
    if table is not None:
        return functools.partial(fp8_rounding.expected_round_rows, w, table)
    if quant_layout(w) != "TensorWiseINT8Layout":
        return None
    layout = w._layout_cls
    if isinstance(layout, str):
        try:
            from comfy_kitchen.tensor import get_layout_class
            layout = get_layout_class(layout)
        except (ImportError, KeyError):
            return None
    quantize = getattr(layout, "quantize", None)
    ours = getattr(getattr(quantize, "__func__", quantize), "__module__", "") == "comfy_kitchen.tensor.int8"
    return expected_round_rows if ours else None


INT8_MAX = 127.0  # the per-tensor int8 layout's scale: the largest |value| / 127, at least 1e-30


@torch.no_grad()
def expected_round_rows(exact: torch.Tensor, amax: torch.Tensor, measured=slice(None)) -> tuple[torch.Tensor, float]:
    """(fp32 rows `exact` rounded to nearest on the per-tensor int8 grid of a whole merge whose largest
    |value| is `amax`; the expected sum of squared errors of that layout's stochastic rounding over
    rows `measured`, each element's s^2 f (1 - f))."""
    low, high = torch.aminmax(exact)
    scale = (torch.maximum(amax.to(exact.device, torch.float32), torch.maximum(high, -low)) / INT8_MAX).clamp(min=1e-30)
    v = (exact / scale).clamp_(-128.0, 127.0)
    rounded = torch.round(v)
    # f (1 - f) with f = v - floor(v) is g (1 - g) with g = |v - round(v)|: sum g - sum g^2
    g = v[measured].sub_(rounded[measured]).abs_().reshape(-1)
    return rounded.mul_(scale), (float(g.sum()) - float(torch.dot(g, g))) * float(scale) ** 2


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
