"""Merging a delta into a weight, restoring it bit for bit, and measuring the loss.

All three work on a weight ``W`` [out, in] and a function ``delta_rows(rows)`` that
returns the fp32 delta for a row selection (a slice or an index tensor), so the
merge, the restore and the rounding-loss estimate share one slicing and scaling.

Merge: ``W' = round(fp32(W) + dW)``, one rounding to the weight dtype, in row chunks
so the temporary stays under ``chunk_bytes``. Pass 1 computes every chunk, checks it
is finite and records what a restore needs; pass 2 writes. A NaN/Inf therefore
raises before a single element is written.

Restore without a full backup: ``round(fp32(W') - dW)`` gives ``W`` back except where
the merge crossed a rounding boundary; those elements (index + original value) are
all the record keeps. Where that is larger than a copy of the weight, the record
keeps a full copy instead. Memory for restore = the record: ``n_exceptions *
(index bytes + value bytes)`` or one weight copy, whichever is smaller (measured in
tests/runtime/test_merge.py). A fingerprint of the original weight is checked after
every restore; a mismatch raises RestoreError instead of continuing silently.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import NonFiniteMergeError, RestoreError

DeltaRows = Callable[[slice | torch.Tensor], torch.Tensor]

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}


@dataclass
class RestoreRecord:
    kind: str                                # "sparse" or "full"
    shape: tuple[int, ...]
    dtype: torch.dtype
    fingerprint: tuple[int, int]
    index: torch.Tensor | None = None        # flat indices where recomputation misses
    values: torch.Tensor | None = None       # original values there
    full: torch.Tensor | None = None         # fallback copy

    @property
    def nbytes(self) -> int:
        ts = (self.index, self.values, self.full)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    @property
    def exceptions(self) -> int:
        return int(self.index.numel()) if self.index is not None else -1


def row_chunks(rows: int, cols: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    # ~4 fp32 temporaries of chunk size live at once
    step = max(1, chunk_bytes // max(1, cols * 4 * 4))
    for r0 in range(0, rows, step):
        yield slice(r0, min(rows, r0 + step))


_FP_PERIOD = 65521
_FP_STEP = _FP_PERIOD * 64  # a multiple of the period: every chunk uses the same position weights
_fp_weights: dict = {}


def _position_weights(device) -> torch.Tensor:
    w = _fp_weights.get(device)
    if w is None:
        w = _fp_weights[device] = torch.arange(_FP_STEP, dtype=torch.int64, device=device) % _FP_PERIOD + 1
    return w


def fingerprint(w: torch.Tensor) -> tuple[int, int]:
    """Two integer checksums of the bit pattern (cheap; detects any restore slip):
    the sum of the bit patterns and their sum weighted by (position mod 65521) + 1."""
    flat = w.detach().reshape(-1).view(_INT_VIEW[w.dtype])
    pos = _position_weights(flat.device)
    s0 = s1 = 0
    for i in range(0, flat.numel(), _FP_STEP):
        part = flat[i : i + _FP_STEP].to(torch.int64)
        s0 += int(part.sum().item())
        s1 += int((part * pos[: part.numel()]).sum().item())
    return s0, s1


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_VIEW[t.dtype])


@torch.no_grad()
def merge_weight(weight: torch.Tensor, delta_rows: DeltaRows, *, what: str,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> RestoreRecord:
    """Fold the delta into `weight` in place; return what restores it bit for bit."""
    if weight.dtype not in _INT_VIEW:
        raise TypeError(f"{what}: cannot merge into dtype {weight.dtype}")
    w = weight.detach()
    rows, cols = w.shape
    fp = fingerprint(w)
    idx_parts, val_parts = [], []
    # pass 1: check and record; nothing is written
    for sl in row_chunks(rows, cols, chunk_bytes):
        wc = w[sl]
        d = delta_rows(sl)
        new = (wc.float() + d).to(w.dtype)
        bad = ~torch.isfinite(new) & torch.isfinite(wc)
        if bad.any():
            r, c = (bad.nonzero()[0] + torch.tensor([sl.start, 0], device=bad.device)).tolist()
            raise NonFiniteMergeError(
                f"{what}: merging would write a non-finite value at [{r}, {c}]; no weight was changed. "
                "The adapter's update at this strength does not fit this weight dtype (dynamic mode would give "
                "inf/NaN too): lower the strength, or load the model in bf16/fp32"
            )
        miss = _bits((new.float() - d).to(w.dtype)) != _bits(wc)
        if miss.any():
            flat = miss.reshape(-1).nonzero().squeeze(1) + sl.start * cols
            idx_parts.append(flat)
            val_parts.append(wc.reshape(-1)[flat - sl.start * cols].clone())
    n_miss = sum(p.numel() for p in idx_parts)
    idx_dtype = torch.int32 if w.numel() < 2**31 else torch.int64
    sparse_bytes = n_miss * (torch.tensor([], dtype=idx_dtype).element_size() + w.element_size())
    if sparse_bytes < w.numel() * w.element_size():
        index = torch.cat(idx_parts).to(idx_dtype) if idx_parts else torch.empty(0, dtype=idx_dtype, device=w.device)
        values = torch.cat(val_parts) if val_parts else torch.empty(0, dtype=w.dtype, device=w.device)
        record = RestoreRecord("sparse", tuple(w.shape), w.dtype, fp, index=index, values=values)
    else:
        record = RestoreRecord("full", tuple(w.shape), w.dtype, fp, full=w.clone())
    # pass 2: write
    for sl in row_chunks(rows, cols, chunk_bytes):
        w[sl] = (w[sl].float() + delta_rows(sl)).to(w.dtype)
    return record


@torch.no_grad()
def restore_weight(weight: torch.Tensor, record: RestoreRecord, delta_rows: DeltaRows, *, what: str,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Undo `merge_weight` bit for bit (never by subtracting alone)."""
    w = weight.detach()
    if w.dtype != record.dtype or tuple(w.shape) != record.shape:
        raise RestoreError(
            f"{what}: the weight became {w.dtype} {tuple(w.shape)} after the merge ({record.dtype} {record.shape}); "
            "something cast or replaced it while the adapter was merged, so it cannot be restored bit for bit. "
            "Reload the model, and use merge mode 'dynamic' with whatever changes the weight")
    if record.kind == "full":
        w.copy_(record.full)
    else:
        rows, cols = w.shape
        for sl in row_chunks(rows, cols, chunk_bytes):
            w[sl] = (w[sl].float() - delta_rows(sl)).to(w.dtype)
        if record.index.numel():  # the weight may have moved device since the merge (ComfyUI offload)
            w.view(-1)[record.index.to(w.device).long()] = record.values.to(w.device)
    if fingerprint(w) != record.fingerprint:
        raise RestoreError(
            f"{what}: the restored weight does not match the original fingerprint "
            "(the delta was not recomputed identically). Reload the model; please report this"
        )


@torch.no_grad()
def rounding_loss_sums(weight: torch.Tensor, delta_rows: DeltaRows, *, max_rows: int = 1024) -> tuple[float, float]:
    """(||round(W + dW) - W - dW||^2, ||dW||^2) over an even sample of rows; writes nothing.

    The rounding is to the weight's own dtype from the fp32 merge value, exactly as
    `merge_weight` does, so an fp32 weight reports 0.
    """
    w = weight.detach()
    rows = w.shape[0]
    if rows <= max_rows:
        sel: slice | torch.Tensor = slice(0, rows)
    else:
        sel = torch.linspace(0, rows - 1, max_rows, device=w.device).round().long().unique()
    wr = w[sel].float()
    d = delta_rows(sel)
    exact = wr + d
    err = exact.to(w.dtype).float() - exact
    return float(err.double().pow(2).sum()), float(d.double().pow(2).sum())
