"""`Update`: one adapter's update of one Linear weight, and what the layer asks of it.

Contract (every update type answers the same questions; the layer never asks which type it has)
- ``scale``: the type's own factor on its raw update (its scale rule); ``out_features`` /
  ``in_features``: the [out, in] weight it targets; ``check_module`` raises naming the stem.
- ``delta(rows)``: the weight-space delta (times ``scale``, not times strength), fp32 or fp64,
  a new tensor on every call (never a cache or a view of one: a merge writes into it).
- ``forward(x, factor)``: the output delta for x, times ``scale`` and ``factor``, without the
  dense delta where the structure allows it.
- ``stack()``: ``(A [r, in], B [out, r], scale)`` when the update is a plain low-rank pair that a
  stacked GEMM or a fused kernel can take (every rank carries ``scale``), else None.
- ``trace_form(device, dtype, weight)``: ``(form, scale)`` a compiled call evaluates
  (`trace_forms`; ``form.out(x) * scale`` is ``forward(x, 1.0)``), or None.
- ``row_parts``: ``((start, stop, update), ...)`` when the update is made of updates on row
  slices of one fused weight, else None.
- Factors are multiplied in `..scaling` only (a unit factor is never multiplied).
The accepted key names and the scale rules are in docs/engine.md.
"""
from __future__ import annotations

import abc
import re
from typing import ClassVar, Mapping

import torch
from torch import Tensor

from ..errors import AdapterFormatError
from ..scaling import times
from .trace_forms import TraceForm

