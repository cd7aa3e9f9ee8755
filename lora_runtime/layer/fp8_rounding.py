"""The exact distribution of the host's stochastic fp8 rounding, for measuring it without a draw.

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
  seeded draw) equals, bit for bit, the outcome the table predicts for that draw; None otherwise (an
  unknown host rounding is never modelled: it is drawn). Checked once per layout class, dtype, device.
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

log = logging.getLogger(__name__)

PATTERNS = 1 << 16  # every float16 bit pattern
PROBE_SEED = 7919


@dataclasses.dataclass(frozen=True)
class RoundingTable:
    """Per float16 pattern (the scaled value's bits): both outcomes (fp8 values in fp32) and the
    probability of the high one."""
    dtype: torch.dtype
    low: torch.Tensor
    high: torch.Tensor
    p_high: torch.Tensor
    k_min: torch.Tensor  # int32: the first byte that draws `high`

    def index(self, scaled: torch.Tensor) -> torch.Tensor:
        """The table rows of fp32 values `scaled` (their float16 bits)."""
        return scaled.half().view(torch.int16).to(torch.int32).bitwise_and_(PATTERNS - 1)

    def draw(self, scaled: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The outcome (fp8 values in fp32) for draws `k` (uint8): the host's, bit for bit."""
        i = self.index(scaled)
        return torch.where(k.to(torch.int32) >= self.k_min[i], self.high[i], self.low[i])


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

    def at(k: torch.Tensor) -> torch.Tensor:
        return rounding(h, k.to(torch.uint8), dtype).float()

    low = at(torch.zeros(PATTERNS, dtype=torch.int32, device=device))
    high = at(torch.full((PATTERNS,), 255, dtype=torch.int32, device=device))
    lo = torch.zeros(PATTERNS, dtype=torch.int32, device=device)
    hi = torch.full((PATTERNS,), 255, dtype=torch.int32, device=device)
    moves = (high != low) & ~high.isnan()  # NaN: float16 past e5m2's range, no merge's scaled value
    while bool((lo < hi).any()):  # the first k that draws `high` (outcomes grow with k)
        mid = (lo + hi) // 2
        up = at(mid) == high
        hi = torch.where(up, mid, hi)
        lo = torch.where(up, lo, mid + 1)
    k_min = torch.where(moves, lo, torch.zeros_like(lo))
    p_high = torch.where(moves, (256 - k_min).float() / 256.0, torch.zeros_like(low))
    table = RoundingTable(dtype, low, high, p_high, k_min)
    _TABLES[key] = table
    return table


def _scale(top: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The per-tensor fp8 layouts' recalculated scale for a largest |value| `top` (fp32)."""
    return top.to(torch.float32) / torch.finfo(dtype).max


@torch.no_grad()
def model_for(w, seed: int) -> RoundingTable | None:
    """The rounding table, where `w`'s own layout rounds a probe exactly as it predicts (else None)."""
    if not seed:
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
    except (TypeError, ValueError, RuntimeError, NotImplementedError) as exc:
        log.debug("fp8 rounding not modelled: the probe merge failed: %s", exc)
        return None
    scale = _scale(probe.abs().amax(), dtype)
    gen = torch.Generator(device=device)
    gen.manual_seed(PROBE_SEED)
    k = torch.randint(0, 256, probe.shape, dtype=torch.uint8, device=device, generator=gen)
    want = table.draw(probe * (1.0 / scale), k)
    scales = [t for t in vars(out._params).values() if isinstance(t, torch.Tensor)]
    same = (out._qdata.dtype == dtype and torch.equal(out._qdata.float(), want)
            and len(scales) == 1 and torch.equal(scales[0].float().reshape(()), scale))
    if not same:
        log.debug("fp8 rounding not modelled: %s's seeded rounding is not the kitchen's byte draw",
                  w._layout_cls)
    return table if same else None


@torch.no_grad()
def expected_round_rows(w, table: RoundingTable, exact: torch.Tensor, amax: torch.Tensor,
                        measured=slice(None)) -> tuple[torch.Tensor, float]:
    """(fp32 rows `exact` rounded to nearest on the fp8 grid of a whole merge whose largest |value| is
    `amax`; the expected sum of squared errors of the host's stochastic rounding over rows `measured`)."""
    from .quantized_rows import grid_round_rows
    top = torch.maximum(amax.to(exact.device, torch.float32), exact.abs().amax())
    scale = _scale(top, table.dtype)
    v = exact[measured]
    i = table.index(v * (1.0 / scale))
    low = table.low[i].mul_(scale).sub_(v)
    high = table.high[i].mul_(scale).sub_(v)
    low.square_()
    e = float(low.sum()) + float((high.square_().sub_(low)).mul_(table.p_high[i]).sum())
    return grid_round_rows(w, exact, top, 0), e
