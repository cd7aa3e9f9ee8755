"""Convolution updates with a Tucker core, rewritten at load as the matrix factors the
update types already take (same delta, same rank, so the same scale).

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
kernels are left alone (the update types take them as they are).
"""
from __future__ import annotations

import math

import torch

from ..errors import AdapterFormatError


def _ct(*ts) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _has_kernel(t) -> bool:
    return t is not None and t.dim() > 2 and any(k != 1 for k in t.shape[2:])


def fold_mid(mid: torch.Tensor, down: torch.Tensor, stem: str) -> torch.Tensor:
    """down' [r, in, k...] for a LoCon Tucker core."""
    if _has_kernel(down):
        raise AdapterFormatError(f"{stem}: lora_mid with a {tuple(down.shape[2:])} down kernel; a Tucker LoCon has "
                                 "a 1x1 down convolution")
    d = down.reshape(down.shape[0], down.shape[1])
    if mid.dim() < 2 or mid.shape[1] != d.shape[0]:
        raise AdapterFormatError(f"{stem}: lora_mid {tuple(mid.shape)} does not fit lora_down {tuple(down.shape)} "
                                 f"(it must be [rank, {d.shape[0]}, kernel...])")
    ct = _ct(mid, down)
    return torch.einsum("mn...,nj->mj...", mid.to(ct), d.to(ct)).contiguous()


def _core_pair(t: torch.Tensor, a: torch.Tensor, b: torch.Tensor, names: tuple[str, str, str], stem: str):
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
    ct = _ct(t, a, b)
    right = torch.einsum("ij...,jr->ir...", t.to(ct), b2.to(ct))
    return a2.to(ct).t().contiguous(), right.reshape(right.shape[0], -1).contiguous()


def fold(parts: dict, stem: str) -> tuple[dict, tuple[int, ...]]:
    """(parts with every kernel-sized Tucker core folded into matrix factors, the conv kernel
    or ()). Parts without such a core come back unchanged."""
    out = dict(parts)
    kernel: tuple[int, ...] = ()
    if "lora_mid.weight" in out and "down" in out:
        mid = out.pop("lora_mid.weight")
        out["down"] = fold_mid(mid, out["down"], stem)
    t1, t2 = out.get("hada_t1"), out.get("hada_t2")
    if _has_kernel(t1) or _has_kernel(t2):
        if t1 is None or t2 is None or t1.shape[2:] != t2.shape[2:]:
            raise AdapterFormatError(f"{stem}: hada_t1 and hada_t2 must both be present with the same kernel")
        for i, t in ((1, t1), (2, t2)):
            a, b = _core_pair(t, out[f"hada_w{i}_a"], out[f"hada_w{i}_b"],
                              (f"hada_t{i}", f"hada_w{i}_a", f"hada_w{i}_b"), stem)
            out[f"hada_w{i}_a"], out[f"hada_w{i}_b"] = a, b
            del out[f"hada_t{i}"]
        kernel = tuple(int(k) for k in t1.shape[2:])
    t = out.get("lokr_t2")
    if _has_kernel(t):
        if "lokr_w2_a" not in out or "lokr_w2_b" not in out:
            raise AdapterFormatError(f"{stem}: lokr_t2 without lokr_w2_a / lokr_w2_b")
        out["lokr_w2_a"], out["lokr_w2_b"] = _core_pair(t, out["lokr_w2_a"], out["lokr_w2_b"],
                                                        ("lokr_t2", "lokr_w2_a", "lokr_w2_b"), stem)
        del out["lokr_t2"]
        kernel = tuple(int(k) for k in t.shape[2:])
    w2 = out.get("lokr_w2")
    if _has_kernel(w2):  # a full conv w2 [out2, in2, k...] (no core): the same flattening
        out["lokr_w2"] = w2.reshape(w2.shape[0], -1)
        kernel = tuple(int(k) for k in w2.shape[2:])
    assert not kernel or math.prod(kernel) > 1
    return out, kernel