def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Compute dtype of `delta`: fp64 when asked for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def as_device(device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def rows_on(rows, device: torch.device):
    return rows.to(device) if isinstance(rows, Tensor) else rows


def as_linear(t: Tensor, stem: str, name: str) -> Tensor:
    """A factor as a 2-D matrix; conv-style trailing singleton dims are dropped."""
    if not isinstance(t, Tensor):
        raise AdapterFormatError(f"{stem}.{name}: expected a tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise AdapterFormatError(f"{stem}.{name}: dtype {t.dtype}; adapter factors must be floating point")
    if t.dim() == 2:
        return t
    if t.dim() > 2:
        if all(s == 1 for s in t.shape[2:]):
            return t.reshape(t.shape[0], t.shape[1])
        raise NotImplementedError(
            f"{stem}.{name} has shape {tuple(t.shape)}: a convolution kernel; only Linear layers are supported")
    raise AdapterFormatError(f"{stem}.{name} has shape {tuple(t.shape)}; expected a matrix")


def squeeze_factors(parts: dict, prefix: str) -> None:
    """Parts named `prefix`... with trailing 1-sized dims (1x1 conv factors) as matrices, in place."""
    for k in [k for k in parts if k.startswith(prefix)]:
        t = parts[k]
        if t.dim() > 2 and all(d == 1 for d in t.shape[2:]):
            parts[k] = t.reshape(t.shape[0], t.shape[1])


def swap_halves(t: Tensor | None) -> Tensor | None:
    """`t` with the two halves of its first dim exchanged (None stays None)."""
    if t is None:
        return None
    n = t.shape[0] // 2
    return torch.cat([t[n:], t[:n]])


def weight_key(weight: Tensor) -> tuple:
    """Identity of a base weight for the weight-dependent caches (storage, in-place version, layout).

    Tensors made under ``torch.inference_mode`` keep no version counter: their key is storage
    and layout only, and whoever changes such a weight in place clears the caches. A weight the
    layer dequantized (a fresh copy per read, `layer.base_weight`) carries the key of what it
    was read from."""
    key = getattr(weight, "_lora_weight_key", None)
    if key is not None:
        return key
    try:
        version = weight._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        version = "inference"
    return (weight.data_ptr(), version, tuple(weight.shape), weight.dtype, str(weight.device))


class Update(abc.ABC):
    """One update of one Linear layer; subclasses hold the factors as loaded (CPU, any float dtype).

    What a type declares to take part in loading (`registry`, `detect`):
    ``FILE_KEYS`` the file-key endings it claims as (pattern, part) (part "{name}": the pattern's
    ``name`` group; a ``slot`` group names a PEFT adapter slot), ``KEY_PARTS`` the part names it
    claims as (pattern, role) (role "" = the part's own name), ``ROLES`` the roles that mark the
    type present on a layer, ``FORMATS`` (rank, pattern on the key, format label) (the lowest
    rank that matches labels a key), ``SUPPORTED`` how errors list its keys, ``label`` its name
    in errors, ``takes_dora`` whether a DoRA magnitude may wrap it, ``wraps`` whether it wraps
    another type (DoRA), ``scaled_by_alpha`` whether its scale reads alpha, ``conv_refusal`` why
    it cannot go on a convolution (None: it can)."""

    kind: ClassVar[str] = ""
    label: ClassVar[str] = ""
    FILE_KEYS: ClassVar[tuple[tuple[re.Pattern, str], ...]] = ()
    KEY_PARTS: ClassVar[tuple[tuple[re.Pattern, str], ...]] = ()
    ROLES: ClassVar[tuple[str, ...]] = ()
    FORMATS: ClassVar[tuple[tuple[int, re.Pattern, str], ...]] = ()
    SUPPORTED: ClassVar[str] = ""
    takes_dora: ClassVar[bool] = False
    wraps: ClassVar[bool] = False
    scaled_by_alpha: ClassVar[bool] = False
    conv_refusal: ClassVar[str | None] = None

    def __init__(self, stem: str = "", alpha: float | None = None, diff_b: Tensor | None = None):
        self.stem = stem or "<layer>"
        self.alpha = None if alpha is None else float(alpha)
        if diff_b is not None:
            if not isinstance(diff_b, Tensor) or not diff_b.is_floating_point():
                raise AdapterFormatError(f"{self.stem}.diff_b: expected a floating-point tensor")
            diff_b = diff_b.reshape(-1)
        self.diff_b = diff_b
        self._cache: dict = {}

    # --- detection ----------------------------------------------------------------------
    @classmethod
    def claims(cls, role: str) -> bool:
        """Does this type own the role (a key part's role, see `KEY_PARTS`)?"""
        return role in cls.ROLES

    @classmethod
    def to_matrices(cls, parts: dict, stem: str) -> tuple[int, ...]:
        """Rewrite this type's parts of a convolution update (LoCon) in `parts` (in place) as the
        matrices `from_roles` takes; the conv kernel shape, or () when there is none."""
        return ()

    @classmethod
    def from_roles(cls, roles: Mapping[str, Tensor], names: Mapping[str, str], alpha: float | None, *,
                   stem: str, diff_b: Tensor | None = None, **options) -> "Update":
        """Build the update from the tensors of the roles it claimed (`names`: role -> key part)."""
        raise NotImplementedError

    # --- what the layer asks ----------------------------------------------------------
    @property
    @abc.abstractmethod
    def scale(self) -> float:
        """The factor applied to the raw update (already inside `delta` and `forward`)."""

    @property
    @abc.abstractmethod
    def out_features(self) -> int: ...

    @property
    @abc.abstractmethod
    def in_features(self) -> int | None: ...

    def stack(self, device=None, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, float] | None:
        """(A [r, in], B [out, r], scale on each rank) for a stacked GEMM or a fused kernel, or None
        when the update is not a plain low-rank pair. Without `device`/`dtype`: the stored tensors."""
        return None

    def trace_form(self, device, dtype: torch.dtype, weight: Tensor | None = None) -> tuple[TraceForm, float] | None:
        """(form with tensors on `device` in `dtype`, scale) such that ``form.out(x, y0) * scale`` is
        ``forward(x, 1.0, y0, include_bias=False)``; built outside any trace. None: the type has
        no such form (a compiled call takes the general path)."""
        return None

    @property
    def row_parts(self) -> tuple | None:
        """((start, stop, update), ...) of an update made of row slices of one weight, else None."""
        return None

    @property
    def ignores_alpha(self) -> bool:
        """Whether this update's scale ignores alpha (so a non-finite alpha does no harm)."""
        return False

    @property
    def per_row_magnitude(self) -> bool:
        """Whether the update renormalises each output row (DoRA's per-row magnitude)."""
        return False

    def swapped_halves(self) -> "Update | None":
        """The same update with the two halves of its output rows exchanged (a [scale, shift] layer
        stored as [shift, scale]), or None when the type cannot reorder its rows (`why_not_swapped`
        says why)."""
        return None

    def why_not_swapped(self) -> str:
        """Why `swapped_halves` gives None: one sentence for the error the user sees."""
        return f"a {self.label or self.kind} update cannot reorder its output rows"

    @property
    def needs_weight(self) -> bool:
        """Whether `delta` / `forward` need the base weight (DoRA)."""
        return False

    @property
    def needs_base_output(self) -> bool:
        """Whether `forward` wants the bias-free base output (DoRA, per-row norm)."""
        return False

    @property
    def has_weight_delta(self) -> bool:
        return True

    @abc.abstractmethod
    def tensors(self) -> dict[str, Tensor]:
        """The stored factors by key name (diff_b included)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def cached_nbytes(self) -> int:
        """Bytes held by device/dtype copies and dense caches (freed by `clear_cache`)."""
        seen, n = set(), 0
        for v in self._cache.values():
            for t in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(t, Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    n += t.numel() * t.element_size()
        return n

    def clear_cache(self) -> None:
        self._cache.clear()

    def check_module(self, out_features: int, in_features: int) -> None:
        """Raise `AdapterFormatError` naming the stem when the module's weight is not [out, in]."""
        o, i = self.out_features, self.in_features
        if o != out_features or (i is not None and i != in_features):
            raise AdapterFormatError(
                f"{self.stem}: the {type(self).__name__} factors make a [{o}, {i if i is not None else '?'}] "
                f"weight delta; the module's weight is [{out_features}, {in_features}] "
                "(adapter made for another model or layer)")

    def delta(self, device="cpu", dtype: torch.dtype = torch.float32, rows=None, *,
              weight: Tensor | None = None) -> Tensor:
        """Weight-space delta [out, in] (or [len(rows), in]), times `scale`, not times strength.

        Computed in fp32 (fp64 when `dtype` is fp64), returned in `dtype`. `rows` is a
        slice or an index tensor (on `device` or CPU). `weight` is needed by DoRA only.
        """
        d = self._delta(as_device(device), compute_dtype(dtype), rows, weight)
        return d if d.dtype == dtype else d.to(dtype)

    @abc.abstractmethod
    def _delta(self, device: torch.device, ct: torch.dtype, rows, weight) -> Tensor: ...

    def folded_delta(self, device, factor: float, rows=None, *, weight: Tensor | None = None) -> Tensor:
        """fp32 `delta(rows)` times `factor`, for the lossless/high tiers, which may apply
        ``scale * factor`` once. Types that can fold the product into a factor matrix override
        this; the default applies the factors one after the other (the `exact` bits)."""
        return times(self.delta(device, torch.float32, rows, weight=weight), factor, inplace=True)

    def forward(self, x: Tensor, factor: float = 1.0, base_out_nobias: Tensor | None = None,
                weight: Tensor | None = None, *, include_bias: bool = True) -> Tensor:
        """Output delta for input x [..., in], in x's dtype, times `scale` and `factor`.

        Includes ``factor * diff_b`` unless `include_bias` is False. DoRA needs `weight`
        (and takes `base_out_nobias` = x W^T when the caller already has it).
        """
        y = self._forward(x, float(factor), base_out_nobias, weight)
        if include_bias and self.diff_b is not None and factor != 0:
            y = y + times(self.bias_delta(x.device, x.dtype), factor)
        return y

    @abc.abstractmethod
    def _forward(self, x: Tensor, factor: float, base_out_nobias, weight) -> Tensor: ...

    def bias_delta(self, device="cpu", dtype: torch.dtype = torch.float32) -> Tensor | None:
        """The ``diff_b`` output offset [out] (not times strength), or None."""
        if self.diff_b is None:
            return None
        return self._on(device, dtype, "diff_b", lambda: self.diff_b)

    # --- helpers ------------------------------------------------------------------------
    def _on(self, device, dtype: torch.dtype, name: str, make) -> Tensor:
        """`make()` cast to (device, dtype), cached per (name, device, dtype)."""
        key = ("cast", name, str(as_device(device)), dtype)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = make().to(device=as_device(device), dtype=dtype)
        return t

    def _err(self, msg: str) -> AdapterFormatError:
        return AdapterFormatError(f"{self.stem}: {msg}")

    def check_bias(self) -> None:
        if self.diff_b is not None and self.diff_b.numel() != self.out_features:
            raise self._err(f"diff_b has {self.diff_b.numel()} values; the weight delta has "
                            f"{self.out_features} output rows")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.stem!r}, out={self.out_features}, in={self.in_features}, "
                f"scale={self.scale:g})")
