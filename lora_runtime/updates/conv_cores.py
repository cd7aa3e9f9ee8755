"""Convolution cores: the helpers the update types use to read a convolution update (LoCon)
as the matrix factors they already take (same delta, same rank, so the same scale).

A conv weight [out, in, k...] is handled as the matrix [out, in * K] (K = prod(k)), the
in index major. With that flattening (facts as ComfyUI and LyCORIS define the cores):

- LoCon ``lora_mid`` [r, r, k...] between ``lora_down`` [r, in, 1...] and ``lora_up``
  [out, r, 1...]: delta = up @ down' with down'[m, (j, k)] = sum_n mid[m, n, k] down[n, j].
- LoHa ``hada_t1`` / ``hada_t2`` [ra, rb, k...] with ``hada_wN_a`` [ra, out] and
  ``hada_wN_b`` [rb, in]: factor N [p, (r, k)] = sum_i wN_a[i, p] (sum_j tN[i, j, k] wN_b[j, r]),
  i.e. the plain pair a' = wN_a^T [out, ra], b' [ra, in * K].
- LoKr ``lokr_t2`` [ra, rb, k...] with ``lokr_w2_a`` [ra, out2] and ``lokr_w2_b`` [rb, in2]:
  w2 the same way (a' [out2, ra], b' [ra, in2 * K]); kron(w1, w2 [out2, in2 * K]) is then
  the flattened kron of w1 with the conv kernel w2 (a full conv ``lokr_w2`` [out2, in2, k...]
  is flattened the same way).

The folded factors are computed in fp32 (fp64 if given) and kept so. Cores with 1x1
kernels are left alone (the update types take them as they are). Each type folds its own
parts (`Update.to_matrices`).
"""
from __future__ import annotations

import torch

from ..errors import AdapterFormatError


def compute_dtype_of(*ts) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def has_kernel(t) -> bool:
    return t is not None and t.dim() > 2 and any(k != 1 for k in t.shape[2:])


def fold_mid(mid: torch.Tensor, down: torch.Tensor, stem: str) -> torch.Tensor:
    """down' [r, in, k...] for a LoCon Tucker core."""
    if has_kernel(down):
        raise AdapterFormatError(f"{stem}: lora_mid with a {tuple(down.shape[2:])} down kernel; a Tucker LoCon has "
                                 "a 1x1 down convolution")
    d = down.reshape(down.shape[0], down.shape[1])
    if mid.dim() < 2 or mid.shape[1] != d.shape[0]:
        raise AdapterFormatError(f"{stem}: lora_mid {tuple(mid.shape)} does not fit lora_down {tuple(down.shape)} "
                                 f"(it must be [rank, {d.shape[0]}, kernel...])")
    ct = compute_dtype_of(mid, down)
    return torch.einsum("mn...,nj->mj...", mid.to(ct), d.to(ct)).contiguous()


def core_pair(t: torch.Tensor, a: torch.Tensor, b: torch.Tensor, names: tuple[str, str, str], stem: str):
    """(a' [out, ra], b' [ra, in * K]) for a core t [ra, rb, k...], a [ra, out], b [rb, in]."""
    tn, an, bn = names
    a2 = a.reshape(a.shape[0], -1) if a.dim() > 2 else a
    b2 = b.reshape(b.shape[0], -1) if b.dim() > 2 else b
    if a2.dim() != 2 or b2.dim() != 2 or t.shape[0] != a2.shape[0] or t.shape[1] != b2.shape[0]:
        raise AdapterFormatError(f"{stem}: {tn} {tuple(t.shape)} does not fit {an} {tuple(a.shape)} [rank, out] and "
                                 f"{bn} {tuple(b.shape)} [rank, in]")
    if t.shape[0] != t.shape[1]:
        raise AdapterFormatError(f"{stem}: {tn} {tuple(t.shape)} is not square in its ranks; the scale's rank "
                                 "would be ambiguous")
    ct = compute_dtype_of(t, a, b)
    right = torch.einsum("ij...,jr->ir...", t.to(ct), b2.to(ct))
    return a2.to(ct).t().contiguous(), right.reshape(right.shape[0], -1).contiguous()
