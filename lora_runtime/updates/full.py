"""Full weight deltas: ``diff`` ([out, in]) and a bare ``diff_b`` output offset ([out]).

Scale: none (1.0); alpha is ignored. ``diff_b`` may ride on any update; alone it is `BiasOnly`.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import AdapterFormatError
from ..scaling import times
from .base import Update, as_linear, rows_on, swap_halves
from .trace_forms import DenseForm


class Full(Update):
    """A full weight delta (``diff``, [out, in]); no scale."""

    kind = "diff"
    label = "diff"
    KEY_PARTS = ((re.compile(r"^diff$"), ""),)
    ROLES = ("diff",)
    FILE_KEYS = ((re.compile(r"\.diff$"), "diff"),)
    FORMATS = ((3, re.compile(r"\.diff$"), "diff"),)
    SUPPORTED = "diff"
    takes_dora = False
    dora_refusal = "with a full 'diff' (ComfyUI applies DoRA to LoRA/LoHa/LoKr only)"

    def __init__(self, diff: Tensor, alpha: float | None = None, *, stem: str = "", diff_b: Tensor | None = None):
        super().__init__(stem, alpha, diff_b)
        self.diff = as_linear(diff, self.stem, "diff")
        self.check_bias()

    @classmethod
    def to_matrices(cls, parts, stem):
        """A conv diff [out, in, k...] flattened to [out, in * K]."""
        diff = parts.get("diff")
        if diff is None or diff.dim() <= 2:
            return ()
        parts["diff"] = diff.reshape(diff.shape[0], -1)
        return tuple(int(k) for k in diff.shape[2:])

    @classmethod
    def from_roles(cls, roles, names, alpha, *, stem, diff_b=None, **_):
        return cls(roles["diff"], alpha, stem=stem, diff_b=diff_b)

    @property
    def scale(self) -> float:
        return 1.0

    @property
    def out_features(self) -> int:
        return int(self.diff.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.diff.shape[1])

    def swapped_halves(self) -> "Full":
        return Full(swap_halves(self.diff), stem=self.stem, diff_b=swap_halves(self.diff_b))

    def tensors(self) -> dict[str, Tensor]:
        t = {"diff": self.diff}
        if self.diff_b is not None:
            t["diff_b"] = self.diff_b
        return t

    def _delta(self, device, ct, rows, weight) -> Tensor:
        d = self.diff if rows is None else self.diff[rows_on(rows, self.diff.device)]
        return d.to(device=device, dtype=ct, copy=True)

    def _forward(self, x, factor, base_out_nobias, weight) -> Tensor:
        return times(F.linear(x, self._on(x.device, x.dtype, "diff", lambda: self.diff)), factor)

    def trace_form(self, device, dtype: torch.dtype, weight: Tensor | None = None):
        return DenseForm(self._on(device, dtype, "diff", lambda: self.diff)), 1.0


class BiasOnly(Update):
    """Only a ``diff_b`` output offset: no weight delta. `in_features` is unknown until
    `check_module` (or a `weight` passed to `delta`) tells it."""

    kind = "diff_b"
    label = "diff_b"

    def __init__(self, diff_b: Tensor, alpha: float | None = None, *, stem: str = ""):
        if diff_b is None:
            raise AdapterFormatError(f"{stem or '<layer>'}: BiasOnly needs diff_b")
        super().__init__(stem, alpha, diff_b)
        self._in: int | None = None

    @property
    def scale(self) -> float:
        return 1.0

    @property
    def out_features(self) -> int:
        return int(self.diff_b.numel())

    @property
    def in_features(self) -> int | None:
        return self._in

    @property
    def has_weight_delta(self) -> bool:
        return False

    def check_module(self, out_features: int, in_features: int) -> None:
        super().check_module(out_features, in_features)
        self._in = int(in_features)

    def swapped_halves(self) -> "BiasOnly":
        return BiasOnly(swap_halves(self.diff_b), stem=self.stem)

    def tensors(self) -> dict[str, Tensor]:
        return {"diff_b": self.diff_b}

    def _delta(self, device, ct, rows, weight) -> Tensor:
        n_in = int(weight.shape[1]) if weight is not None else self._in
        if n_in is None:
            raise self._err("a diff_b-only layer has no weight delta and its input size is unknown; "
                            "call check_module(out, in) first or pass weight=")
        n = self.out_features if rows is None else torch.arange(self.out_features)[rows].numel()
        return torch.zeros(n, n_in, device=device, dtype=ct)

    def _forward(self, x, factor, base_out_nobias, weight) -> Tensor:
        return x.new_zeros(*x.shape[:-1], self.out_features)
