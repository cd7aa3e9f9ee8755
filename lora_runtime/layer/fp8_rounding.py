"""The host's stochastic fp8 rounding, exactly: measured without a draw, merged without its float16 chain.

Contract
- The host merges into a per-tensor fp8 weight (ComfyUI's fp8 layouts) with a seed by scaling the fp32
  values by 1 / scale, drawing one uniform byte k per element from a generator seeded with the seed,
  and calling comfy-kitchen's ``stochastic_rounding_fp8(x, k, dtype)``, which reads x as float16 h.
  Each element's outcome then depends on (h, k) alone and grows with k: it is `low(h)` for
  k < `k_min(h)` and `high(h)` from there, so its probability of rounding up is (256 - k_min) / 256.
- `rounding_table(dtype, device)`: that (low, high, probability) for all 65536 float16 patterns, read
  from the kitchen's own function (its outcomes at k = 0 and 255, k_min by bisection: 10 calls on
  65536 values), built once per dtype and device.
- `model_for(w, seed)`: the table where a probe merge through `w`'s own layout (64 x 64 values, its own
  seeded draw) equals, bit for bit, the outcome the table predicts for that draw (and the layout's
  rounding to nearest, without a seed, is the plain fp8 cast of the scaled values); None otherwise (an
  unknown host rounding is never modelled: it is drawn). Checked once per layout class, dtype, device.
- `requantized(w, merged, seed)`: the merge's own re-quantization of fp32 `merged` into `w`'s layout with
  `seed` (the same draw, the same bytes, scale and params, bit for bit), its outcomes read from the
  table (half the time of the kitchen's float16 chain on the CPU); None where the layout is not modelled.
- `expected_round_rows(w, model, exact, amax, measured)`: the rows `exact` rounded to nearest on the
  whole merge's grid (the layout's own rounding without a seed, bit for bit) and the exact expected sum
  of squared errors of the stochastic rounding over rows `measured`: per element
  (1 - p) (low s - v)^2 + p (high s - v)^2.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from .base_weight import dequantized, quant_layout

log = logging.getLogger(__name__)

FP8_LAYOUTS = ("TensorCoreFP8Layout", "TensorCoreFP8E4M3Layout", "TensorCoreFP8E5M2Layout")  # per-tensor fp8
PATTERNS = 1 << 16  # every float16 bit pattern
PROBE_SEED = 7919


@dataclasses.dataclass(frozen=True)
class RoundingTable:
    """Per float16 pattern (the scaled value's bits): both outcomes (fp8 values in fp32, and their
    stored bytes) and the probability of the high one."""
    dtype: torch.dtype
    low: torch.Tensor
    high: torch.Tensor
    p_high: torch.Tensor
    k_min: torch.Tensor  # int16: the first byte that draws `high`
    low_byte: torch.Tensor
    high_byte: torch.Tensor

    def index(self, scaled: torch.Tensor) -> torch.Tensor:
        """The table rows of fp32 values `scaled` (their float16 bits, int32)."""
        return scaled.half().view(torch.int16).to(torch.int32).bitwise_and_(PATTERNS - 1)

    def at(self, column: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        """One of the table's columns at rows `i` (index_select: a fifth of advanced indexing's cost)."""
        return column.index_select(0, i.reshape(-1)).reshape(i.shape)

    def draw(self, scaled: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The outcome (fp8) for draws `k` (uint8): the host's, bit for bit."""
        i = self.index(scaled)
        up = k.to(torch.int16) >= self.at(self.k_min, i)
        return torch.where(up, self.at(self.high_byte, i), self.at(self.low_byte, i)).view(self.dtype)


_TABLES: dict = {}
_MODELS: dict = {}


def _kitchen_rounding():
    try:
        import comfy_kitchen as ck
        return ck.stochastic_rounding_fp8
    except (ImportError, AttributeError):
        return None


@torch.no_grad()
def rounding_table(dtype: torch.dtype, device: torch.device | str = "cpu") -> RoundingTable | None:
    """Both outcomes and the odds of the high one for every float16 pattern, from the kitchen's own
    `stochastic_rounding_fp8` (None without it)."""
    key = (dtype, str(device))
    if key in _TABLES:
        return _TABLES[key]
    rounding = _kitchen_rounding()
    if rounding is None:
        return None
    h = torch.from_numpy(np.arange(PATTERNS, dtype=np.uint16).view(np.float16).copy()).to(device)
    h = torch.where(h.isfinite(), h, torch.zeros_like(h))  # never indexed: scaled values are finite

    def bytes_at(k) -> torch.Tensor:  # the stored outcomes at draw(s) k
        k = torch.full((PATTERNS,), k, device=device) if isinstance(k, int) else k
        return rounding(h, k.to(torch.uint8), dtype).view(torch.uint8)

    low_byte, high_byte = bytes_at(0), bytes_at(255)
    low, high = (b.view(dtype).float() for b in (low_byte, high_byte))
    lo = torch.zeros(PATTERNS, dtype=torch.int32, device=device)
    hi = torch.full((PATTERNS,), 255, dtype=torch.int32, device=device)
    moves = (high != low) & ~high.isnan()  # NaN: float16 past e5m2's range, no merge's scaled value
    while bool((lo < hi).any()):  # the first k that draws `high` (outcomes grow with k)
        mid = (lo + hi) // 2
        up = bytes_at(mid) == high_byte
        hi = torch.where(up, mid, hi)
        lo = torch.where(up, lo, mid + 1)
    k_min = torch.where(moves, lo, torch.zeros_like(lo))
    p_high = torch.where(moves, (256 - k_min).float() / 256.0, torch.zeros_like(low))
    table = RoundingTable(dtype, low, high, p_high, k_min.to(torch.int16), low_byte, high_byte)
    _TABLES[key] = table
    return table


