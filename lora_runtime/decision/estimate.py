"""Row samples of the weights `auto` measures, advanced merge by merge in merge order.

Contract
- `SequentialEstimate(wrappers).share(name)`: (the share of adapter `name`'s update a merge would
  round away, ``sqrt(sum err^2 / sum |dW|^2)`` over its layers' sampled rows; the state after that
  merge), writing nothing; `advance(after)` takes the state when the adapter merges, so later adapters
  are measured against the weight it leaves. A merge that would take a weight past its dtype's range
  raises NonFiniteMergeError naming the adapter and the layer.
- Each layer's sums are its sample's times its rows per sampled row, so layers sampled at different
  rates weigh as their whole weights do.
- A float weight: an even sample of whole rows (at most SAMPLE_ELEMENTS elements, and 1/SAMPLE_SHARE of
  the rows where that is at least MIN_SAMPLE_ELEMENTS), rounded to its dtype.
- A quantized weight whose rows re-quantize alone (`quantized_rows.row_local`: mxfp8, the 4-bit
  row-wise layouts): the same even sample (read alone where the layout allows), re-quantized
  alone: bit for bit the whole merge's rows (round to nearest). No search.
- A quantized weight of another row-wise layout (`quantized_rows.row_wise`: a scale spans the tensor):
  the same even sample and the rows with the largest stored values, re-quantized at the scale of the
  largest |value| of W + the updates merged so far + this one, summed whole in fp32: the scale a
  merge of those adapters recalculates (a merge rounds the sum once). For the first adapter that is
  the whole merge's own scale. The value is found exactly without forming the whole sum: the held
  rows, then only the rows, column blocks and elements that bounds of the updates (from their factors;
  exact row maxima where rows were computed whole) let reach it (`_QuantRows._top`). With stochastic rounding
  the sample is one draw of the merge's rounding, not the whole merge's own draw.
- Any other quantized weight: every row, re-quantized whole (`AdaptedLayer.grid_round`).
"""
from __future__ import annotations

import math

import torch

from ..errors import NonFiniteMergeError
from ..layer import quantized_rows as qrows
from ..layer import weight_merge
from .factor_bounds import Factors

MAX_SAMPLE_ROWS = 1024
# the auto measurement samples at most this many elements of each weight (whole rows, evenly
# spaced, at least MIN_SAMPLE_ROWS): i.i.d. rounding errors give a statistical error of about
# 1/sqrt(2 * 2**18) = 0.14 % per layer, and the measurement costs a small share of a merge
SAMPLE_ELEMENTS = 1 << 18
# and at most 1/SAMPLE_SHARE of the weight's rows, unless that is under MIN_SAMPLE_ELEMENTS (2**16:
# 0.28 %; a Wan-1.3B 1536 x 1536 projection: 48 rows, 74k elements): each adapter is measured apart
# while a merge of all of them rounds the weight once, so four adapters' samples stay far below a
# quarter of the weight
SAMPLE_SHARE = 32
MIN_SAMPLE_ELEMENTS = 1 << 16
MIN_SAMPLE_ROWS = 16
TOP_ROWS = 4
# the top's search screens single elements while they are at most 1/SCREEN_COST of the candidate rows'
# elements, and computes them one by one while (elements x rank) is at most GATHER_COST x those rows'
# elements; else it computes those rows whole (chunks of DENSE_CHUNK elements): measured costs per element
SCREEN_COST = 4
GATHER_COST = 1
DENSE_CHUNK = 1 << 20


