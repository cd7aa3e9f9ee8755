"""DoRA: W' = m ⊙ (W + s·dW) / ||W + s·dW|| around a LoRA / LoHa / LoKr `inner` update.

Keys: ``dora_scale`` (LyCORIS / ComfyUI), ``lora_magnitude_vector[.<slot>][.weight]`` (PEFT), ``dora``.
``delta`` (needs ``weight=``) is W' - W; strength multiplies it (ComfyUI's rule: at strength 0 the
layer is the base layer). The magnitude's shape picks the norm axis: [out] / [out, 1] per output
row ("out"), [1, in] / [in] per input column ("in"). Norm of the merged weight by default;
``comfy_quirk=True`` takes ComfyUI's norm of the original W for axis "out". ``eps`` is added to
every norm (default fp32 eps; PEFT: 0). `swapped_halves`: the same DoRA on a layer that stores the
two halves of its rows the other way round (exact for both axes; see the method). Details and the
derivations: docs/engine.md.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import AdapterFormatError
from ..scaling import times
from .base import Update, as_device, compute_dtype, rows_on, swap_halves, weight_key
from .trace_forms import DenseForm, TraceForm

# Budget (elements) for one chunk of a dense [rows, in] block built to compute norms.
CHUNK_ELEMS = 1 << 24
MAX_CACHE = 8   # weight-dependent results kept per update (norms, g, dense deltas), times 4


class DoRA(Update):
    kind = "dora"
    label = "DoRA"
    KEY_PARTS = ((re.compile(r"^(?:dora_scale|dora|lora_magnitude_vector(?:\.[A-Za-z0-9_\-]+)?(?:\.weight)?)$"),
                  "dora"),)
    ROLES = ("dora",)
    FILE_KEYS = ((re.compile(r"\.lora_magnitude_vector(?:\.(?P<slot>[A-Za-z0-9_\-]+))?(?:\.weight)?$"), "dora"),
                 (re.compile(r"\.dora_scale$"), "dora"))
    FORMATS = ((0, re.compile(r"lora_magnitude_vector"), "peft"), (2, re.compile(r"dora_scale"), "kohya"))
    SUPPORTED = "DoRA (dora_scale / lora_magnitude_vector)"
    wraps = True
    scaled_by_alpha = True
    conv_refusal = "DoRA on a convolution is not supported"
    alone_refusal = "without LoRA/LoHa/LoKr weights"

    def __init__(self, inner: Update, magnitude: Tensor, *, stem: str = "", comfy_quirk: bool = False,
                 eps: float | None = None, diff_b: Tensor | None = None):
        if not getattr(inner, "takes_dora", False):
            raise AdapterFormatError(f"{stem or inner.stem}: DoRA needs a LoRA, LoHa or LoKr update, "
                                     f"got {type(inner).__name__}")
        super().__init__(stem or inner.stem, inner.alpha, diff_b if diff_b is not None else inner.diff_b)
        if inner.diff_b is not None and diff_b is not None:
            raise self._err("diff_b given twice (on the DoRA and on its inner update)")
        self.inner = inner
        inner.diff_b = None  # the bias offset is the DoRA's, applied once
        if not isinstance(magnitude, Tensor) or not magnitude.is_floating_point():
            raise self._err("the DoRA magnitude (dora_scale / lora_magnitude_vector) must be a float tensor")
        self.magnitude = magnitude
        self.comfy_quirk = bool(comfy_quirk)
        self.eps = torch.finfo(torch.float32).eps if eps is None else float(eps)
        o, i = inner.out_features, inner.in_features
        m = magnitude
        if m.shape[0] == o and m.numel() == o:  # [out] / [out, 1]  (ComfyUI: shape[0] == out)
            self.axis = "out"
        elif m.numel() == i and (m.dim() == 1 or (m.dim() >= 2 and m.shape[0] == 1)):  # [1, in] / [in]
            self.axis = "in"
        else:
            raise self._err(f"the DoRA magnitude has shape {tuple(m.shape)}; for a [{o}, {i}] weight it must "
                            f"be [{o}] or [{o}, 1] (per output row) or [1, {i}] (per input column)")
        # file_rows[i]: the row of this update that holds row i in the file's own order (None: the
        # same order). Per-column norms sum over the rows in that order, as the file's layer does.
        self.file_rows: Tensor | None = None
        self.check_bias()

    def swapped_halves(self) -> "DoRA | None":
        """The DoRA of the layer P·W whose rows are W's with the two halves exchanged (P: the swap).

        DoRA(P·W) must equal P·DoRA(W) = P·(m ⊙ V / ||V||) with V = W + s·dW. The inner update is
        swapped (P·V = P·W + s·P·dW). Per-row norms ([out]): row j of P·V is row P(j) of V, so its
        norm is that row's norm, and the magnitude is swapped with it. Per-column norms ([1, in]): a
        column's norm sums over every row, whatever their order, so the magnitude stays; the sum is
        still taken in the file's row order (`file_rows`), so the bits equal the un-reordered ones.
        None when the inner update cannot reorder its rows (`why_not_swapped`)."""
        inner = self.inner.swapped_halves()
        out = self.out_features
        if inner is None or out % 2:
            return None
        m = swap_halves(self.magnitude) if self.axis == "out" else self.magnitude
        v = DoRA(inner, m, stem=self.stem, comfy_quirk=self.comfy_quirk, eps=self.eps,
                 diff_b=swap_halves(self.diff_b))
        if v.axis != self.axis:  # cannot happen: the magnitude keeps its shape
            raise self._err("reordering the rows changed the DoRA norm axis")
        rows = self.file_rows if self.file_rows is not None else torch.arange(out)
        rows = (rows + out // 2) % out
        v.file_rows = None if torch.equal(rows, torch.arange(out)) else rows
        return v

    def why_not_swapped(self) -> str:
        if self.out_features % 2:
            return f"a DoRA update with an odd number of output rows ({self.out_features}) has no two halves"
        return f"DoRA around {self.inner.why_not_swapped()}"

    @property
    def scale(self) -> float:
        return self.inner.scale

    @property
    def out_features(self) -> int:
        return self.inner.out_features

    @property
    def in_features(self) -> int:
        return self.inner.in_features

    @property
    def needs_weight(self) -> bool:
        return True

    @property
    def needs_base_output(self) -> bool:
        return self.axis == "out"

    @property
    def per_row_magnitude(self) -> bool:
        return self.axis == "out"

    @property
    def ignores_alpha(self) -> bool:
        return self.inner.ignores_alpha

    def tensors(self) -> dict[str, Tensor]:
        t = dict(self.inner.tensors())
        t["dora_scale"] = self.magnitude
        if self.diff_b is not None:
            t["diff_b"] = self.diff_b
        return t

    def clear_cache(self) -> None:
        super().clear_cache()
        self.inner.clear_cache()

    def cached_nbytes(self) -> int:
        return super().cached_nbytes() + self.inner.cached_nbytes()

    def _m(self, device, ct) -> Tensor:
        return self._on(device, ct, "m", lambda: self.magnitude.reshape(-1))

    def _check_weight(self, weight: Tensor | None) -> Tensor:
        if weight is None:
            raise self._err("DoRA needs the base weight (weight=...)")
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise self._err(f"the base weight is {tuple(weight.shape)}; the DoRA update is "
                            f"[{self.out_features}, {self.in_features}]")
        return weight

    def _remember(self, key, value):
        if len(self._cache) >= 4 * MAX_CACHE:
            for k in [k for k in self._cache if k[0] in ("norm", "g", "dense")][:MAX_CACHE]:
                del self._cache[k]
        self._cache[key] = value
        return value

    @torch.no_grad()
    def norm_of(self, weight: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """The DoRA norm + eps: [out] (axis "out") or [in] (axis "in"), on weight's device.

        Cached per base weight (storage, in-place version, shape). For a chunked in-place
        merge with axis "in", compute it BEFORE writing the first chunk and pass it to each
        `delta(..., norm=...)` call (the column norms span all rows).
        """
        weight = self._check_weight(weight)
        ct = compute_dtype(dtype)
        key = ("norm", weight_key(weight), ct)
        n = self._cache.get(key)
        if n is not None:
            return n
        dev, out_f, in_f = weight.device, self.out_features, self.in_features
        if self.axis == "out" and self.comfy_quirk:
            n = torch.linalg.vector_norm(weight.to(ct), dim=1)
        else:
            step = max(1, CHUNK_ELEMS // max(1, in_f))
            acc = torch.zeros(out_f if self.axis == "out" else in_f, device=dev, dtype=ct)
            order = None if self.axis == "out" or self.file_rows is None else self.file_rows.to(dev)
            for r0 in range(0, out_f, step):
                rs = slice(r0, min(out_f, r0 + step))
                if order is not None:  # the rows in the file's order (see __init__)
                    rs = order[rs]
                wc = weight[rs].to(ct) + self.inner.delta(dev, ct, rs)
                if self.axis == "out":
                    acc[rs] = torch.linalg.vector_norm(wc, dim=1)
                else:
                    acc += wc.square().sum(0)
            n = acc if self.axis == "out" else acc.sqrt_()
        return self._remember(key, n.add_(self.eps))

    def magnitude_over_norm(self, weight: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """g = m / norm: [out] (axis "out") or [in] (axis "in"); cached with the norm."""
        ct = compute_dtype(dtype)
        key = ("g", weight_key(weight), ct)
        g = self._cache.get(key)
        if g is None:
            g = self._remember(key, self._m(weight.device, ct) / self.norm_of(weight, ct))
        return g

    def dora_row_scale(self, weight: Tensor, strength: float = 1.0) -> Tensor:
        """Per-output-row factor r = 1 + strength * (g - 1) [out] (fp32, weight's device).

        With it the final output is ``y = r ⊙ (x W^T) + (r - 1 + strength) ⊙ s x dW^T + b``
        (r - 1 + strength = strength * g). Only for axis "out"; axis "in" has no such form.
        """
        if self.axis != "out":
            raise self._err("a per-column DoRA magnitude ([1, in]) has no per-row output scale; "
                            "use delta()/forward(), which build the dense delta")
        g = self.magnitude_over_norm(weight)
        return g.clone() if strength == 1.0 else times(g - 1.0, strength, inplace=True).add_(1.0)

    def delta(self, device="cpu", dtype: torch.dtype = torch.float32, rows=None, *,
              weight: Tensor | None = None, norm: Tensor | None = None) -> Tensor:
        """W' - W (rows optional), not times strength. `weight` is required; `norm` lets a
        chunked in-place merge use norms taken before the first write (see `norm_of`)."""
        d = self._dora_delta(as_device(device), compute_dtype(dtype), rows, weight, norm)
        return d if d.dtype == dtype else d.to(dtype)

    def _delta(self, device, ct, rows, weight) -> Tensor:
        return self._dora_delta(device, ct, rows, weight, None)

    @torch.no_grad()
    def _dora_delta(self, device, ct, rows, weight, norm) -> Tensor:
        weight = self._check_weight(weight)
        r = rows_on(rows, weight.device)
        w = (weight if rows is None else weight[r]).to(device=device, dtype=ct)
        wc = w + self.inner.delta(device, ct, rows)
        m = self._m(device, ct)
        if self.axis == "out":
            if norm is not None:
                n = norm.to(device=device, dtype=ct)
                n = n if rows is None else n[rows_on(rows, device)]
            elif ("norm", weight_key(weight), ct) in self._cache:
                n = self._cache[("norm", weight_key(weight), ct)].to(device)
                n = n if rows is None else n[rows_on(rows, device)]
            else:  # per-row norms need only these rows
                src = w if self.comfy_quirk else wc
                n = torch.linalg.vector_norm(src, dim=1).add_(self.eps)
            mr = m if rows is None else m[rows_on(rows, device)]
            return wc.mul_((mr / n).unsqueeze(1)).sub_(w)
        n = (norm if norm is not None else self.norm_of(weight, ct)).to(device=device, dtype=ct)
        return wc.mul_((m / n).unsqueeze(0)).sub_(w)

    def forward(self, x: Tensor, factor: float = 1.0, base_out_nobias: Tensor | None = None,
                weight: Tensor | None = None, *, include_bias: bool = True) -> Tensor:
        """factor * (x W'^T - x W^T) (+ factor * diff_b). `weight` is required;
        `base_out_nobias` (= x W^T, no bias) saves a GEMM on the per-row path."""
        return super().forward(x, factor, base_out_nobias, weight, include_bias=include_bias)

    def trace_form(self, device, dtype: torch.dtype, weight: Tensor | None = None):
        """Axis "out": the per-row form, g = m / norm from `weight` (the call's base weight) and
        the inner update's own form; axis "in": the full-strength dense delta. None when the
        inner update has no form."""
        weight = self._check_weight(weight)
        if self.axis == "out":
            inner = self.inner.trace_form(device, dtype)
            if inner is None:
                return None
            form, iscale = inner
            g = self.magnitude_over_norm(weight).to(device=device, dtype=dtype)
            return DoraForm(g, form, torch.tensor(float(iscale), dtype=torch.float32, device=device)), 1.0
        return DenseForm(self._dense(weight, as_device(device), dtype)), 1.0

    def _dense(self, weight: Tensor, device, dtype: torch.dtype) -> Tensor:
        """The full-strength dense delta in `dtype` (axis "in"), cached per base weight."""
        key = ("dense", weight_key(weight), str(device), dtype)
        d = self._cache.get(key)
        if d is None:
            d = self._remember(key, self._dora_delta(device, compute_dtype(dtype), None, weight, None).to(dtype))
        return d

    def _forward(self, x, factor, base_out_nobias, weight) -> Tensor:
        weight = self._check_weight(weight)
        if factor == 0.0:
            return x.new_zeros(*x.shape[:-1], self.out_features)
        if self.axis == "out":
            g = self.magnitude_over_norm(weight).to(device=x.device, dtype=x.dtype)
            y0 = base_out_nobias if base_out_nobias is not None else F.linear(x, weight.to(x.device, x.dtype))
            y = (g - 1) * y0 + g * self.inner.forward(x, 1.0, include_bias=False)
        else:
            y = F.linear(x, self._dense(weight, x.device, x.dtype))
        return times(y, factor)


class DoraForm(TraceForm):
    """g [out], the inner update's form, its scale as an fp32 0-d tensor: the per-row DoRA output
    (g - 1) * y0 + g * inner(x), y0 = x Wᵀ (the base output without bias)."""

    kind = "dora"
    needs_base_output = True

    def __init__(self, g: Tensor, inner: TraceForm, inner_scale: Tensor):
        super().__init__(g)
        self.inner, self.inner_scale = inner, inner_scale

    def cast(self, dtype: torch.dtype) -> "DoraForm":
        return DoraForm(self.tensors[0].to(dtype), self.inner.cast(dtype), self.inner_scale)

    def out(self, x: Tensor, y0: Tensor | None = None) -> Tensor:
        g = self.tensors[0]
        inner = self.inner.out(x)
        inner = (inner.float() * self.inner_scale).to(inner.dtype)
        return (g - 1) * y0 + g * inner