def _scale(top: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The per-tensor fp8 layouts' recalculated scale for a largest |value| `top` (fp32)."""
    return top.to(torch.float32) / torch.finfo(dtype).max


@torch.no_grad()
def model_for(w, seed: int) -> RoundingTable | None:
    """The rounding table, where `w` is a per-tensor fp8 layout that rounds a probe exactly as it
    predicts (else None)."""
    if not seed or quant_layout(w) not in FP8_LAYOUTS:
        return None
    dtype, device = w._qdata.dtype, w._qdata.device
    key = (w._layout_cls if isinstance(w._layout_cls, str) else id(w._layout_cls), dtype, str(device))
    if key not in _MODELS:
        _MODELS[key] = _checked(w, dtype, device)
    return _MODELS[key]


def _checked(w, dtype, device) -> RoundingTable | None:
    table = rounding_table(dtype, device)
    if table is None:
        return None
    g = torch.Generator(device="cpu").manual_seed(3)
    probe = (torch.randn(64, 64, generator=g) * 3.0).to(device)
    try:
        out = w.requantize_from_float(probe, scale="recalculate", stochastic_rounding=PROBE_SEED)
        mine = _drawn(w, table, probe, PROBE_SEED, out._params)
    except (TypeError, ValueError, RuntimeError, NotImplementedError, AttributeError) as exc:
        log.debug("fp8 rounding not modelled: the probe merge failed: %s", exc)
        return None
    if not _same(out, mine):
        log.debug("fp8 rounding not modelled: %s's seeded rounding is not the kitchen's byte draw",
                  w._layout_cls)
        return None
    scale = _scale(probe.abs().amax(), dtype)
    if not torch.equal(dequantized(w.requantize_from_float(probe, scale="recalculate")),
                       _nearest(probe * (1.0 / scale), scale, dtype)):
        log.debug("fp8 rounding not modelled: %s rounds to nearest otherwise", w._layout_cls)
        return None
    return table


def _nearest(scaled: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values: `scaled` (values times 1 / scale) rounded to nearest fp8 and dequantized, as the
    layout without a seed (the probe checks it)."""
    top = torch.finfo(dtype).max
    return scaled.clamp(-top, top).to(dtype).to(torch.float32).mul_(scale)


def _same(a, b) -> bool:
    """Are two QuantizedTensors the same bytes, layout and params (every field, tensors bit for bit)?"""
    if a._layout_cls != b._layout_cls or a._qdata.dtype != b._qdata.dtype:
        return False
    if not torch.equal(a._qdata.view(torch.uint8), b._qdata.view(torch.uint8)):
        return False
    for field in dataclasses.fields(a._params):
        x, y = getattr(a._params, field.name), getattr(b._params, field.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                    and x.shape == y.shape and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


CHUNK_ELEMENTS = 1 << 22


def _drawn(w, table: RoundingTable, merged: torch.Tensor, seed: int, like):
    """`merged` (fp32) rounded with the table and the host's draw for `seed`, as a QuantizedTensor of
    `w`'s layout with params like `like` (its scale and shape replaced)."""
    scale = _scale(merged.abs().amax(), table.dtype)
    inv = (1.0 / scale).to(merged.dtype)
    gen = torch.Generator(device=merged.device)
    gen.manual_seed(int(seed))
    k = torch.randint(0, 256, merged.shape, dtype=torch.uint8, device=merged.device, generator=gen)
    codes = torch.empty(merged.shape, dtype=table.dtype, device=merged.device)
    flat_v, flat_k, flat_c = merged.reshape(-1), k.reshape(-1), codes.reshape(-1)
    for i in range(0, flat_v.numel(), CHUNK_ELEMENTS):
        part = slice(i, i + CHUNK_ELEMENTS)
        flat_c[part] = table.draw(flat_v[part] * inv, flat_k[part])
    params = dataclasses.replace(like, scale=scale, orig_dtype=merged.dtype, orig_shape=tuple(merged.shape))
    return type(w)(codes, w._layout_cls, params)


@torch.no_grad()
def requantized(w, merged: torch.Tensor, seed: int):
    """The host's seeded re-quantization of fp32 `merged` into `w`'s layout, drawn through the table
    (None: not modelled; see the module's contract)."""
    table = model_for(w, seed) if merged.dtype == torch.float32 else None
    return None if table is None else _drawn(w, table, merged, seed, w._params)


@torch.no_grad()
def expected_round_rows(w, table: RoundingTable, exact: torch.Tensor, amax: torch.Tensor,
                        measured=slice(None)) -> tuple[torch.Tensor, float]:
    """(fp32 rows `exact` rounded to nearest on the fp8 grid of a whole merge whose largest |value| is
    `amax`; the expected sum of squared errors of the host's stochastic rounding over rows `measured`)."""
    top = torch.maximum(amax.to(exact.device, torch.float32), exact.abs().amax())
    scale = _scale(top, table.dtype)
    scaled = exact * (1.0 / scale)
    v = exact[measured]
    i = table.index(scaled[measured])
    low = table.at(table.low, i).mul_(scale).sub_(v)
    high = table.at(table.high, i).mul_(scale).sub_(v)
    low.square_()
    e = float(low.sum()) + float((high.square_().sub_(low)).mul_(table.at(table.p_high, i)).sum())
    return _nearest(scaled, scale, table.dtype), e
