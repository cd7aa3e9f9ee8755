"""LoHa (LyCORIS): delta = scale * (W1a W1b) ⊙ (W2a W2b).

Keys: ``hada_w1_a`` [out, r1], ``hada_w1_b`` [r1, in], ``hada_w2_a``, ``hada_w2_b``; CP/Tucker adds
``hada_t1`` and ``hada_t2`` (both or neither; then w_a is [ra, out] and each factor is w_a^T t w_b).
Scale: ``alpha / hada_w1_b.shape[0]``; no alpha: 1.0.
`forward` runs the rank-k1*k2 Khatri-Rao pair when that is cheaper than the dense delta, else the
dense delta cached per (device, dtype).
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import AdapterFormatError
from ..scaling import combined_factor, times
from .base import Update, as_linear, compute_dtype, rows_on, squeeze_factors, swap_halves
from .conv_cores import core_pair, has_kernel
from .trace_forms import DenseForm, PairForm

_NAMES = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")


class LoHa(Update):
    kind = "loha"
    label = "LoHa"
    KEY_PARTS = ((re.compile(r"^(?:" + "|".join(_NAMES) + r")$"), ""),)
    ROLES = _NAMES
    FILE_KEYS = ((re.compile(r"\.(?P<name>hada_w[12]_[ab]|hada_t[12])$"), "{name}"),)
    FORMATS = ((1, FILE_KEYS[0][0], "lycoris-loha"),)
    SUPPORTED = "LoHa (hada_*)"
    takes_dora = True
    scaled_by_alpha = True

    @classmethod
    def to_matrices(cls, parts, stem):
        """Kernel-sized CP cores folded into the plain pairs (`conv_cores`); 1x1 factors squeezed."""
        kernel: tuple[int, ...] = ()
        t1, t2 = parts.get("hada_t1"), parts.get("hada_t2")
        if has_kernel(t1) or has_kernel(t2):
            if t1 is None or t2 is None or t1.shape[2:] != t2.shape[2:]:
                raise AdapterFormatError(f"{stem}: hada_t1 and hada_t2 must both be present with the same kernel")
            for i, t in ((1, t1), (2, t2)):
                a, b = core_pair(t, parts[f"hada_w{i}_a"], parts[f"hada_w{i}_b"],
                                 (f"hada_t{i}", f"hada_w{i}_a", f"hada_w{i}_b"), stem)
                parts[f"hada_w{i}_a"], parts[f"hada_w{i}_b"] = a, b
                del parts[f"hada_t{i}"]
            kernel = tuple(int(k) for k in t1.shape[2:])
        squeeze_factors(parts, "hada_")
        return kernel

    def __init__(self, w1a: Tensor, w1b: Tensor, w2a: Tensor, w2b: Tensor, alpha: float | None = None, *,
                 t1: Tensor | None = None, t2: Tensor | None = None, stem: str = "",
                 diff_b: Tensor | None = None):
        super().__init__(stem, alpha, diff_b)
        if (t1 is None) != (t2 is None):
            raise self._err("hada_t1 and hada_t2 come together (CP decomposition); only one is present")
        s = self.stem
        self.w1a, self.w1b = as_linear(w1a, s, "hada_w1_a"), as_linear(w1b, s, "hada_w1_b")
        self.w2a, self.w2b = as_linear(w2a, s, "hada_w2_a"), as_linear(w2b, s, "hada_w2_b")
        self.t1 = None if t1 is None else as_linear(t1, s, "hada_t1")
        self.t2 = None if t2 is None else as_linear(t2, s, "hada_t2")
        self._check_side(1, self.w1a, self.w1b, self.t1)
        self._check_side(2, self.w2a, self.w2b, self.t2)
        if (self._out(1), self.w1b.shape[1]) != (self._out(2), self.w2b.shape[1]):
            raise self._err(f"the two Hadamard factors differ: [{self._out(1)}, {self.w1b.shape[1]}] "
                            f"(hada_w1_*) vs [{self._out(2)}, {self.w2b.shape[1]}] (hada_w2_*)")
        self.check_bias()

    @classmethod
    def from_roles(cls, roles, names, alpha, *, stem, diff_b=None, **_):
        need = _NAMES[:4]
        missing = [n for n in need if n not in roles]
        if missing:
            raise AdapterFormatError(f"{stem}: LoHa is missing {missing}")
        return cls(*(roles[n] for n in need), alpha, t1=roles.get("hada_t1"), t2=roles.get("hada_t2"), stem=stem)

    @property
    def cp(self) -> bool:
        return self.t1 is not None

    def _out(self, i: int) -> int:
        a = self.w1a if i == 1 else self.w2a
        return int(a.shape[1] if self.cp else a.shape[0])

    def _check_side(self, i: int, a: Tensor, b: Tensor, t: Tensor | None) -> None:
        n = f"hada_w{i}"
        if t is None:
            if a.shape[1] != b.shape[0]:
                raise self._err(f"{n}_a is {tuple(a.shape)} and {n}_b is {tuple(b.shape)}: "
                                f"{n}_a [out, r] needs as many columns as {n}_b [r, in] has rows")
        elif t.shape != (a.shape[0], b.shape[0]):
            raise self._err(f"hada_t{i} is {tuple(t.shape)}; with {n}_a {tuple(a.shape)} [ra, out] and "
                            f"{n}_b {tuple(b.shape)} [rb, in] it must be [{a.shape[0]}, {b.shape[0]}]")

    @property
    def scale(self) -> float:
        return 1.0 if self.alpha is None else self.alpha / int(self.w1b.shape[0])

    @property
    def out_features(self) -> int:
        return self._out(1)

    @property
    def in_features(self) -> int:
        return int(self.w1b.shape[1])

    def swapped_halves(self) -> "LoHa | None":
        """Row i of the delta is row i of both factors: exchange the halves of each factor's output
        side (the rows of w_a; with CP, w_a is [ra, out]: its columns)."""
        if self.out_features % 2:
            return None
        if self.cp:
            def side(a):
                n = a.shape[1] // 2
                return torch.cat([a[:, n:], a[:, :n]], dim=1)
        else:
            side = swap_halves
        return LoHa(side(self.w1a), self.w1b, side(self.w2a), self.w2b, self.alpha, t1=self.t1, t2=self.t2,
                    stem=self.stem, diff_b=swap_halves(self.diff_b))

    def why_not_swapped(self) -> str:
        return f"a LoHa update with an odd number of output rows ({self.out_features}) has no two halves"

    def tensors(self) -> dict[str, Tensor]:
        t = {"hada_w1_a": self.w1a, "hada_w1_b": self.w1b, "hada_w2_a": self.w2a, "hada_w2_b": self.w2b}
        if self.cp:
            t.update(hada_t1=self.t1, hada_t2=self.t2)
        if self.diff_b is not None:
            t["diff_b"] = self.diff_b
        return t

    def _factor(self, i: int, device, ct, rows) -> Tensor:
        a = self._on(device, ct, f"w{i}a", lambda: self.w1a if i == 1 else self.w2a)
        b = self._on(device, ct, f"w{i}b", lambda: self.w1b if i == 1 else self.w2b)
        r = rows_on(rows, device)
        if not self.cp:
            return (a if rows is None else a[r]) @ b
        t = self._on(device, ct, f"t{i}", lambda: self.t1 if i == 1 else self.t2)
        a_sel = a if rows is None else a[:, r]
        return (a_sel.t() @ t) @ b

    def _delta(self, device, ct, rows, weight) -> Tensor:
        m = self._factor(1, device, ct, rows)
        return times(m.mul_(self._factor(2, device, ct, rows)), self.scale, inplace=True)

    def _pair(self, i: int, device, ct) -> tuple[Tensor, Tensor]:
        """Factor i as (left [out, k], right [k, in]); CP: left = w_a^T t, right = w_b."""
        a = self._on(device, ct, f"w{i}a", lambda: self.w1a if i == 1 else self.w2a)
        b = self._on(device, ct, f"w{i}b", lambda: self.w1b if i == 1 else self.w2b)
        if not self.cp:
            return a, b
        t = self._on(device, ct, f"t{i}", lambda: self.t1 if i == 1 else self.t2)
        return a.t() @ t, b

    @property
    def hadamard_rank(self) -> int:
        """Rank of the factorised form of the update: k1 * k2."""
        return int(self.w1b.shape[0]) * int(self.w2b.shape[0])

    @property
    def _low_rank(self) -> bool:
        """Is the rank-k1*k2 form cheaper than the dense delta?"""
        o, i = self.out_features, self.in_features
        return self.hadamard_rank * (o + i) < o * i

    def _kr(self, device, dtype) -> tuple[Tensor, Tensor]:
        """(U [out, k], Z [k, in]), unscaled, cached: (L1 R1) ⊙ (L2 R2) = U Z with
        U[o,(p,q)] = L1[o,p] L2[o,q] and Z[(p,q),j] = R1[p,j] R2[q,j] (row-wise Khatri-Rao
        products): a rank-k1*k2 LoRA, no dense [out, in] delta."""
        key = ("kr", str(device), dtype)
        uz = self._cache.get(key)
        if uz is None:
            o, i, k, ct = self.out_features, self.in_features, self.hadamard_rank, compute_dtype(dtype)
            (l1, r1), (l2, r2) = self._pair(1, device, ct), self._pair(2, device, ct)
            u = (l1.unsqueeze(2) * l2.unsqueeze(1)).reshape(o, k)
            z = (r1.unsqueeze(1) * r2.unsqueeze(0)).reshape(k, i)
            uz = self._cache[key] = (u.to(dtype).contiguous(), z.to(dtype).contiguous())
        return uz

    def _dense(self, device, dtype) -> Tensor:
        """The dense delta (times scale) in `dtype`, cached."""
        key = ("dense", str(device), dtype)
        d = self._cache.get(key)
        if d is None:
            d = self._cache[key] = self._delta(device, compute_dtype(dtype), None, None).to(dtype)
        return d

    def _forward(self, x, factor, base_out_nobias, weight) -> Tensor:
        if self._low_rank:
            u, z = self._kr(x.device, x.dtype)
            h = times(F.linear(x, z), combined_factor(self.scale, factor))
            return F.linear(h, u)
        return times(F.linear(x, self._dense(x.device, x.dtype)), factor)

    def trace_form(self, device, dtype: torch.dtype, weight: Tensor | None = None):
        if self._low_rank:
            u, z = self._kr(device, dtype)
            return PairForm(z, u), self.scale
        return DenseForm(self._dense(device, dtype)), 1.0
