"""Row samples of the weights `auto` measures, advanced merge by merge in merge order.

Contract
- `SequentialEstimate(wrappers).share(name)`: (the share of adapter `name`'s update a merge would
  round away, ``sqrt(sum err^2 / sum |dW|^2)`` over its layers' sampled rows; the state after that
  merge), writing nothing; `advance(after)` takes the state when the adapter merges, so later adapters
  are measured against the weight it leaves. A merge that would take a weight past its dtype's range
  raises NonFiniteMergeError naming the adapter and the layer.
- Each layer's sums are its sample's times its rows per sampled row, so layers sampled at different
  rates weigh as their whole weights do.
- A float weight: an even sample of whole rows (at most SAMPLE_ELEMENTS elements), rounded to its dtype.
- A quantized weight of a row-wise layout (`quantized_rows.row_wise`): the same even sample,
  re-quantized at the scale the whole merge recalculates from the merged tensor's largest |value|.
  That value is found exactly without merging the whole: the sample, the rows with the largest stored
  values, and every element (per-tensor layouts, low-rank updates) or row elsewhere that a bound of
  the update (and of the earlier merges' moves) lets reach it. Past SAMPLE_ELEMENTS such elements, or
  a quarter of the rows, every row is held. With stochastic rounding the sample is one draw of the
  merge's rounding, not the whole merge's own draw.
- Any other quantized weight: every row, re-quantized whole (`LoraLinear.grid_round`).
"""
from __future__ import annotations

import math

import torch

from ..errors import NonFiniteMergeError
from ..layer import quantized_rows as qrows

MAX_SAMPLE_ROWS = 1024
# the auto measurement samples at most this many elements of each weight (whole rows, evenly
# spaced, at least MIN_SAMPLE_ROWS): i.i.d. rounding errors give a statistical error of about
# 1/sqrt(2 * 2**18) = 0.14 % per layer, and the measurement costs a small share of a merge
SAMPLE_ELEMENTS = 1 << 18
MIN_SAMPLE_ROWS = 16
# a quantized weight's sample grows by the rows that may hold its largest value; past this share of
# its rows, every row is held (the sample would cost about as much as the whole)
MAX_CANDIDATE_SHARE = 0.25
TOP_ROWS = 4


