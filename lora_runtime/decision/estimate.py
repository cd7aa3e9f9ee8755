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
  alone: the whole merge's rows (round to nearest; bit for bit, but for the last fp32 bits of the
  4-bit layouts' row rotation). No search.
- A quantized weight of another row-wise layout (`quantized_rows.row_wise`: a scale spans the tensor):
  the same even sample and the rows with the largest stored values, re-quantized at the scale of the
  largest |value| of W + the updates merged so far + this one, summed whole in fp32: the scale a
  merge of those adapters recalculates (a merge rounds the sum once). For the first adapter that is
  the whole merge's own scale. The value is found exactly without forming the whole sum: the held
  rows, then only the rows, column blocks and elements that bounds of the updates (from their factors;
  exact row maxima where rows were computed whole) let reach it (`_QuantRows._search`). After the
  first merge (or along the first adapter's own search, where that computes rows whole on per-tensor
  fp8 / int8) one search finds that value for every adapter still to be measured, in the order given
  (`order`), each assumed merged after the last; it serves while the merges follow that order, and an
  adapter measured off it is searched on its own. With stochastic rounding the sample's error is
  one draw of the merge's rounding, not the whole merge's own draw; where that rounding is known
  exactly (per-tensor int8, the host's fp8 byte draws: `quantized_rows.expected_rounding`), the exact
  expectation of its error, its rows then left rounded to nearest for the adapters measured after it.
- Any other quantized weight: every row, re-quantized whole (`AdaptedLayer.grid_round`).
"""
from __future__ import annotations

import math

import torch

from ..errors import NonFiniteMergeError
from ..layer import quantized_rows as qrows
from ..layer import weight_merge
from . import factor_bounds as fb
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
# elements; else it computes those rows whole (chunks of DENSE_CHUNK elements). Measured on a Wan-1.3B
# block: past 1/64 of the rows' elements, screening and gathering them costs more than the rows whole
# (updates that move rows by 30 % of the top: 4 -> 64 halves the search; small updates: the same)
SCREEN_COST = 64
GATHER_COST = 1
DENSE_CHUNK = 1 << 20
# before the byte screen reads every candidate row, it reads every PROBE_STEP-th: when those alone find
# more than their share of the screen's limit, the search goes to whole rows at once
PROBE_STEP = 16


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


def _absmax(t: torch.Tensor) -> float:
    """The largest |value| of `t` (NaN if it holds one): one reduction in place, no |t| copy."""
    low, high = torch.aminmax(t)
    return float(torch.maximum(high, -low))


def _row_absmax(t: torch.Tensor, out: torch.Tensor) -> None:
    """Each row's largest |value| of 2-D `t`, into `out`, the same way."""
    torch.maximum(t.amax(dim=1), t.amin(dim=1).neg(), out=out)


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

    def __init__(self, w, max_rows: int, chain: list):
        self.w, self.q, self.seed = w, w.get_base_layer().weight, w.requant_seed
        self.chain = chain  # the slots in the order they are measured, each assumed merged before the next
        n, cols = self.q.shape
        even = sample_rows(n, torch.device("cpu"), max_rows, cols)
        even = torch.arange(n) if isinstance(even, slice) else even.cpu()
        self._elementwise = qrows.elementwise(self.q)
        self.blocks = self.table = self.scale = None
        if self._elementwise:  # rows and elements screened from the stored bytes' block maxima
            self.blocks, self.table = qrows.stored_blocks(self.q), qrows.value_table(self.q)
            self.scale = qrows.linear_scale(self.q, self.table)
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
        self._held_d: dict = {}          # slot name -> its update on the held rows
        self._tops = None                # the chain's tops for `_rest`, from merge `_start` on (`_chained`);
        self._start, self._rest = 0, []  # None until a chain is searched, False where none can be
        # the search screens blocks of columns: the stored bytes' blocks (`quantized_rows.byte_blocks`),
        # nvfp4's scale blocks of 16 adjacent columns, or whole rows of the base values
        self._width = None if self._elementwise else qrows.NVFP4_BLOCK if qrows.reads_blocks(self.q) else cols

    def _factors(self, s) -> "Factors | None":
        if s.name not in self._known:
            self._known[s.name] = Factors.of(s, self.q.device)
        return self._known[s.name]

    def _base(self, rows: torch.Tensor) -> torch.Tensor:
        dev = self.q.device
        if self._full is not None:
            return self._full[rows.to(dev)].float()
        return qrows.dequantized_rows(self.q, rows.to(dev), self.scale)

    def _row_bound(self, s) -> torch.Tensor:
        """fp32 [out]: a bound of each row's largest |value| of slot `s`'s update from its factors alone
        (no product): the smaller of |k| sum_r |up[i, r]| max_j |down[r, j]| and the norms' bound
        (`Factors`); inf for an update that is not low-rank."""
        f = self._factors(s)
        if f is None:
            return torch.full((self.row_max.numel(),), math.inf)
        return torch.minimum(f.terms_bound, f.row_norm * float(f.col_norm.amax())).cpu()

    def _search(self, rest: list, lows: list[float], more: list = (), more_lows: list[float] = ()):
        """(for each j, the largest |value| over the whole tensor of W + the merged updates + those of
        rest[:j + 1], given `lows[j]`, the held rows' largest; (rows, the exact largest |value| of the
        sum of every update in each) where the search computed whole rows, else None). One search
        serves every j: a row, block or element is kept when any j's bound lets it reach that j's
        floor. Screens, each cheaper than the next: rows, by their base's largest value plus a bound
        of the updates (their row bounds summed, or the stacked factors' norms ||[up_1 .. up_k][i]||
        max_j ||[down_1; ..; down_k][:, j]||); blocks of those rows, by their base's largest value
        (stored bytes for per-tensor fp8 / int8, scales for nvfp4) plus the norms' bound over the
        block's columns; elements, by their base value plus the norms' product at that element
        (Cauchy-Schwarz). The rest are computed one by one (a rank-long product each), or, when that
        would cost more, those rows whole (row chunks, each update added in turn). When it computes
        rows whole, the slots in `more` (with their floors `more_lows`) come along, each summed after
        the last, over every row that any of rest's or more's bounds let reach its floor, and their
        tops follow rest's."""
        m = len(rest)
        hits, room, up_norm, down_norm = self._rows_reaching(list(rest) + list(more),
                                                             list(lows) + list(more_lows))
        room, up_norm, down_norm = room[:m], *(None if x is None else x[:m] for x in (up_norm, down_norm))
        rows = torch.nonzero(hits[:m].any(dim=0)).reshape(-1)
        factors = [self._factors(p) for p in self.merged + rest]
        low = torch.tensor(lows)[:, None]
        low_rank = up_norm is not None
        if rows.numel() == 0:
            return list(lows), None
        dense = rows.numel() * self.q.shape[1]  # the elements a dense search computes
        base = None
        if low_rank:
            need = torch.stack([lows[j] - self._block_room(rows, room[j], up_norm[j], self._blocks_max(down_norm[j]))
                                for j in range(len(rest))]).amin(dim=0)
            found, base = self._screen(rows, need, dense // SCREEN_COST)
            if found is not None:
                r, c, vals = found
                each = torch.stack([f.element_bound(r, c) for f in factors])  # the merged slots', then rest's
                own = each[len(self.merged):].cumsum(dim=0)
                bound = torch.minimum(torch.minimum(room[:, r], self.reach[r] + own),
                                      torch.minimum(each[:len(self.merged)].sum(dim=0) + own,
                                                    up_norm[:, r] * down_norm[:, c]))
                keep = (vals.abs() + bound >= low).any(dim=0)
                r, c, vals = r[keep], c[keep], vals[keep]
                if r.numel() * sum(f.rank for f in factors) <= dense * GATHER_COST:
                    return self._gathered_tops(r, c, vals, factors, lows), None
        if more:  # the rows that only a later slot's bounds let reach its floor come along too
            rows, base = torch.nonzero(hits.any(dim=0)).reshape(-1), None
        groups = [self.merged + rest[:1]] + [[p] for p in list(rest[1:]) + list(more)]
        tops, exact = self._dense_tops(rows, groups, list(lows) + list(more_lows), base)
        return tops, (rows, exact)

    def _gathered_tops(self, r, c, vals, factors: list, lows: list[float]) -> list[float]:
        """For each j, the larger of `lows[j]` and the largest |W + the merged updates + rest[:j + 1]'s| at
        the elements (r, c) (base values `vals`), from the factors (`factor_bounds.updates_at`)."""
        if not r.numel():
            return list(lows)
        sums = vals + fb.updates_at(factors)(r, c).cumsum(dim=0)[len(self.merged):]
        return torch.maximum(torch.tensor(lows), sums.abs().amax(dim=1)).tolist()

    def _rows_reaching(self, rest: list, lows: list[float]):
        """(bool [j, out]: the rows outside the held ones whose base's largest value plus a bound of the
        updates lets j reach `lows[j]`; per j and row, that bound: the merged updates' reach plus
        rest[:j + 1]'s row bounds, or where every update is low-rank, the smaller of that and the
        stacked norms' product; the stacked up norms per j and row, and down norms per j and column
        (None where an update is not low-rank))."""
        factors = [self._factors(p) for p in self.merged + rest]
        room = self.reach + torch.stack([self._row_bound(p) for p in rest]).cumsum(dim=0)  # [j, out]
        up_norm = down_norm = None
        if None not in factors:  # the sum's own norms bound it closer than the terms'
            up_norm = torch.stack([f.row_norm ** 2 for f in factors]).cumsum(dim=0)[len(self.merged):].sqrt()
            down_norm = torch.stack([f.col_norm ** 2 for f in factors]).cumsum(dim=0)[len(self.merged):].sqrt()
            room = torch.minimum(room, up_norm * down_norm.amax(dim=1, keepdim=True))
        return ~self.held & (self.row_max + room >= torch.tensor(lows)[:, None]), room, up_norm, down_norm

    def _blocks_max(self, v: torch.Tensor) -> torch.Tensor:
        """Each screened block's largest entry of a non-negative per-column vector `v`."""
        if self._width is None:
            return qrows.blocks_max(v)
        padded = v.new_zeros(-(-v.numel() // self._width) * self._width)
        padded[:v.numel()] = v
        return padded.reshape(-1, self._width).amax(dim=1)

    @staticmethod
    def _block_room(rows, room, up_norm, block_down) -> torch.Tensor:
        """fp32 [len(rows), blocks]: a bound of the updates' sum's |value| in each screened block of
        `rows`: the row's bound, or its up norm times the block's largest down norm (`block_down`)."""
        return torch.minimum(room[rows][:, None], up_norm[rows][:, None] * block_down[None, :])

    def _screen(self, rows: torch.Tensor, need: torch.Tensor, limit: int, read=None):
        """((rows, cols, fp32 values) of the elements of `rows` whose |value| is at least `need` (one per
        row, or per row and screened block), or None past `limit` of them; the rows' values
        where they were read whole, else None). `read`: the rows' values, if already read."""
        need = need.reshape(rows.numel(), -1).cpu()
        if self._elementwise:  # the stored bytes, only the blocks whose largest byte reaches `need`
            probe = slice(None, None, PROBE_STEP)
            if rows.numel() >= 4 * PROBE_STEP and limit < need.shape[0] * self.q.shape[1] and qrows.elements_at_least(
                    self.q, need[probe].contiguous(), limit // PROBE_STEP, rows[probe], self.blocks) is None:
                return None, None  # every PROBE_STEP-th row alone finds more than its share of `limit`
            found = qrows.elements_at_least(self.q, need, limit, rows, self.blocks)
            if found is None:
                return None, None
            r, c = found
            return (r, c, qrows.dequantized_at(self.q, r, c, self.table).cpu()), None
        if read is None and qrows.reads_blocks(self.q):  # nvfp4: blocks bounded by their scales, the rest read alone
            return self._block_screen(rows, need, limit), None
        base = self._base(rows) if read is None else read
        hit = base.abs() >= need.to(base.device)
        if int(torch.count_nonzero(hit)) > limit:
            return None, base
        i, c = torch.nonzero(hit, as_tuple=True)
        return (rows[i.cpu()], c.cpu(), base[hit].cpu()), base

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

    def _dense_tops(self, rows: torch.Tensor, groups: list[list], lows: list[float], base):
        """(for each k, the largest |value| of W + the first k groups' updates over `rows`, at least
        `lows[k]`; each row's exact largest |value| of the first group's updates' sum), in chunks of rows. `base`:
        the rows' values, if read. Low-rank groups: each chunk's sum is formed in place, one product
        per group added to it (`addmm_`), its row maxima taken after each; one screen of the base then
        serves every group (its threshold per row: the lowest of top - that sum's row maximum), and the
        earlier groups' sums at the few elements it finds are their factors' products there (or, when
        those would cost more, the chunk's products formed again; from then on each chunk's base is
        read whole, added to the first group's sum, and the tops are the maxima of W + each sum, with
        no screen). Else each group's update is added in turn (`weight_merge.delta_rows`) and
        screened apart."""
        factors = [[self._factors(p) for p in g] for g in groups]
        if any(f is None for fs in factors for f in fs):
            return self._dense_tops_deltas(rows, groups, lows, base)
        cols, dev = self.q.shape[1], self.q.device
        step = max(1, DENSE_CHUNK // cols)
        ups = [torch.cat([f.up for f in fs], dim=1).to(dev) for fs in factors]
        downs = [torch.cat([f.down_t for f in fs], dim=1).t().contiguous().to(dev) for fs in factors]
        rank = sum(u.shape[1] for u in ups[:-1])  # the earlier groups' products at one element
        buf = torch.empty((min(step, rows.numel()), cols), device=dev)
        tops, exact = list(lows), torch.empty(rows.numel())

        def sums(at, n):  # (k, the chunk's sum with group k's product added), in turn
            for k in range(len(groups)):
                if k == 0:
                    torch.mm(ups[0][at], downs[0], out=buf[:n])
                else:
                    buf[:n].addmm_(ups[k][at], downs[k])
                yield k, buf[:n]

        whole = False  # set by the first chunk whose screen finds more than its factors can gather
        for i in range(0, rows.numel(), step):
            part = rows[i:i + step]
            n, at = part.numel(), part.to(dev)
            most = torch.empty((len(groups), n), device=dev)
            if whole:  # W + each sum formed in place: its maxima are the tops, no screen
                read = self._base(part) if base is None else base[i:i + n].to(dev)
                for k, b in sums(at, n):
                    if k == 0:
                        _row_absmax(b, most[0])
                        b.add_(read)
                    tops[k] = max(tops[k], _absmax(b))
                exact[i:i + n] = most[0].cpu()
                continue
            for k, b in sums(at, n):
                _row_absmax(b, most[k])
            need = (torch.tensor(tops, device=dev)[:, None] - most).amin(dim=0)
            (r, c, vals), _ = self._screen(part, need, n * cols, None if base is None else base[i:i + n])
            if r.numel():
                local, vals = torch.searchsorted(part, r).to(dev), vals.to(dev)
                cd = c.to(dev)
                if r.numel() * rank <= n * cols * GATHER_COST:  # the earlier groups' sums from their factors
                    acc = vals
                    for k, fs in enumerate(factors[:-1]):
                        for f in fs:
                            acc = acc + f.at(r, c).to(dev)
                        tops[k] = max(tops[k], float(acc.abs().amax()))
                    tops[-1] = max(tops[-1], float((vals + buf[local, cd]).abs().amax()))
                else:
                    for k, b in sums(at, n):
                        tops[k] = max(tops[k], float((vals + b[local, cd]).abs().amax()))
                    whole = True
            exact[i:i + n] = most[0].cpu()
        return tops, exact * 1.0001  # a bound for later sums, whose fp32 roundings differ

    def _dense_tops_deltas(self, rows: torch.Tensor, groups: list[list], lows: list[float], base):
        """`_dense_tops` for updates without low-rank factors: each group's update added to the chunk's
        sum in turn (`weight_merge.delta_rows`) and the base screened for each."""
        cols, dev = self.q.shape[1], self.q.device
        step = max(1, DENSE_CHUNK // cols)
        tops, exact = list(lows), torch.empty(rows.numel())
        # an update that reads the weight (DoRA) reads it dequantized once, not once per chunk
        src = self.w.weight2d.detach() if any(p.update.needs_weight and p.frozen_delta is None
                                              for g in groups for p in g) else self.q
        for i in range(0, rows.numel(), step):
            part = rows[i:i + step]
            upd, read = None, None if base is None else base[i:i + step]
            for k, group in enumerate(groups):
                d = weight_merge.delta_rows(src, part.to(dev), group, False)
                upd = d if upd is None else upd.add_(d)
                most = upd.abs().amax(dim=1)
                if k == 0:
                    exact[i:i + step] = most.cpu()
                if self._elementwise:  # only the elements whose base value can reach the top so far
                    r, c = qrows.elements_at_least(self.q, tops[k] - most, part.numel() * cols, part, self.blocks)
                    vals = qrows.dequantized_at(self.q, r, c, self.table) if r.numel() else None
                elif read is None and qrows.reads_blocks(self.q):  # only the blocks that can reach the top
                    r, c, vals = self._block_screen(part, (tops[k] - most).cpu(), part.numel() * cols)
                else:
                    read = self._base(part) if read is None else read
                    tops[k] = max(tops[k], float((read + upd).abs().amax()))
                    continue
                if r.numel():
                    vals = vals.to(dev) + upd[torch.searchsorted(part, r).to(dev), c.to(dev)]
                    tops[k] = max(tops[k], float(vals.abs().amax()))
        return tops, exact * 1.0001  # a bound for later sums, whose fp32 roundings differ

    def _held_delta(self, s) -> torch.Tensor:
        if s.name not in self._held_d:
            self._held_d[s.name] = self.w.delta_rows(self.sel.to(self.q.device), [s])
        return self._held_d[s.name]

    def _rest_of(self, s) -> tuple[list, list[float]] | None:
        """(the chain from slot `s` on, less the merged slots; the held rows' largest |value| after each,
        summed in turn onto the merged ones), or None where a slot has no low-rank factors."""
        at = next((i for i, p in enumerate(self.chain) if p is s), len(self.chain))
        rest = [p for p in self.chain[at:] if all(p is not m for m in self.merged)]
        if not rest or None in (self._factors(p) for p in rest):
            return None
        summed, lows = self.summed.clone(), []
        for p in rest:
            lows.append(_absmax(summed.add_(self._held_delta(p))))
        return rest, lows

    def _chained(self, s) -> float | None:
        """The top for slot `s` from one search for the rest of the chain, each slot assumed merged
        after the last: made at the first measurement that follows a merge (the first adapter's own
        search is cheap, and one that stays unmerged is no evidence the rest merge) or carried along
        the first adapter's search where that computes rows whole (`measure`), used while the merges
        since follow that rest; None otherwise (the slot's own search serves)."""
        k = len(self.merged)
        if self._tops is None and k:
            found = self._rest_of(s)
            self._start, self._rest, self._tops = k, [] if found is None else found[0], False
            if found is not None:
                self._tops = self._search(*found)[0]
        j = k - self._start
        follows = bool(self._tops) and j < len(self._rest) and self._rest[j] is s and \
            all(a is p for a, p in zip(self.merged[self._start:], self._rest))
        return self._tops[j] if follows else None

    def measure(self, s, name: str):
        d = self._held_delta(s)
        summed = self.summed + d
        top, b, exact = self._chained(s), self._row_bound(s), None
        if top is None:
            low = _absmax(summed)
            found = self._rest_of(s) if not self.merged and self._tops is None and self._elementwise else None
            if found is not None:  # the rest of the chain comes along where rows are computed whole
                tops, exact = self._search([s], [low], found[0][1:], found[1][1:])
                if len(tops) > 1:
                    self._start, self._rest, self._tops = 0, found[0], tops
            else:
                tops, exact = self._search([s], [low])
            top = tops[0]
        exact_rows = self.cur + d
        amax = torch.tensor(top)
        expected = qrows.expected_rounding(self.q, self.seed)
        if expected is not None:
            rounded, e = expected(exact_rows, amax, self.measured)
        else:
            rounded = qrows.grid_round_rows(self.q, exact_rows, amax, self.seed)
            e = _sq(rounded[self.measured] - exact_rows[self.measured])
        return self._sums(e, exact_rows, rounded, d, name) + ((rounded, amax, s, b, exact, summed),)

    def _sums(self, e: float, exact, rounded, d, name: str) -> tuple[float, float]:
        m = self.measured
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

    def __init__(self, wrappers: list, max_rows: int = MAX_SAMPLE_ROWS, order: list[str] | None = None):
        """`order`: the adapters in the order they will be measured (default: each layer's own)."""
        self.rows = {w.layer_name: _sample(w, max_rows, order) for w in wrappers}

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


def _sample(w, max_rows: int, order: list[str] | None):
    q = w.get_base_layer().weight
    if w.quantized and qrows.row_local(q):
        return _LocalRows(w, max_rows)
    if w.quantized and qrows.row_wise(q):
        measured = {s.name: s for s in w.weight_slots()}
        chain = [measured[n] for n in (order if order is not None else measured) if n in measured]
        return _QuantRows(w, max_rows, chain)
    return _Rows(w, max_rows)
