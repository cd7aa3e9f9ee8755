"""Merging a delta into a weight, restoring it bit for bit, and measuring the loss.

All three work on a weight ``W`` [out, in] and a function ``delta_rows(rows)`` that
returns the fp32 delta for a row selection (a slice or an index tensor), so the
merge, the restore and the rounding-loss estimate share one slicing and scaling.

Merge: ``W' = round(fp32(W) + dW)`` (fp64 for an fp64 weight), one rounding to the weight dtype, in row chunks
so the temporaries stay under ``chunk_bytes`` (on the CPU small enough to stay in
cache). Each chunk's delta is computed once: the chunk is checked finite, the restore
simulated on it (its misses recorded), then written. A NaN/Inf or an interrupt
part-way restores the chunks already written bit for bit before it propagates, so no
weight is left modified.

Restore without a full backup: ``round(fp32(W') - dW)`` gives ``W`` back except where
the merge crossed a rounding boundary; those elements (index + original value) are
all the record keeps. Where that is larger than a copy of the weight, the record
keeps a full copy instead. Memory for restore = the record: ``n_exceptions *
(index bytes + value bytes)`` or one weight copy, whichever is smaller (measured in
tests/lora_runtime/layer/test_merge.py). A fingerprint of the original weight is checked after
every restore; a mismatch raises RestoreError instead of continuing silently.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..errors import NonFiniteMergeError, RestoreError

DeltaRows = Callable[[slice | torch.Tensor], torch.Tensor]

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024   # accelerators: few, large chunks (one launch per op per chunk)
CPU_CHUNK_BYTES = 4 * 1024 * 1024        # CPU: ~1 MiB per fp32 temporary, so every pass runs in cache
_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
_BITS_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class RestoreRecord:
    kind: str                                # "sparse" or "full"
    shape: tuple[int, ...]
    dtype: torch.dtype
    fingerprint: tuple[int, int]
    index: torch.Tensor | None = None        # flat indices where recomputation misses (ascending)
    values: torch.Tensor | None = None       # original values there
    full: torch.Tensor | None = None         # fallback copy

    @property
    def nbytes(self) -> int:
        ts = (self.index, self.values, self.full)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    @property
    def exceptions(self) -> int:
        return int(self.index.numel()) if self.index is not None else -1


def chunk_bytes_for(device) -> int:
    return CPU_CHUNK_BYTES if torch.device(device).type == "cpu" else DEFAULT_CHUNK_BYTES


def row_chunks(rows: int, cols: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    # ~4 fp32 temporaries of chunk size live at once
    step = max(1, chunk_bytes // max(1, cols * 4 * 4))
    for r0 in range(0, rows, step):
        yield slice(r0, min(rows, r0 + step))


# --- fingerprint ------------------------------------------------------------------------
_FP_PERIOD = 65521
_FP_LANES = 1 << 16       # int64 lanes per multiply (512 KiB of scratch)
_fp_weights: dict = {}


def _odd_weights(device) -> torch.Tensor:
    """(2 * (j mod 65521) + 1) for j in [0, 65521 + _FP_LANES): odd, so a weighted lane never cancels."""
    w = _fp_weights.get(device)
    if w is None:
        j = torch.arange(_FP_PERIOD + _FP_LANES, dtype=torch.int64, device=device) % _FP_PERIOD
        w = _fp_weights[device] = j * 2 + 1
    return w


def _lanes(w: torch.Tensor) -> torch.Tensor | None:
    """The weight's bits as int64 lanes (a view when the layout allows, else of a copy), or
    None when its bytes do not form whole lanes. Depends on dtype and shape only."""
    if (w.numel() * w.element_size()) % 8:
        return None
    if not w.is_contiguous() or w.data_ptr() % 8:
        w = w.contiguous().clone()
    return w.reshape(-1).view(_INT_VIEW[w.dtype]).view(torch.int64)


def fingerprint(w: torch.Tensor) -> tuple[int, int]:
    """Two integer checksums of the bit pattern (cheap; detects any restore slip).

    The bits are read as 64-bit lanes (a view: no conversion): the sum of the lanes and
    their sum weighted by odd position weights (2 * (lane index mod 65521) + 1), both
    modulo 2**64. A change in any single element changes both (a nonzero lane change
    times an odd number is nonzero modulo 2**64); a restore slip of many elements
    cancels in both only by coincidence. Weights whose bytes do not form whole lanes
    use the element-wise form (the same sums over the elements' own integer bits).
    """
    w = w.detach()
    lanes = _lanes(w)
    if lanes is None:
        return _fingerprint_elements(w)
    # Lane j's weight depends on j mod 65521 only, so (arithmetic modulo 2**64 being a ring)
    # both sums are taken over the column sums of the lanes laid out in rows of 65521: one
    # vectorised integer add per lane, then a single weighted sum of 65521 terms, instead
    # of a 64-bit multiply per lane (which AVX2 does not vectorise). int64 sums wrap.
    n = lanes.numel()
    full = n // _FP_PERIOD
    cols = min(n, _FP_PERIOD)
    if full:
        colsum = lanes[: full * _FP_PERIOD].view(full, _FP_PERIOD).sum(dim=0)
        rest = n - full * _FP_PERIOD
        if rest:
            colsum[:rest] += lanes[full * _FP_PERIOD:]
    else:
        colsum = lanes
    s1 = (colsum * _odd_weights(lanes.device)[:cols]).sum()
    return int(colsum.sum().item()) & 0xFFFFFFFFFFFFFFFF, int(s1.item()) & 0xFFFFFFFFFFFFFFFF


def content_key(w: torch.Tensor) -> tuple:
    """A cheap key of a weight's content for caches of measurements on it: device, dtype,
    shape and two checksums of its bits from one reduction over the rows (the row sums of
    its 64-bit lanes; their total, and their sum weighted by odd row weights, both modulo
    2**64). Any single-element change changes both; it reads the weight once without
    converting it (about a hundredth of a merge's work). Not a proof against a crafted
    change that cancels in both sums; what it guards against is a weight that was patched,
    reloaded or replaced under the same storage, which it catches.
    """
    w = w.detach()
    m = w.reshape(w.shape[0], -1) if w.dim() >= 2 else w.reshape(1, -1)
    lanes = _INT_VIEW.get(w.dtype) or _BITS_BY_SIZE[w.element_size()]  # quantized data and scales too
    bits = m.view(lanes) if m.is_contiguous() else m.contiguous().view(lanes)
    if (bits.shape[1] * bits.element_size()) % 8 == 0 and bits.data_ptr() % 8 == 0:
        rows = bits.view(torch.int64).sum(dim=1)
    else:
        rows = bits.to(torch.int64).sum(dim=1)
    pos = _odd_weights(rows.device)
    s1 = 0
    for i in range(0, rows.numel(), _FP_LANES):
        part = rows[i : i + _FP_LANES]
        o = i % _FP_PERIOD
        s1 += int((part * pos[o : o + part.numel()]).sum().item())
    M = 0xFFFFFFFFFFFFFFFF
    return (str(w.device), str(w.dtype), tuple(w.shape), int(rows.sum().item()) & M, s1 & M)


def _fingerprint_elements(w: torch.Tensor) -> tuple[int, int]:
    flat = w.reshape(-1).view(_INT_VIEW[w.dtype])
    pos = _odd_weights(flat.device)
    s0 = s1 = 0
    for i in range(0, flat.numel(), _FP_LANES):
        part = flat[i : i + _FP_LANES].to(torch.int64)
        o = i % _FP_PERIOD
        s0 += int(part.sum().item())
        s1 += int((part * pos[o : o + part.numel()]).sum().item())
    return s0 & 0xFFFFFFFFFFFFFFFF, s1 & 0xFFFFFFFFFFFFFFFF


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_VIEW[t.dtype])


def _non_finite_error(what: str, r: int, c: int) -> NonFiniteMergeError:
    return NonFiniteMergeError(
        f"{what}: merging would write a non-finite value at [{r}, {c}]; no weight was changed. "
        "The adapter's update at this strength does not fit this weight dtype (dynamic mode would give "
        "inf/NaN too): lower the strength, or load the model in bf16/fp32")


def _widened(wc: torch.Tensor, d: torch.Tensor, sign: int = 1) -> torch.Tensor:
    """A new tensor: ``wc + sign * d`` in their promoted dtype (wc widened exactly, one rounding),
    the bits of ``torch.add`` / ``torch.sub``. On the CPU a half-precision `wc` is widened by a
    copy first and the sum formed in place: torch's CPU kernel for mixed dtypes takes about
    three times as long as the copy and a same-dtype add together."""
    if wc.device.type != "cpu" or wc.dtype == d.dtype:
        return torch.add(wc, d) if sign > 0 else torch.sub(wc, d)
    s = wc.to(torch.promote_types(wc.dtype, d.dtype), copy=True)
    return s.add_(d) if sign > 0 else s.sub_(d)


def _restore_rows(wc: torch.Tensor, d: torch.Tensor, index: torch.Tensor, values: torch.Tensor,
                  offset: int) -> None:
    """wc (rows of the merged weight starting at flat `offset`) <- round(wc - d), then the misses."""
    wc.copy_(_widened(wc, d, -1))   # fp32(wc) - d (exact promotion for half types), one rounding
    if index.numel():
        wc.view(-1)[index - offset] = values


def _misses(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices where the bits of `a` and `b` (same shape, contiguous) differ, and `b`'s
    values there. On the CPU through numpy (its flatnonzero is several times torch's nonzero)."""
    if a.device.type == "cpu":
        an, bn = _bits(a).reshape(-1).numpy(), _bits(b).reshape(-1).numpy()
        idx = np.flatnonzero(an != bn)
        return torch.from_numpy(idx), torch.from_numpy(bn[idx]).view(b.dtype)
    flat = (_bits(a) != _bits(b)).view(-1).nonzero().squeeze(1)
    return flat, b.reshape(-1)[flat]


def _check_finite(new: torch.Tensor, old: torch.Tensor, what: str, row0: int) -> None:
    """Raise where `new` (a merged chunk) is non-finite and `old` (its original) was finite.
    One min/max reduction in the common case (both propagate NaN and show an inf)."""
    lo, hi = torch.aminmax(new)
    if math.isfinite(lo.item()) and math.isfinite(hi.item()):
        return
    bad = (~torch.isfinite(new) & torch.isfinite(old.to(new.device))).nonzero()
    if bad.numel():
        raise _non_finite_error(what, row0 + int(bad[0, 0]), int(bad[0, 1]))


def _merge_keeping_copy(w: torch.Tensor, delta_rows: DeltaRows, what: str, chunk_bytes: int,
                        fp: tuple[int, int], backup: torch.Tensor | None, scratch: bool) -> RestoreRecord:
    """Restore memory ``copy``: each chunk's original goes to the copy, then the merged bits
    (the same single rounding) are written and checked finite. Any failure part-way (a
    non-finite value, an interrupt) puts the copy back over every chunk written. `backup`:
    a copy that already holds the weight's bits (kept by the restore just before), taken
    as the record's copy instead of writing a new one. `scratch`: each delta chunk is the
    caller's fresh tensor, so the sum is formed in it (no fp32 temporary per chunk)."""
    rows, cols = w.shape
    full = backup
    if full is None:
        full = torch.empty_like(w, device="cpu") if w.device.type != "cpu" else torch.empty_like(w)
    done = 0    # rows whose original is in `full` (written or about to be)
    try:
        for sl in row_chunks(rows, cols, chunk_bytes):
            wc = w[sl]
            d = delta_rows(sl)
            if backup is None:
                full[sl].copy_(wc)
            done = sl.stop
            # fp32(wc) + d (exact promotion; addition commutes bit for bit), rounded once by the copy
            wc.copy_(d.add_(wc) if scratch else _widened(wc, d))
            _check_finite(wc, full[sl], what, sl.start)   # raising puts the copy back (below)
    except BaseException:
        w[:done].copy_(full[:done])
        raise
    return RestoreRecord("full", tuple(w.shape), w.dtype, fp, full=full)


@torch.no_grad()
def merge_weight(weight: torch.Tensor, delta_rows: DeltaRows, *, what: str,
                 chunk_bytes: int | None = None, known_fingerprint: tuple[int, int] | None = None,
                 keep_copy: bool = False, backup: torch.Tensor | None = None,
                 scratch_deltas: bool = False) -> RestoreRecord:
    """Fold the delta into `weight` in place; return what restores it bit for bit.

    One pass over row chunks: the delta is computed once per chunk, checked finite,
    the restore simulated (misses recorded), then the chunk written. A failure part-way
    (a non-finite value, an interrupt) restores the chunks already written bit for bit
    before it propagates, so no weight is left modified. `known_fingerprint`: the
    weight's fingerprint when the caller has just verified it (skips one read).
    `keep_copy`: keep a full copy instead of simulating the restore (restore memory ``copy``);
    `backup`: with `keep_copy`, a copy the caller knows holds the weight's current bits (the
    copy a verified restore just wrote back, with `known_fingerprint`): it becomes the
    record's copy, so a swap writes no second copy. `scratch_deltas`: every `delta_rows`
    call returns a new tensor the merge may overwrite (the wrapper's do; see
    `Update.delta`), which saves a temporary per chunk.
    """
    if weight.dtype not in _INT_VIEW:
        raise TypeError(f"{what}: cannot merge into dtype {weight.dtype}")
    w = weight.detach()
    rows, cols = w.shape
    chunk_bytes = chunk_bytes or chunk_bytes_for(w.device)
    fp = known_fingerprint if known_fingerprint is not None else fingerprint(w)
    if keep_copy:
        if backup is not None and (backup.shape != w.shape or backup.dtype != w.dtype or known_fingerprint is None):
            raise ValueError(f"{what}: a reused backup must be a verified copy of the weight's own shape and dtype")
        return _merge_keeping_copy(w, delta_rows, what, chunk_bytes, fp, backup, scratch_deltas)
    idx_dtype = torch.int32 if w.numel() < 2**31 else torch.int64
    full_bytes = w.numel() * w.element_size()
    per_miss = torch.empty(0, dtype=idx_dtype).element_size() + w.element_size()
    idx_parts: list[torch.Tensor] = []
    val_parts: list[torch.Tensor] = []
    n_miss = 0
    full: torch.Tensor | None = None           # the original, once a copy is smaller than the misses
    written: list[tuple[slice, torch.Tensor, torch.Tensor]] = []   # (rows, misses' flat index, values)
    try:
        for sl in row_chunks(rows, cols, chunk_bytes):
            wc = w[sl]
            d = delta_rows(sl)
            new = _widened(wc, d).to(w.dtype)                   # fp32(wc) + d (exact promotion), one rounding
            back = _widened(new, d, -1).to(w.dtype)             # what a restore will compute
            flat, vals = _misses(back, wc)
            if flat.numel():  # a non-finite result never restores to a finite original: it is a miss
                nv = new.reshape(-1)[flat.to(new.device)]
                bad = ~torch.isfinite(nv) & torch.isfinite(vals)
                if bad.any():
                    i = int(flat[bad.nonzero()[0, 0]])
                    raise _non_finite_error(what, sl.start + i // cols, i % cols)
            offset = sl.start * cols
            flat = flat.to(w.device) + offset
            if full is None:
                n_miss += flat.numel()
                if n_miss * per_miss >= full_bytes:  # a copy is smaller: rebuild the original of what is written
                    full = torch.empty_like(w)
                    for wsl, widx, wvals in written:
                        full[wsl] = w[wsl]
                        _restore_rows(full[wsl], delta_rows(wsl), widx, wvals, wsl.start * cols)
                    idx_parts, val_parts = [], []
                else:
                    idx_parts.append(flat)
                    val_parts.append(vals)
            if full is not None:
                full[sl] = wc
            written.append((sl, flat, vals))
            wc.copy_(new)
    except BaseException:
        for wsl, widx, wvals in written:  # put back what was written, bit for bit
            _restore_rows(w[wsl], delta_rows(wsl), widx, wvals, wsl.start * cols)
        raise
    if full is not None:
        return RestoreRecord("full", tuple(w.shape), w.dtype, fp, full=full)
    index = torch.cat(idx_parts).to(idx_dtype) if idx_parts else torch.empty(0, dtype=idx_dtype, device=w.device)
    values = torch.cat(val_parts) if val_parts else torch.empty(0, dtype=w.dtype, device=w.device)
    return RestoreRecord("sparse", tuple(w.shape), w.dtype, fp, index=index, values=values)


@torch.no_grad()
def restore_weight(weight: torch.Tensor, record: RestoreRecord, delta_rows: DeltaRows, *, what: str,
                   chunk_bytes: int | None = None) -> tuple[int, int]:
    """Undo `merge_weight` bit for bit (never by subtracting alone); returns the verified
    fingerprint of the restored weight."""
    w = weight.detach()
    if w.dtype != record.dtype or tuple(w.shape) != record.shape:
        raise RestoreError(
            f"{what}: the weight became {w.dtype} {tuple(w.shape)} after the merge ({record.dtype} {record.shape}); "
            "something cast or replaced it while the adapter was merged, so it cannot be restored bit for bit. "
            "Reload the model, and use merge mode 'dynamic' with whatever changes the weight")
    if record.kind == "full":
        w.copy_(record.full)   # a copy kept in CPU memory goes back to the weight's device
    else:
        rows, cols = w.shape
        chunks = list(row_chunks(rows, cols, chunk_bytes or chunk_bytes_for(w.device)))
        # the weight may have moved device since the merge (ComfyUI offload)
        index = record.index.to(w.device).long()
        values = record.values.to(w.device)
        starts = torch.tensor([sl.start * cols for sl in chunks] + [rows * cols], dtype=torch.int64,
                              device=index.device)
        bounds = torch.searchsorted(index, starts).tolist()
        for k, sl in enumerate(chunks):
            a, b = bounds[k], bounds[k + 1]
            _restore_rows(w[sl], delta_rows(sl), index[a:b], values[a:b], sl.start * cols)
    fp = fingerprint(w)
    if fp != record.fingerprint:
        raise RestoreError(
            f"{what}: the restored weight does not match the original fingerprint "
            "(the delta was not recomputed identically). Reload the model; please report this"
        )
    return fp


@torch.no_grad()
def rounding_loss_sums(weight: torch.Tensor, delta_rows: DeltaRows, *, max_rows: int = 1024,
                       round_to=None) -> tuple[float, float]:
    """(||round(W + dW) - W - dW||^2, ||dW||^2) over an even sample of rows; writes nothing.

    The rounding is to the weight's own dtype from the fp32 merge value, exactly as
    `merge_weight` does, so an fp32 weight reports 0. `round_to` (fp32 rows -> the values a
    merge leaves; a quantized layout's grid) replaces it and takes every row.
    """
    w = weight.detach()
    rows = w.shape[0]
    if rows <= max_rows or round_to is not None:
        sel: slice | torch.Tensor = slice(0, rows)
    else:
        sel = torch.linspace(0, rows - 1, max_rows, device=w.device).round().long().unique()
    wr = w[sel].float()
    d = delta_rows(sel)
    exact = wr + d
    err = (round_to(exact) if round_to is not None else exact.to(w.dtype).float()) - exact
    return float(err.double().pow(2).sum()), float(d.double().pow(2).sum())
