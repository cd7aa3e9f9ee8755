"""LoKr (LyCORIS): delta = scale * kron(w1, w2), w1 [a, b], w2 [c, d], out = a*c, in = b*d.

Keys: ``lokr_w1`` or ``lokr_w1_a`` [a, r1] + ``lokr_w1_b`` [r1, b]; ``lokr_w2`` or ``lokr_w2_a`` [c, r2] +
``lokr_w2_b`` [r2, d]; Tucker adds ``lokr_t2`` [ra, rb] (w2 = w2_a^T t2 w2_b, factorised w2 only).
Scale: ``alpha / dim`` with dim = ``lokr_w2_b`` rows when w2 is factorised, else ``lokr_w1_b`` rows;
1.0 without alpha or when both sides are full (alpha is then ignored).
`forward` never builds the dense delta: y viewed as [..., a, c] is (w1 @ X) @ w2^T for X [..., b, d].
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import AdapterFormatError
from ..scaling import combined_factor, times
from .base import Update, as_linear, rows_on, squeeze_factors, swap_halves
from .conv_cores import core_pair, has_kernel
from .trace_forms import TraceForm

_NAMES = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


class LoKr(Update):
    kind = "lokr"
    label = "LoKr"
    KEY_PARTS = ((re.compile(r"^(?:" + "|".join(_NAMES) + r")$"), ""),)
    ROLES = _NAMES
    FILE_KEYS = ((re.compile(r"\.(?P<name>lokr_w[12](?:_[ab])?|lokr_t2)$"), "{name}"),)
    FORMATS = ((1, FILE_KEYS[0][0], "lycoris-lokr"),)
    SUPPORTED = "LoKr (lokr_*)"
    takes_dora = True
    scaled_by_alpha = True

    @classmethod
    def to_matrices(cls, parts, stem):
        """A kernel-sized Tucker core folded into w2's pair (`conv_cores`), a full conv w2 flattened
        to [out2, in2 * K]; 1x1 factors squeezed."""
        kernel: tuple[int, ...] = ()
        t = parts.get("lokr_t2")
        if has_kernel(t):
            if "lokr_w2_a" not in parts or "lokr_w2_b" not in parts:
                raise AdapterFormatError(f"{stem}: lokr_t2 without lokr_w2_a / lokr_w2_b")
            parts["lokr_w2_a"], parts["lokr_w2_b"] = core_pair(t, parts["lokr_w2_a"], parts["lokr_w2_b"],
                                                               ("lokr_t2", "lokr_w2_a", "lokr_w2_b"), stem)
            del parts["lokr_t2"]
            kernel = tuple(int(k) for k in t.shape[2:])
        w2 = parts.get("lokr_w2")
        if has_kernel(w2):  # a full conv w2 [out2, in2, k...] (no core): the same flattening
            parts["lokr_w2"] = w2.reshape(w2.shape[0], -1)
            kernel = tuple(int(k) for k in w2.shape[2:])
        squeeze_factors(parts, "lokr_")
        return kernel

    def __init__(self, *, w1: Tensor | None = None, w1_a: Tensor | None = None, w1_b: Tensor | None = None,
                 w2: Tensor | None = None, w2_a: Tensor | None = None, w2_b: Tensor | None = None,
                 t2: Tensor | None = None, alpha: float | None = None, stem: str = "",
                 diff_b: Tensor | None = None):
        super().__init__(stem, alpha, diff_b)
        s = self.stem
        for side, full, fa, fb in ((1, w1, w1_a, w1_b), (2, w2, w2_a, w2_b)):
            if full is not None and (fa is not None or fb is not None):
                raise self._err(f"both lokr_w{side} and lokr_w{side}_a/_b are present; keep one form")
            if full is None and (fa is None or fb is None):
                have = [n for n, t in ((f"lokr_w{side}_a", fa), (f"lokr_w{side}_b", fb)) if t is not None]
                raise self._err(f"LoKr needs lokr_w{side} or lokr_w{side}_a + lokr_w{side}_b; "
                                f"found {have or 'neither'}")
        if t2 is not None and w2 is not None:
            raise self._err("lokr_t2 (Tucker) needs the factorised lokr_w2_a/lokr_w2_b, not lokr_w2")
        cv = lambda t, n: None if t is None else as_linear(t, s, n)  # noqa: E731
        self.w1, self.w1_a, self.w1_b = cv(w1, "lokr_w1"), cv(w1_a, "lokr_w1_a"), cv(w1_b, "lokr_w1_b")
        self.w2, self.w2_a, self.w2_b = cv(w2, "lokr_w2"), cv(w2_a, "lokr_w2_a"), cv(w2_b, "lokr_w2_b")
        self.t2 = cv(t2, "lokr_t2")
        if self.w1 is None and self.w1_a.shape[1] != self.w1_b.shape[0]:
            raise self._err(f"lokr_w1_a is {tuple(self.w1_a.shape)} and lokr_w1_b is {tuple(self.w1_b.shape)}: "
                            "inner sizes differ")
        if self.w2 is None:
            if self.t2 is None and self.w2_a.shape[1] != self.w2_b.shape[0]:
                raise self._err(f"lokr_w2_a is {tuple(self.w2_a.shape)} and lokr_w2_b is "
                                f"{tuple(self.w2_b.shape)}: inner sizes differ")
            if self.t2 is not None and self.t2.shape != (self.w2_a.shape[0], self.w2_b.shape[0]):
                raise self._err(f"lokr_t2 is {tuple(self.t2.shape)}; with lokr_w2_a {tuple(self.w2_a.shape)} "
                                f"[ra, c] and lokr_w2_b {tuple(self.w2_b.shape)} [rb, d] it must be "
                                f"[{self.w2_a.shape[0]}, {self.w2_b.shape[0]}]")
        self.check_bias()

    @classmethod
    def from_roles(cls, roles, names, alpha, *, stem, diff_b=None, **_):
        g = roles.get
        return cls(w1=g("lokr_w1"), w1_a=g("lokr_w1_a"), w1_b=g("lokr_w1_b"), w2=g("lokr_w2"),
                   w2_a=g("lokr_w2_a"), w2_b=g("lokr_w2_b"), t2=g("lokr_t2"), alpha=alpha, stem=stem)

    # shapes of the two Kronecker factors
    @property
    def w1_shape(self) -> tuple[int, int]:
        return tuple(self.w1.shape) if self.w1 is not None else (int(self.w1_a.shape[0]), int(self.w1_b.shape[1]))

    @property
    def w2_shape(self) -> tuple[int, int]:
        if self.w2 is not None:
            return tuple(self.w2.shape)
        c = self.w2_a.shape[1] if self.t2 is not None else self.w2_a.shape[0]
        return int(c), int(self.w2_b.shape[1])

    @property
    def dim(self) -> int | None:
        """ComfyUI's rank for the scale: w2_b rows if w2 is factorised, else w1_b rows, else None."""
        if self.w2 is None:
            return int(self.w2_b.shape[0])
        if self.w1 is None:
            return int(self.w1_b.shape[0])
        return None

    @property
    def ignores_alpha(self) -> bool:
        """Both Kronecker factors are full: the scale is 1.0 whatever alpha says."""
        return self.dim is None

    @property
    def scale(self) -> float:
        return 1.0 if self.alpha is None or self.dim is None else self.alpha / self.dim

    @property
    def out_features(self) -> int:
        return self.w1_shape[0] * self.w2_shape[0]

    @property
    def in_features(self) -> int:
        return self.w1_shape[1] * self.w2_shape[1]

    def swapped_halves(self) -> "LoKr | None":
        """Row p*c + q of kron(w1 [a, b], w2 [c, d]) is w1[p] x w2[q]. With a even, the first half of
        the rows is p < a/2: exchanging the halves is exchanging the halves of w1's rows. With a = 1
        the rows are w2's: exchange those (w2_a's rows; with Tucker, w2_a is [ra, c]: its columns).
        Otherwise (a odd, > 1) the halves cut through a Kronecker block: None (`why_not_swapped`)."""
        a, c = self.w1_shape[0], self.w2_shape[0]
        if (a * c) % 2:
            return None
        w1, w1_a, w2, w2_a = self.w1, self.w1_a, self.w2, self.w2_a
        if a % 2 == 0:
            w1, w1_a = swap_halves(w1), swap_halves(w1_a)
        elif a == 1:
            if w2 is not None:
                w2 = swap_halves(w2)
            elif self.t2 is None:
                w2_a = swap_halves(w2_a)
            else:
                n = c // 2
                w2_a = torch.cat([w2_a[:, n:], w2_a[:, :n]], dim=1)
        else:
            return None
        return LoKr(w1=w1, w1_a=w1_a, w1_b=self.w1_b, w2=w2, w2_a=w2_a, w2_b=self.w2_b, t2=self.t2,
                    alpha=self.alpha, stem=self.stem, diff_b=swap_halves(self.diff_b))

    def why_not_swapped(self) -> str:
        a, c = self.w1_shape[0], self.w2_shape[0]
        if (a * c) % 2:
            return f"a LoKr update with an odd number of output rows ({a * c}) has no two halves"
        return (f"a LoKr update whose w1 has an odd number of rows ({a}, > 1) cannot be reordered: the two "
                f"halves of kron(w1, w2) cut through a Kronecker block (rows {a // 2 * c}..{(a // 2 + 1) * c - 1}), "
                "so the exchanged rows are no Kronecker product of two factors")

    def tensors(self) -> dict[str, Tensor]:
        vals = (self.w1, self.w1_a, self.w1_b, self.w2, self.w2_a, self.w2_b, self.t2)
        t = {n: v for n, v in zip(_NAMES, vals) if v is not None}
        if self.diff_b is not None:
            t["diff_b"] = self.diff_b
        return t

    def kron_factors(self, device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Dense (w1 [a, b], w2 [c, d]) on device in dtype, unscaled; cached."""
        return self._w1(device, dtype), self._w2(device, dtype)

    # contiguous: torch.kron fails on some non-contiguous inputs (einsum/transposed outputs)
    def _w1(self, device, dtype: torch.dtype) -> Tensor:
        def make():
            return self.w1 if self.w1 is not None else self.w1_a.double() @ self.w1_b.double()
        return self._on(device, dtype, "w1", lambda: make().contiguous())

    def _w2(self, device, dtype: torch.dtype) -> Tensor:
        def make():
            if self.w2 is not None:
                return self.w2
            if self.t2 is not None:
                return (self.w2_a.double().t() @ self.t2.double()) @ self.w2_b.double()
            return self.w2_a.double() @ self.w2_b.double()
        return self._on(device, dtype, "w2", lambda: make().contiguous())

    def _delta(self, device, ct, rows, weight) -> Tensor:
        w1, w2 = self.kron_factors(device, ct)
        if rows is None:
            return times(torch.kron(w1, w2), self.scale, inplace=True)
        c = w2.shape[0]
        idx = torch.arange(self.out_features, device=device)[rows_on(rows, device)]
        p, q = idx // c, idx % c
        block = w1[p].unsqueeze(2) * w2[q].unsqueeze(1)  # [n, b, d]
        return times(block.reshape(idx.numel(), -1), self.scale, inplace=True)

    def _w2_factored(self) -> bool:
        """Run w2 = w2_a w2_b as two thin GEMMs (under half the dense product's flops)?"""
        if self.w2 is not None or self.t2 is not None:
            return False
        r, (c, d) = int(self.w2_b.shape[0]), self.w2_shape
        return 2 * r * (c + d) < c * d

    def _forward(self, x, factor, base_out_nobias, weight) -> Tensor:
        w1 = times(self._w1(x.device, x.dtype), combined_factor(self.scale, factor))  # the smaller factor
        b, d = w1.shape[1], self.w2_shape[1]
        xv = x.reshape(*x.shape[:-1], b, d)
        # mix over w1 first, on the input-sized [..., b, d] -> [..., a, d] (cheap), so the only
        # output-sized tensor is the final one: y[..., p, :] = (sum_j w1[p, j] X[..., j, :]) w2^T
        u = torch.matmul(w1, xv)
        if self._w2_factored():
            w2a = self._on(x.device, x.dtype, "w2_a", lambda: self.w2_a)
            w2b = self._on(x.device, x.dtype, "w2_b", lambda: self.w2_b)
            y = F.linear(F.linear(u, w2b), w2a)
        else:
            y = F.linear(u, self._w2(x.device, x.dtype))  # [..., a, c]
        return y.reshape(*x.shape[:-1], self.out_features)

    def trace_form(self, device, dtype: torch.dtype, weight: Tensor | None = None):
        w1 = self._w1(device, dtype)
        if self._w2_factored():   # the dense w2 is never formed
            return KronForm(w1, self._on(device, dtype, "w2_a", lambda: self.w2_a),
                            self._on(device, dtype, "w2_b", lambda: self.w2_b)), self.scale
        return KronForm(w1, self._w2(device, dtype)), self.scale


class KronForm(TraceForm):
    """w1 [p, q], w2 [c, d]: x through kron(w1, w2) without forming it; with three tensors
    (w1, w2a [c, r], w2b [r, d]) w2 = w2a w2b stays factorised."""

    @property
    def kind(self) -> str:
        return "kron" if len(self.tensors) == 2 else "kron2"

    def out(self, x: Tensor, y0: Tensor | None = None) -> Tensor:
        w1 = self.tensors[0]
        q = w1.shape[1]
        lead = x.shape[:-1]
        u = torch.matmul(w1, x.reshape(*lead, q, x.shape[-1] // q))   # [..., p, d]: mix over w1 first
        if len(self.tensors) == 2:
            y = F.linear(u, self.tensors[1])
        else:
            y = F.linear(F.linear(u, self.tensors[2]), self.tensors[1])
        return y.reshape(*lead, -1)
