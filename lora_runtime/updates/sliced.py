"""Updates on output-row slices of one fused weight (Flux ``to_q``/``to_k``/``to_v`` -> ``qkv``,
single-block ``proj_mlp`` -> ``linear1``, ...). Built by the matcher, never from keys.

``parts`` is a list of ``(start, stop, update)``: each update lands in rows [start, stop) of the
[out_features, in] weight; rows no part covers get zero. Parts may not overlap. Each part keeps
its own scale and its own ``diff_b`` (gathered here into one [out] offset with zeros elsewhere).
DoRA parts get ``weight[start:stop]``. `stack()` is None: a fused kernel takes one full-width pair.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor

from ..errors import AdapterFormatError
from .base import Update, rows_on
from .trace_forms import TraceForm


class Sliced(Update):
    kind = "sliced"
    label = "sliced"

    def __init__(self, parts, out_features: int, *, stem: str = ""):
        # shallow copies: the parts' diff_b move into this offset without touching the
        # updates the caller (a cached adapter) keeps
        parts = sorted(((int(a), int(b), copy.copy(v)) for a, b, v in parts), key=lambda p: p[0])
        if not parts:
            raise AdapterFormatError(f"{stem or '<layer>'}: no slices")
        bias = None
        if any(v.diff_b is not None for _, _, v in parts):
            bias = torch.zeros(int(out_features), dtype=torch.float32)
            for a, b, v in parts:
                if v.diff_b is not None:
                    bias[a:b] = v.diff_b.float()
                    v.diff_b = None
        super().__init__(stem, None, bias)
        self.parts = parts
        self._out = int(out_features)
        ins = {v.in_features for _, _, v in parts} - {None}
        if len(ins) > 1:
            raise self._err(f"the slices' updates have different input sizes {sorted(ins)}")
        self._in = ins.pop() if ins else None
        prev = 0
        for a, b, v in parts:
            if a < prev or b > self._out or b - a != v.out_features:
                raise self._err(f"slice [{a}, {b}) of a {self._out}-row weight overlaps another slice, lies "
                                f"outside the weight or does not fit its {v.out_features}-row update")
            prev = b

    @property
    def scale(self) -> float:
        return 1.0

    @property
    def out_features(self) -> int:
        return self._out

    @property
    def in_features(self) -> int | None:
        return self._in

    @property
    def row_parts(self) -> list:
        return self.parts

    @property
    def needs_weight(self) -> bool:
        return any(v.needs_weight for _, _, v in self.parts)

    @property
    def has_weight_delta(self) -> bool:
        return any(v.has_weight_delta for _, _, v in self.parts)

    def check_module(self, out_features: int, in_features: int) -> None:
        super().check_module(out_features, in_features)
        for a, b, v in self.parts:
            v.check_module(b - a, in_features)
        self._in = int(in_features)

    def tensors(self) -> dict[str, Tensor]:
        t = {f"[{a}:{b}].{k}": x for a, b, v in self.parts for k, x in v.tensors().items()}
        if self.diff_b is not None:
            t["diff_b"] = self.diff_b
        return t

    def clear_cache(self) -> None:
        super().clear_cache()
        for _, _, v in self.parts:
            v.clear_cache()

    def cached_nbytes(self) -> int:
        return super().cached_nbytes() + sum(v.cached_nbytes() for _, _, v in self.parts)

    def _delta(self, device, ct, rows, weight) -> Tensor:
        idx = torch.arange(self._out, device=device)
        if rows is not None:
            idx = idx[rows_on(rows, device)]
        out = torch.zeros(idx.numel(), self._in, device=device, dtype=ct)
        for a, b, v in self.parts:
            sel = ((idx >= a) & (idx < b)).nonzero().squeeze(1)
            if sel.numel():
                w = None if weight is None else weight[a:b]
                out[sel] = v.delta(device, ct, idx[sel] - a, weight=w)
        return out

    def trace_form(self, device, dtype: torch.dtype, weight: Tensor | None = None):
        """Each part's own form in its row block (a part that reads the base output: None)."""
        parts = []
        for a, b, v in self.parts:
            f = None if v.needs_base_output else v.trace_form(device, dtype)
            if f is None:
                return None
            form, scale = f
            parts.append((a, b, form, torch.tensor(float(scale), dtype=torch.float32, device=device)))
        return SlicedForm(tuple(parts), self._out), 1.0

    def _forward(self, x, factor, base_out_nobias, weight) -> Tensor:
        y = x.new_zeros(*x.shape[:-1], self._out)
        for a, b, v in self.parts:
            w = None if weight is None else weight[a:b]
            y0 = None if base_out_nobias is None else base_out_nobias[..., a:b]
            y[..., a:b] = v.forward(x, factor, y0, w, include_bias=False)
        return y


class SlicedForm(TraceForm):
    """parts ((lo, hi, form, scale as an fp32 0-d tensor), ...), out: each part's form times its
    scale in its column block of the output, zeros between."""

    kind = "sliced"

    def __init__(self, parts: tuple, out_features: int):
        super().__init__()
        self.parts, self.out_features = parts, out_features

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0][2].dtype

    def cast(self, dtype: torch.dtype) -> "SlicedForm":
        return SlicedForm(tuple((lo, hi, f.cast(dtype), sc) for lo, hi, f, sc in self.parts), self.out_features)

    def out(self, x: Tensor, y0: Tensor | None = None) -> Tensor:
        lead, pieces, at = x.shape[:-1], [], 0
        for lo, hi, form, sc in self.parts:
            if lo > at:
                pieces.append(x.new_zeros(*lead, lo - at))
            o = form.out(x)
            pieces.append((o.float() * sc).to(o.dtype))
            at = hi
        if at < self.out_features:
            pieces.append(x.new_zeros(*lead, self.out_features - at))
        return torch.cat(pieces, -1)