def sample_rows(rows: int, device, max_rows: int, cols: int | None = None):
    """An even sample of whole rows: a slice of all when they fit, else sorted row indices."""
    if cols is not None:
        c = max(1, cols)
        share = max(rows // SAMPLE_SHARE, MIN_SAMPLE_ELEMENTS // c)
        max_rows = min(max_rows, max(MIN_SAMPLE_ROWS, min(SAMPLE_ELEMENTS // c, share)))
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
    """A tensor-scaled quantized weight's sample (see module doc)."""

    def __init__(self, w, max_rows: int):
        self.w, self.q, self.seed = w, w.get_base_layer().weight, w.requant_seed
        n, cols = self.q.shape
        even = sample_rows(n, torch.device("cpu"), max_rows, cols)
        even = torch.arange(n) if isinstance(even, slice) else even.cpu()
        self._elementwise = qrows.elementwise(self.q)
        self.blocks = None
        if self._elementwise:  # rows and elements screened from the stored bytes' block maxima
            self.blocks = qrows.stored_blocks(self.q)
            self._full, self.row_max = None, qrows.stored_row_absmax(self.q, self.blocks).cpu()
        elif qrows.swizzled(self.q):  # rows read alone; row maxima bounded from the scales
            self._full, self.row_max = None, qrows.row_bound(self.q)
        else:  # the layout's own dequantization, once
            self._full = w.weight2d.detach()
            self.row_max = self._full.abs().amax(dim=1).cpu()
        # the rows with the largest stored values come along unmeasured: their sums give a close floor
        # for the whole tensor's largest |value|, which keeps the search small
        top = torch.topk(self.row_max, min(TOP_ROWS, n)).indices
        top = top[~torch.isin(top, even)]
        self.sel, self.measured = torch.cat([even, top]), slice(0, even.numel())  # measured: the even rows
        self.held = torch.zeros(n, dtype=torch.bool)
        self.held[self.sel] = True
        self.cur = self._base(self.sel)  # the held rows as the merges so far leave them (each re-quantized)
        self.summed = self.cur           # the held rows of W + the merged updates, unrounded
        self.merged: list = []           # the slots merged so far, in order
        self.reach = torch.zeros(n)      # per row: a bound of the merged updates' sum's largest |value|
        self._known: dict = {}           # slot name -> its `Factors`

    def _factors(self, s) -> "Factors | None":
        if s.name not in self._known:
            self._known[s.name] = Factors.of(s)
        return self._known[s.name]

    def _base(self, rows: torch.Tensor) -> torch.Tensor:
        dev = self.q.device
        if self._full is not None:
            return self._full[rows.to(dev)].float()
        return qrows.dequantized_rows(self.q, rows.to(dev))

    def _row_bound(self, s) -> torch.Tensor:
        """fp32 [out]: a bound of each row's largest |value| of slot `s`'s update from its factors alone
        (no product): the smaller of |k| sum_r |up[i, r]| max_j |down[r, j]| and the norms' bound
        (`Factors`); inf for an update that is not low-rank."""
        f = self._factors(s)
        if f is None:
            return torch.full((self.row_max.numel(),), math.inf)
        return torch.minimum(f.terms_bound, f.row_norm * float(f.col_norm.amax())).cpu()

    def _top(self, s, low: float):
        """(the largest |value| of W + the merged updates + slot `s`'s update over the whole tensor, given
        `low`, the held rows' largest; `s`'s row bound; (rows, the exact largest |value| of the updates'
        sum in each) where the search computed whole rows, else None). Screens, each cheaper than the
        next, keep what can reach `low`: rows, by their base's largest value plus a bound of the
        updates (their row bounds summed, or the stacked factors' norms ||[up_1 .. up_k][i]|| max_j
        ||[down_1; ..; down_k][:, j]||); blocks of those rows, by their base's largest value (stored
        bytes for per-tensor fp8 / int8, scales for nvfp4) plus the norms' bound over the block's
        columns; elements, by their base value plus the norms' product at that element (Cauchy-Schwarz).
        The rest are computed one by one (a rank-long product each), or, when that would cost more,
        those rows whole (row chunks)."""
        b = self._row_bound(s)
        room = self.reach + b
        slots = self.merged + [s]
        factors = [self._factors(p) for p in slots]
        if None not in factors:  # the sum's own norms bound it closer than the terms'
            up_norm = torch.sqrt(sum(f.row_norm ** 2 for f in factors))
            down_norm = torch.sqrt(sum(f.col_norm ** 2 for f in factors))
            room = torch.minimum(room, up_norm * float(down_norm.amax()))
        rows = torch.nonzero(~self.held & (self.row_max + room >= low)).reshape(-1)
        if rows.numel() == 0:
            return low, b, None
        dense = rows.numel() * self.q.shape[1]  # the elements a dense search computes
        base = None
        if None not in factors:
            rank = sum(f.rank for f in factors)
            if self._elementwise:
                need = low - self._block_room(rows, room, up_norm, down_norm, qrows.BYTE_BLOCK)
                found = qrows.elements_at_least(self.q, need, dense // SCREEN_COST, rows, self.blocks)
                if found is not None:
                    r, c = found
                    vals = qrows.dequantized_at(self.q, r, c)
            elif qrows.reads_blocks(self.q):  # nvfp4: blocks bounded by their scales, the rest read alone
                need = low - self._block_room(rows, room, up_norm, down_norm, qrows.NVFP4_BLOCK)
                found = self._block_screen(rows, need, dense // SCREEN_COST)
                if found is not None:
                    r, c, vals = found
            else:
                base = self._base(rows)
                hit = base.abs() >= (low - room[rows]).to(base.device)[:, None]
                found = None
                if int(torch.count_nonzero(hit)) <= dense // SCREEN_COST:
                    i, c = torch.nonzero(hit, as_tuple=True)
                    r, c, vals = rows[i.cpu()], c.cpu(), base[hit]
                    found = r, c
            if found is not None:
                vals = vals.cpu()
                each = [f.element_bound(r, c) for f in factors]  # the merged slots', then s's
                reach = torch.minimum(torch.minimum(room[r], self.reach[r] + each[-1]),
                                      torch.minimum(sum(each), up_norm[r] * down_norm[c]))
                keep = vals.abs() + reach >= low
                r, c, vals = r[keep], c[keep], vals[keep]
                if r.numel() * rank <= dense * GATHER_COST:
                    for f in factors:
                        vals = vals + f.at(r, c)
                    return max(low, float(vals.abs().amax())) if vals.numel() else low, b, None
        top, exact = self._dense_top(rows, slots, low, base)
        return top, b, (rows, exact)

    @staticmethod
    def _block_room(rows, room, up_norm, down_norm, width: int) -> torch.Tensor:
        """fp32 [len(rows), in / width (rounded up)]: a bound of the updates' sum's |value| in each
        block of `width` columns of `rows`: the row's bound, or its up norm times the block's largest
        down norm."""
        cols = down_norm.numel()
        padded = torch.zeros(-(-cols // width) * width)
        padded[:cols] = down_norm
        block = padded.reshape(-1, width).amax(dim=1)
        return torch.minimum(room[rows][:, None], up_norm[rows][:, None] * block[None, :])

    def _block_screen(self, rows: torch.Tensor, need: torch.Tensor, limit: int):
        """(rows, cols, values) of the elements of `rows` whose |value| is at least `need` (one per row and
        16-element block), reading only the blocks whose scale bound reaches it; None past `limit`
        elements read."""
        bound = qrows.block_bound(self.q, rows)
        need = need.reshape(rows.numel(), -1).expand(bound.shape)
        hit = bound >= need
        if int(torch.count_nonzero(hit)) * qrows.NVFP4_BLOCK > limit:
            return None
        i, blk = torch.nonzero(hit, as_tuple=True)
        if i.numel() == 0:
            return rows[:0], blk, torch.zeros(0)
        vals = qrows.dequantized_blocks(self.q, rows[i], blk).cpu()
        keep = vals.abs() >= need[i, blk][:, None]
        k, j = torch.nonzero(keep, as_tuple=True)
        return rows[i[k]], blk[k] * qrows.NVFP4_BLOCK + j, vals[k, j]

    def _dense_top(self, rows: torch.Tensor, slots: list, low: float, base):
        """(the largest |value| of W + the slots' updates over `rows`, at least `low`; each row's exact
        largest |value| of the updates' sum), in chunks of rows. `base`: the rows' values, if read."""
        cols, dev = self.q.shape[1], self.q.device
        step = max(1, DENSE_CHUNK // cols)
        top, exact = low, torch.empty(rows.numel())
        # an update that reads the weight (DoRA) reads it dequantized once, not once per chunk
        src = self.w.weight2d.detach() if any(p.update.needs_weight and p.frozen_delta is None for p in slots) \
            else self.q
        for i in range(0, rows.numel(), step):
            part = rows[i:i + step]
            upd = weight_merge.delta_rows(src, part.to(dev), slots, False)
            most = upd.abs().amax(dim=1)
            exact[i:i + step] = most.cpu()
            if self._elementwise:  # only the elements whose base value can reach the top so far
                r, c = qrows.elements_at_least(self.q, top - most, part.numel() * cols, part, self.blocks)
                vals = qrows.dequantized_at(self.q, r, c) if r.numel() else None
            elif base is None and qrows.reads_blocks(self.q):  # only the blocks that can reach the top
                r, c, vals = self._block_screen(part, (top - most).cpu(), part.numel() * cols)
            else:
                vals = (base[i:i + step] if base is not None else self._base(part)) + upd
                top = max(top, float(vals.abs().amax()))
                continue
            if r.numel():
                vals = vals.to(dev) + upd[torch.searchsorted(part, r).to(dev), c.to(dev)]
                top = max(top, float(vals.abs().amax()))
        return top, exact * 1.0001  # a bound for later sums, whose fp32 roundings differ

    def measure(self, s, name: str):
        d = self.w.delta_rows(self.sel.to(self.q.device), [s])
        summed = self.summed + d
        top, b, exact = self._top(s, float(summed.abs().amax()))
        exact_rows = self.cur + d
        amax = torch.tensor(top)
        rounded = qrows.grid_round_rows(self.q, exact_rows, amax, self.seed)
        return self._sums(exact_rows, rounded, d, name) + ((rounded, amax, s, b, exact, summed),)

    def _sums(self, exact, rounded, d, name: str) -> tuple[float, float]:
        m = self.measured
        e = _sq(rounded[m] - exact[m])
        _finite_check(e, rounded, self.cur, exact, name, self.w.layer_name, None)
        k = self.row_max.numel() / exact[m].shape[0]  # rows per measured row
        return e * k, _sq(d[m]) * k

    def advance(self, after) -> None:
        """`after`: (rounded rows, the top, slot, its row bound, (rows, exact sums' maxima) or None,
        the held rows' unrounded sum)."""
        rounded, _, s, b, exact, summed = after
        self.cur, self.summed = rounded, summed
        self.merged.append(s)
        self.reach = self.reach + b
        if exact is not None:
            rows, most = exact
            self.reach[rows] = torch.minimum(self.reach[rows], most)


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