def sample_rows(rows: int, device, max_rows: int, cols: int | None = None):
    """An even sample of whole rows: a slice of all when they fit, else sorted row indices."""
    if cols is not None:
        max_rows = min(max_rows, max(MIN_SAMPLE_ROWS, SAMPLE_ELEMENTS // max(1, cols)))
    if rows <= max_rows:
        return slice(0, rows)
    return torch.linspace(0, rows - 1, max_rows, device=device).round().long().unique()


def _finite_check(e: float, rounded, cur, exact, name: str, layer: str, dtype) -> None:
    """`e` (the summed squared error) is not finite: raise when the merge itself overflows."""
    if math.isfinite(e):
        return
    bad = ~torch.isfinite(rounded) & torch.isfinite(cur)
    if bad.any():
        raise NonFiniteMergeError(
            f"adapter {name}: on layer {layer} its update takes the {dtype or 'quantized'} weight past "
            f"the largest {dtype or 'representable'} value (e.g. {float(exact[bad][0]):.4g}); merged or "
            "not, this gives inf/NaN. Lower its strength, or load the model in bf16/fp32")


def _sq(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t)) ** 2  # one fused fp32 reduction, no float64 copy


class _Rows:
    """A float weight's sampled rows (or a quantized weight's, every row, re-quantized whole)."""

    def __init__(self, w, max_rows: int):
        weight = w.weight2d.detach()
        self.w = w
        self.sel = slice(None) if w.quantized else sample_rows(weight.shape[0], weight.device, max_rows,
                                                               weight.shape[1])
        self.cur = weight[self.sel].float()
        self.dtype = None if w.quantized else weight.dtype
        self.weight = weight.shape[0] / self.cur.shape[0]  # rows per sampled row

    def measure(self, s, name: str):
        d = self.w.delta_rows(self.sel, [s])
        exact = self.cur + d
        rounded = self.w.grid_round(exact) if self.dtype is None else exact.to(self.dtype).float()
        e = _sq(rounded - exact)
        _finite_check(e, rounded, self.cur, exact, name, self.w.layer_name, self.dtype)
        return e * self.weight, _sq(d) * self.weight, rounded

    def advance(self, rounded) -> None:
        self.cur = rounded


class _QuantRows:
    """A row-wise quantized weight's sample (see module doc)."""

    def __init__(self, w, max_rows: int):
        self.w, self.q, self.seed = w, w.get_base_layer().weight, w.requant_seed
        n, cols = self.q.shape
        even = sample_rows(n, torch.device("cpu"), max_rows, cols)
        even = torch.arange(n) if isinstance(even, slice) else even.cpu()
        if qrows.elementwise(self.q):
            self._full, self.row_max = None, qrows.stored_row_absmax(self.q).cpu()
        else:  # the layout's own dequantization, once
            self._full = w.weight2d.detach()
            self.row_max = self._full.abs().amax(dim=1).cpu()
        # the rows with the largest stored values come along unmeasured: their merged values give a
        # close floor for the merged tensor's largest |value|, which keeps the rows to add few
        top = torch.topk(self.row_max, min(TOP_ROWS, n)).indices
        top = top[~torch.isin(top, even)]
        self.sel, self.measured = torch.cat([even, top]), slice(0, even.numel())  # measured: the even rows
        self.cur = self._base(self.sel)
        self.moved = torch.zeros(n)   # per row: a bound of how far the merges so far moved its values
        self.history: list = []       # (slot, largest |value|) of each merge so far

    def _base(self, rows: torch.Tensor) -> torch.Tensor:
        dev = self.q.device
        if self._full is not None:
            return self._full[rows.to(dev)].float()
        return qrows.dequantized_rows(self.q, rows.to(dev))

    def _bound(self, s) -> torch.Tensor | None:
        """fp32 [out]: a bound of each row's largest |value| of slot `s`'s update (the lower of the
        triangle and Cauchy-Schwarz bounds of a low-rank product); None for other updates."""
        st = s.update.stack()
        if st is None:
            return None
        down, up, scale = (t.float() if isinstance(t, torch.Tensor) else t for t in s.update.stack())
        tri = up.abs() @ down.abs().amax(dim=1)
        cs = torch.linalg.vector_norm(up, dim=1) * torch.linalg.vector_norm(down, dim=0).max()
        return (torch.minimum(tri, cs) * abs(s.strength * scale) * 1.01).cpu()  # margin: fp32 roundings

    def _add(self, rows: torch.Tensor) -> None:
        """Hold `rows` too (unmeasured): their base values with the merges so far replayed."""
        cur = self._base(rows)
        dev = self.q.device
        for s, amax in self.history:  # at each merge's own scale
            cur = qrows.grid_round_rows(self.q, cur + self.w.delta_rows(rows.to(dev), [s]), amax, self.seed)
        self.sel, self.cur = torch.cat([self.sel, rows]), torch.cat([self.cur, cur])

    def _reach(self, s, b: torch.Tensor | None, low: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows not held that may reach a |value| of `low` after slot `s`'s update, their update)."""
        n = self.row_max.numel()
        if b is None or self.moved is None:
            return torch.arange(n)[~torch.isin(torch.arange(n), self.sel)], None
        need = torch.nonzero(self.row_max + self.moved + b >= low).reshape(-1)
        need = need[~torch.isin(need, self.sel)]
        if need.numel() == 0 or self.sel.numel() + need.numel() > MAX_CANDIDATE_SHARE * n:
            return need, None  # none, or so many that every row is held
        d = self.w.delta_rows(need.to(self.q.device), [s])  # their update, exactly: a much closer bound
        top = d.abs().amax(dim=1).cpu()
        b[need] = top
        keep = self.row_max[need] + self.moved[need] + top >= low
        return need[keep], d[keep.to(d.device)]

    def _element_top(self, s, b: torch.Tensor, low: float) -> float | None:
        """The largest |value| after slot `s`'s update among the elements of the rows not held that
        may reach `low` (`low` when none can), from those elements alone (per-tensor layouts, whose
        elements re-quantize on their own given the scale; low-rank updates); None when they are
        more than SAMPLE_ELEMENTS."""
        room = self.moved + b
        held = torch.zeros(self.row_max.numel(), dtype=torch.bool)
        held[self.sel] = True
        room[held] = -torch.inf
        if not bool((self.row_max + room >= low).any()):
            return low
        found = qrows.elements_at_least(self.q, low - float(room.max()), SAMPLE_ELEMENTS)
        if found is None:  # as dear as a row sample: the caller takes rows
            return None
        rows, cols = found
        keep = ~held[rows]
        rows, cols = rows[keep], cols[keep]
        if rows.numel() == 0:
            return low
        cur = qrows.dequantized_at(self.q, rows, cols)
        for past, amax in self.history:  # the merges so far, element by element
            cur = qrows.grid_round_rows(self.q, (cur + _low_rank_at(past, rows, cols))[None], amax, self.seed)[0]
        return max(low, float((cur + _low_rank_at(s, rows, cols)).abs().amax()))

    def measure(self, s, name: str):
        b = self._bound(s)
        d = self.w.delta_rows(self.sel.to(self.q.device), [s])
        # the largest |value| the held rows reach is a floor for the whole tensor's
        low = float((self.cur + d).abs().amax())
        if self._full is None and b is not None and self.moved is not None and all(
                p.update.stack() is not None for p, _ in self.history):
            top = self._element_top(s, b, low)
            if top is not None:
                exact = self.cur + d
                rounded = qrows.grid_round_rows(self.q, exact, torch.tensor(top), self.seed)
                return self._sums(exact, rounded, d, name) + ((rounded, top, s, b),)
        new, d_new = self._reach(s, b, low)
        if new.numel():
            if self.sel.numel() + new.numel() > MAX_CANDIDATE_SHARE * self.row_max.numel():
                new = torch.arange(self.row_max.numel())[~torch.isin(torch.arange(self.row_max.numel()), self.sel)]
                self.measured, d_new = slice(None), None  # as dear as the whole: hold every row
            self._add(new)
            d = torch.cat([d, d_new if d_new is not None else self.w.delta_rows(new.to(self.q.device), [s])])
        exact = self.cur + d
        amax = exact.abs().amax()
        rounded = qrows.grid_round_rows(self.q, exact, amax, self.seed)
        return self._sums(exact, rounded, d, name) + ((rounded, amax, s, b),)

    def _sums(self, exact, rounded, d, name: str) -> tuple[float, float]:
        m = self.measured
        e = _sq(rounded[m] - exact[m])
        _finite_check(e, rounded, self.cur, exact, name, self.w.layer_name, None)
        k = self.row_max.numel() / exact[m].shape[0]  # rows per measured row
        return e * k, _sq(d[m]) * k

    def advance(self, after) -> None:
        rounded, amax, s, b = after
        self.cur = rounded
        self.history.append((s, amax))
        step = qrows.top_step(self.q, float(amax))
        self.moved = None if b is None or step is None or self.moved is None else self.moved + b + step


def _low_rank_at(s, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """fp32 [m]: slot `s`'s low-rank update at the elements (rows, cols), times its strength."""
    down, up, scale = s.update.stack()
    dev = up.device
    rows, cols = rows.to(dev), cols.to(dev)
    return (up[rows].float() * down[:, cols].float().T).sum(dim=1) * float(scale) * s.strength


class SequentialEstimate:
    """Row samples of every weight, advanced by each adapter that merges, in merge order."""

    def __init__(self, wrappers: list, max_rows: int = MAX_SAMPLE_ROWS):
        self.rows = {w.layer_name: (_QuantRows(w, max_rows) if w.quantized and qrows.row_wise(w.get_base_layer().weight)
                                    else _Rows(w, max_rows)) for w in wrappers}

    @torch.no_grad()
    def share(self, name: str) -> tuple[float, dict]:
        """(share of adapter `name`'s update a merge would round away, the merged rows if it merges)."""
        err = ref = 0.0
        after = {}
        for layer, rows in self.rows.items():
            s = rows.w.slots.get(name)
            if s is None or not s.contributes or not s.has_weight_delta:
                continue
            e, r, after[layer] = rows.measure(s, name)
            err += e
            ref += r
        return (math.sqrt(err / ref) if ref > 0 else 0.0), after

    def advance(self, after: dict) -> None:
        for layer, state in after.items():
            self.rows[layer].advance(state)
