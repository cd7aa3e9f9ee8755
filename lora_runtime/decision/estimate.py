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
- A quantized weight whose rows re-quantize alone (`quantized_rows.row_local`: mxfp8, the 4-bit
  row-wise layouts): the same even sample (read alone where the layout allows), re-quantized
  alone: bit for bit the whole merge's rows (round to nearest). No search.
- A quantized weight of another row-wise layout (`quantized_rows.row_wise`): the same even sample,
  re-quantized at the scale the whole merge recalculates from the merged tensor's largest |value|.
  That value is found exactly without merging the whole: the sample, the rows with the largest stored
  values, and every element (per-tensor layouts, low-rank updates) or row elsewhere that a bound of
  the update (and of the earlier merges' moves) lets reach it. Past SAMPLE_ELEMENTS such elements
  (an eighth of the weight, if more), or a quarter of the rows, every row is held. With stochastic
  rounding the sample is one draw of the merge's rounding, not the whole merge's own draw.
- Any other quantized weight: every row, re-quantized whole (`AdaptedLayer.grid_round`).
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
SEARCH_SHARE = 8
TOP_ROWS = 4
REFINE_ROWS = 256
# a grid step of at least this share of the top value (e5m2, mxfp8: 1/7) lets nearly any row reach the top
# after a merge: later adapters hold every row without searching
COARSE_STEP = 0.1


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

    def _round(self, exact: torch.Tensor) -> torch.Tensor:
        return self.w.grid_round(exact) if self.dtype is None else exact.to(self.dtype).float()

    def measure(self, s, name: str):
        d = self.w.delta_rows(self.sel, [s])
        exact = self.cur + d
        rounded = self._round(exact)
        e = _sq(rounded - exact)
        _finite_check(e, rounded, self.cur, exact, name, self.w.layer_name, self.dtype)
        return e * self.weight, _sq(d) * self.weight, rounded

    def advance(self, rounded) -> None:
        self.cur = rounded


class _LocalRows(_Rows):
    """A `row_local` quantized weight's sample: its rows re-quantize alone as in the whole merge."""

    def __init__(self, w, max_rows: int):
        q = w.get_base_layer().weight
        self.w, self.q, self.seed, self.dtype = w, q, w.requant_seed, None
        n, cols = q.shape
        sel = sample_rows(n, torch.device("cpu"), max_rows, cols)
        self.sel = torch.arange(n) if isinstance(sel, slice) else sel
        if qrows.swizzled(q):  # only the sampled rows are read
            self.cur = qrows.dequantized_rows(q, self.sel)
        else:  # rows read from the layout's own dequantization of the whole
            self.cur = w.weight2d.detach()[self.sel.to(q.device)].float()
        self.weight = n / self.sel.numel()

    def _round(self, exact: torch.Tensor) -> torch.Tensor:
        return qrows.grid_round_rows(self.q, exact, None, self.seed)


class _QuantRows:
    """A row-wise quantized weight's sample (see module doc)."""

    def __init__(self, w, max_rows: int):
        self.w, self.q, self.seed = w, w.get_base_layer().weight, w.requant_seed
        self.block = qrows.block_width(self.q)
        self.step = qrows.top_step(self.q, 1.0)  # a grid step per unit of the top value, or None
        n, cols = self.q.shape
        even = sample_rows(n, torch.device("cpu"), max_rows, cols)
        even = torch.arange(n) if isinstance(even, slice) else even.cpu()
        # the elements the top's search may compute: a sample's worth, or an eighth of the weight (each
        # costs a rank-long product per earlier merge: far less than holding every row, which replays them all)
        self.search_limit = max(SAMPLE_ELEMENTS, self.q.numel() // SEARCH_SHARE)
        self._elementwise = qrows.elementwise(self.q)
        if self._elementwise:
            self._full, self.row_max = None, qrows.stored_row_absmax(self.q).cpu()
        elif qrows.swizzled(self.q):  # rows read alone; row maxima bounded from the scales
            self._full, self.row_max = None, qrows.row_bound(self.q)
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
        self._cheap = None            # the last merge's rows whose move bound is the cheap one (`_settle`)

    def _base(self, rows: torch.Tensor) -> torch.Tensor:
        dev = self.q.device
        if self._full is not None:
            return self._full[rows.to(dev)].float()
        return qrows.dequantized_rows(self.q, rows.to(dev))

    def _bound(self, s, low: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(fp32 [out]: a bound of each row's largest |value| of slot `s`'s update, the rows whose
        bound is only the cheap one or None): from its factors for every row (|scale| x sum_r
        |up[i, r]| max_j |down[r, j]|), exact (chunked products) for the rows that bound lets reach
        `low`, so the rows searched stay few."""
        n = self.row_max.numel()
        stack = s.update.stack()
        if stack is None:
            return self._exact_bound(s, torch.arange(n), torch.empty(n)), None
        down, up, scale = stack
        k = abs(float(scale) * s.strength)
        out = (up.float().abs() @ down.float().abs().amax(dim=1)).cpu() * (k * 1.001)
        cheap = self.row_max + out + (self.moved if self.moved is not None else math.inf) < low
        return self._exact_bound(s, torch.nonzero(~cheap).reshape(-1), out), cheap

    def _exact_bound(self, s, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` with the exact largest |value| of slot `s`'s update at `rows` (x 1.0001: the fp32
        roundings of the update as the merge computes it)."""
        dev = self.q.device
        for i in range(0, rows.numel(), REFINE_ROWS):
            part = rows[i:i + REFINE_ROWS]
            out[part] = self.w.delta_rows(part.to(dev), [s]).abs().amax(dim=1).cpu() * 1.0001
        return out

    def _settle(self) -> None:
        """Make exact the bounds the last merge's moves kept cheap (when a later adapter is measured:
        the cheap ones would let nearly every row reach the top)."""
        if self._cheap is None:
            return
        s, cheap, before, step = self._cheap
        self._cheap = None
        rows = torch.nonzero(cheap).reshape(-1)
        self.moved[rows] = before[rows] + self._exact_bound(s, rows, torch.empty(cheap.numel()))[rows] + step

    def _missing(self) -> torch.Tensor:
        """The rows not held."""
        every = torch.arange(self.row_max.numel())
        return every[~torch.isin(every, self.sel)]

    def _hold_all(self) -> torch.Tensor:
        """Hold and measure every row (as dear as the whole: no search); the rows it added."""
        new, self.measured = self._missing(), slice(None)
        self._add(new)
        return new

    def _add(self, rows: torch.Tensor) -> None:
        """Hold `rows` too (unmeasured): their base values with the merges so far replayed."""
        cur = self._base(rows)
        dev = self.q.device
        for s, amax in self.history:  # at each merge's own scale
            cur = qrows.grid_round_rows(self.q, cur + self.w.delta_rows(rows.to(dev), [s]), amax, self.seed)
        self.sel, self.cur = torch.cat([self.sel, rows]), torch.cat([self.cur, cur])

    def _reach(self, b: torch.Tensor, low: float) -> torch.Tensor:
        """Rows not held that may reach a |value| of `low` after the update bounded by `b`."""
        need = torch.nonzero(self.row_max + self.moved + b >= low).reshape(-1)
        return need[~torch.isin(need, self.sel)]

    def _block_top(self, s, b: torch.Tensor, low: float) -> float | None:
        """The merged tensor's largest |value| after slot `s`'s update, given `low`, the largest the
        held rows reach: from the blocks elsewhere that may reach it (their values with the merges
        so far replayed block by block); None when they are more than `search_limit` elements."""
        limit = self.search_limit
        held = torch.zeros(self.row_max.numel(), dtype=torch.bool)
        held[self.sel] = True
        room = self.moved + b
        rows = torch.nonzero(~held & (self.row_max + room >= low)).reshape(-1)
        if rows.numel() == 0:
            return low
        if self._elementwise:
            found = qrows.elements_at_least(self.q, low - room[rows], limit, rows)
            if found is None:
                return None
            r, c = found
        else:
            vals = self._base(rows)
            sub = vals.abs() >= (low - room[rows]).to(vals.device)[:, None]
            if int(sub.sum()) > limit:
                return None
            i, c = torch.nonzero(sub, as_tuple=True)
            r, c = rows[i.cpu()], c.cpu()
        if r.numel() == 0:
            return low
        per_row = self.q.shape[1] // self.block
        blocks = torch.unique(r * per_row + c // self.block)
        if blocks.numel() * self.block > limit:  # as dear as holding rows: the caller takes rows
            return None
        r = blocks // per_row
        c = (blocks % per_row)[:, None] * self.block + torch.arange(self.block)[None]
        cur = self._base_at(r, c)
        for past, amax in self.history:  # the merges so far, block by block
            cur = self._round_blocks(cur + _low_rank_at(past, r, c), amax)
        return max(low, float((cur + _low_rank_at(s, r, c)).abs().amax()))

    def _base_at(self, r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """fp32 [m, width]: the base weight at rows `r` [m], columns `c` [m, width]."""
        if self._elementwise:
            return qrows.dequantized_at(self.q, r.repeat_interleave(c.shape[1]), c.reshape(-1)).reshape(c.shape)
        rows, at = torch.unique(r, return_inverse=True)
        vals = self._base(rows)
        return vals[at.to(vals.device)[:, None], c.to(vals.device)]

    def _round_blocks(self, exact: torch.Tensor, amax) -> torch.Tensor:
        if self.block == 1:  # elements quantize on their own: one row of them
            return qrows.grid_round_rows(self.q, exact.reshape(1, -1), amax, self.seed).reshape(exact.shape)
        return qrows.grid_round_rows(self.q, exact, amax, self.seed)

    def measure(self, s, name: str):
        n = self.row_max.numel()
        self._settle()
        if self.history and self.sel.numel() < n and (self.step is None or self.step >= COARSE_STEP):
            self._hold_all()  # after a merge on a coarse grid any row may reach the top
        d = self.w.delta_rows(self.sel.to(self.q.device), [s])
        if self.sel.numel() == n:  # every row held: the top is in hand
            return self._merged_rows(d, s, name, None)
        # the largest |value| the held rows reach is a floor for the whole tensor's
        low = float((self.cur + d).abs().amax())
        b, cheap = self._bound(s, low)
        if self.block is not None and self.moved is not None and all(
                p.update.stack() is not None for p, _ in self.history + [(s, None)]):
            top = self._block_top(s, b, low)
            if top is not None:
                return self._merged_rows(d, s, name, (b, cheap), torch.tensor(top))
        new = self._reach(b, low)
        if new.numel():
            if self.sel.numel() + new.numel() > MAX_CANDIDATE_SHARE * n:
                new = self._hold_all()
            else:
                self._add(new)
            d = torch.cat([d, self.w.delta_rows(new.to(self.q.device), [s])])
        return self._merged_rows(d, s, name, (b, cheap))

    def _merged_rows(self, d, s, name: str, b, amax=None):
        """The held rows merged with `d` at the scale of the largest |value| `amax` (default: theirs)."""
        exact = self.cur + d
        amax = exact.abs().amax() if amax is None else amax
        rounded = qrows.grid_round_rows(self.q, exact, amax, self.seed)
        return self._sums(exact, rounded, d, name) + ((rounded, amax, s, b),)

    def _sums(self, exact, rounded, d, name: str) -> tuple[float, float]:
        m = self.measured
        e = _sq(rounded[m] - exact[m])
        _finite_check(e, rounded, self.cur, exact, name, self.w.layer_name, None)
        k = self.row_max.numel() / exact[m].shape[0]  # rows per measured row
        return e * k, _sq(d[m]) * k

    def advance(self, after) -> None:
        """`after`: (rounded rows, largest |value|, slot, (bound, its cheap rows) or None)."""
        rounded, amax, s, bound = after
        self.cur = rounded
        self.history.append((s, amax))
        if self.step is None or self.moved is None or bound is None:
            self.moved = None
            return
        b, cheap = bound
        before, step = self.moved, self.step * float(amax)
        self.moved = before + b + step
        if cheap is not None and bool(cheap.any()):
            self._cheap = (s, cheap, before, step)


def _low_rank_at(s, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """fp32 [m, width]: slot `s`'s low-rank update at rows `rows` [m], columns `cols` [m, width],
    times its strength (in chunks of about 2**16 elements: the gathered factors stay small)."""
    down, up, scale = s.update.stack()
    dev = up.device
    rows, cols = rows.to(dev), cols.to(dev)
    step = max(1, (1 << 16) // cols.shape[1])
    out = [torch.einsum("mr,rmw->mw", up[rows[i:i + step]].float(), down[:, cols[i:i + step]].float())
           for i in range(0, rows.numel(), step)]
    return (torch.cat(out) if out else torch.zeros(cols.shape, device=dev)) * float(scale) * s.strength


class SequentialEstimate:
    """Row samples of every weight, advanced by each adapter that merges, in merge order."""

    def __init__(self, wrappers: list, max_rows: int = MAX_SAMPLE_ROWS):
        self.rows = {w.layer_name: _sample(w, max_rows) for w in wrappers}

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


def _sample(w, max_rows: int):
    q = w.get_base_layer().weight
    if w.quantized and qrows.row_local(q):
        return _LocalRows(w, max_rows)
    if w.quantized and qrows.row_wise(q):
        return _QuantRows(w, max_rows)
    return _Rows(w, max_rows)
