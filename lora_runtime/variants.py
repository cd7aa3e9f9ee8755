"""Adapter variants: one small class per weight-adapter family (project issue 13).

Each variant holds its factor tensors as loaded (CPU, any float dtype) plus ``alpha``
and answers the questions the wrapper asks, so the wrapper need not branch on which
attributes a layer happens to have:

=================  ==========================================================
``scale``          the factor ComfyUI / LyCORIS / PEFT put on the update (rules below)
``out_features``   rows of the Linear weight the variant targets
``in_features``    columns of that weight
``check_module``   raises `AdapterFormatError` naming the stem when the shapes differ
``delta``          fp32 (fp64 on request) weight-space delta, times ``scale``, NOT
                   times strength; optionally only some rows (chunked merges)
``forward_delta``  the output delta for an input, without the dense [out, in] delta
                   where the structure allows it; times strength
``bias_delta``     the ``diff_b`` output offset (not times strength) or None
``fusable``        True only for plain LoRA (a fused kernel takes stacked down/up)
``nbytes``         bytes of the stored factors (device copies are extra: `cached_nbytes`)
=================  ==========================================================

Only Linear layers are handled (2-D weights). Factors stored conv-style with trailing
singleton dims (``[r, in, 1, 1]``) are squeezed; a real kernel (``3x3``) raises
``NotImplementedError`` naming the key.

Accepted key parts
------------------
``detect(parts, alpha)`` receives the suffixes after the module stem (as
``key_formats.split_key`` or a plain ``key[len(stem) + 1:]`` gives them):

* LoRA, down (``A``, [r, in]): ``lora_down.weight``, ``lora.down.weight``,
  ``lora_linear_layer.down.weight``, ``lora_A.weight``, ``lora_A.<slot>.weight``,
  ``lora_A``, ``down``;
  up (``B``, [out, r]): the same with ``up`` / ``lora_B``.
* LoHa: ``hada_w1_a``, ``hada_w1_b``, ``hada_w2_a``, ``hada_w2_b``; CP/Tucker adds
  ``hada_t1`` and ``hada_t2`` (both or neither).
* LoKr: ``lokr_w1`` or ``lokr_w1_a`` + ``lokr_w1_b``; ``lokr_w2`` or ``lokr_w2_a`` +
  ``lokr_w2_b``; Tucker adds ``lokr_t2`` (with the factorised w2 only).
* Full: ``diff`` ([out, in] weight delta); ``diff_b`` ([out] output offset, may sit
  alongside any variant or alone -> `BiasOnly`).
* DoRA magnitude: ``dora_scale`` (LyCORIS / ComfyUI), ``lora_magnitude_vector``,
  ``lora_magnitude_vector.weight``, ``lora_magnitude_vector.<slot>.weight`` (PEFT),
  ``dora`` (key_formats' normalised name). Wraps the LoRA / LoHa / LoKr found.
* ``alpha``: a scalar tensor; used when the ``alpha`` argument is None.

Recognised but refused (``NotImplementedError`` naming the key): ``lora_mid.weight``
(LoCon Tucker, convolutions only), ``oft_blocks`` / ``oft_diag`` / ``rescale``
(OFT/BOFT), ``a1.weight`` ... ``b2.weight`` (GLoRA), ``reshape_weight``, ``w_norm``,
``b_norm``, ``set_weight``. Anything else, two names for one role, an incomplete
family or two families on one stem (e.g. ``lora_up`` with ``diff``: ComfyUI keeps only
the diff, the old wrapper summed them) raise `AdapterFormatError`.

Scale rules (``alpha`` = the layer's ``.alpha`` value, None when absent)
-------------------------------------------------------------------------
* LoRA: ``alpha / rank`` with rank = rows of down (``lora_A``); no alpha -> 1.0.
  ComfyUI ``weight_adapter/lora.py`` ``calculate_weight`` (``alpha / mat2.shape[0]``),
  kohya/LyCORIS ``scale = alpha / lora_dim``, PEFT ``lora_alpha / r``. With
  ``rslora=True`` (PEFT ``use_rslora``): ``alpha / sqrt(rank)``.
* LoHa: ``alpha / hada_w1_b.shape[0]``; no alpha -> 1.0. ComfyUI
  ``weight_adapter/loha.py`` ``calculate_weight``; LyCORIS ``loha.py`` ``alpha / lora_dim``.
* LoKr: ``dim = lokr_w1_b.shape[0]`` when w1 is factorised, overridden by
  ``lokr_w2_b.shape[0]`` when w2 is factorised; ``scale = alpha / dim`` only when alpha
  is present AND at least one side is factorised, else 1.0 (both sides full: alpha is
  ignored). ComfyUI ``weight_adapter/lokr.py`` ``calculate_weight``; LyCORIS ``lokr.py``
  sets ``alpha = lora_dim`` (scale 1) when both ``use_w1`` and ``use_w2``.
* Full (``diff``) and ``diff_b``: no scale (1.0); alpha is ignored. ComfyUI ``lora.py``
  ``load_lora`` -> ``("diff", ...)`` patches.
* DoRA: the wrapped variant's scale ``s`` applies to its update inside the
  decomposition; strength then interpolates (below).

Strength
--------
Non-DoRA: ``W_final = W + strength * delta`` (ComfyUI ``W += (strength*scale) * diff``).
DoRA: ``W_final = W + strength * (W' - W)`` with ``W' = m * (W + s*dW) / ||W + s*dW||``
(ComfyUI ``weight_decompose`` in ``weight_adapter/base.py``, identical in 0.3.64 and
newest). At strength 0 the layer is the base layer. LyCORIS' own multiplier rule
(``W'' = (W + s*dW) * (1 + mult*(g - 1))``) differs for strength != 1 and is not offered;
nor is PEFT's, which scales ``s`` inside the norm.

DoRA conventions
----------------
* ``axis == "out"``: magnitude [out] or [out, 1] (PEFT ``lora_magnitude_vector``,
  LyCORIS ``wd_on_out=True``): the norm is per output row, over the input dim.
* ``axis == "in"``: magnitude [1, in] (LyCORIS default ``wd_on_out=False``; also a 1-D
  [in] vector when in != out): the norm is per input column, over the output dim.
  ComfyUI tells them apart by ``dora_scale.shape[0] == out``; so do we.
* Norm of the MERGED weight ``W + s*dW`` (PEFT, LyCORIS) by default. ComfyUI's quirk
  (HOOKS.md 4.4): for ``axis == "out"`` it takes the norm of the ORIGINAL ``W``;
  ``comfy_quirk=True`` reproduces that (the ``axis == "in"`` case is the same in both).
* ``eps`` is added to every norm: default ``torch.finfo(torch.float32).eps`` as LyCORIS
  and ComfyUI do in their fp32 patch path; PEFT adds none (pass ``eps=0.0``).
"""
from __future__ import annotations

import abc
import copy
import math
import re
from typing import ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import AdapterFormatError

__all__ = [
    "Variant", "LoRA", "LoHa", "LoKr", "Full", "BiasOnly", "DoRA", "Sliced", "detect", "classify_part",
]

# Budget (elements) for one chunk of a dense [rows, in] block built to compute norms.
_CHUNK_ELEMS = 1 << 24
_MAX_CACHE = 8


def _ct(dtype: torch.dtype) -> torch.dtype:
    """Compute dtype of `delta`: fp64 when asked for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dev(device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def _rows_on(rows, device: torch.device):
    return rows.to(device) if isinstance(rows, Tensor) else rows


def _as_linear(t: Tensor, stem: str, name: str) -> Tensor:
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


def _wkey(weight: Tensor) -> tuple:
    """Identity of a base weight for the DoRA caches (storage, in-place version, layout).

    Tensors made under ``torch.inference_mode`` (ComfyUI loads its weights that way) keep
    no version counter: their key is storage and layout only, and whoever changes such a
    weight in place clears the caches (`clear_cache`; the LoRA wrapper does on every
    merge, restore and new slot)."""
    try:
        version = weight._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        version = "inference"
    return (weight.data_ptr(), version, tuple(weight.shape), weight.dtype, str(weight.device))


class Variant(abc.ABC):
    """One adapter family for one Linear layer. Subclasses hold the factors as loaded."""

    kind: ClassVar[str] = ""

    def __init__(self, stem: str = "", alpha: float | None = None, diff_b: Tensor | None = None):
        self.stem = stem or "<layer>"
        self.alpha = None if alpha is None else float(alpha)
        if diff_b is not None:
            if not isinstance(diff_b, Tensor) or not diff_b.is_floating_point():
                raise AdapterFormatError(f"{self.stem}.diff_b: expected a floating-point tensor")
            diff_b = diff_b.reshape(-1)
        self.diff_b = diff_b
        self._cache: dict = {}

    # --- construction -----------------------------------------------------------------
    @classmethod
    def from_keys(cls, parts: Mapping[str, Tensor], alpha: float | None = None, *, stem: str = "",
                  **options) -> "Variant":
        """Build the variant the parts describe (see `detect`); on a subclass, also
        check the parts describe that subclass."""
        v = detect(parts, alpha, stem=stem, **options)
        if cls is not Variant and not isinstance(v, cls):
            raise AdapterFormatError(f"{v.stem}: the keys {sorted(parts)} describe a {type(v).__name__}, "
                                     f"not a {cls.__name__}")
        return v

    # --- what the wrapper asks ------------------------------------------------------
    @property
    @abc.abstractmethod
    def scale(self) -> float:
        """The factor applied to the raw update (already inside `delta`)."""

    @property
    @abc.abstractmethod
    def out_features(self) -> int: ...

    @property
    @abc.abstractmethod
    def in_features(self) -> int | None: ...

    @property
    def fusable(self) -> bool:
        """Whether a fused LoRA kernel (stacked down [R, in] / up [out, R]) can take it."""
        return False

    @property
    def needs_weight(self) -> bool:
        """Whether `delta` / `forward_delta` need the base weight (DoRA)."""
        return False

    @property
    def needs_base_output(self) -> bool:
        """Whether `forward_delta` wants the bias-free base output (DoRA, per-row norm)."""
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
        d = self._delta(_dev(device), _ct(dtype), rows, weight)
        return d if d.dtype == dtype else d.to(dtype)

    @abc.abstractmethod
    def _delta(self, device: torch.device, ct: torch.dtype, rows, weight) -> Tensor: ...

    def forward_delta(self, x: Tensor, strength: float = 1.0, base_out_nobias: Tensor | None = None,
                      weight: Tensor | None = None, *, include_bias: bool = True) -> Tensor:
        """Output delta for input x [..., in], in x's dtype, times `strength` (and `scale`).

        Includes ``strength * diff_b`` unless `include_bias` is False. DoRA needs `weight`
        (and takes `base_out_nobias` = x W^T when the caller already has it).
        """
        y = self._forward(x, float(strength), base_out_nobias, weight)
        if include_bias and self.diff_b is not None and strength != 0:
            y = y + self.bias_delta(x.device, x.dtype) * strength
        return y

    @abc.abstractmethod
    def _forward(self, x: Tensor, strength: float, base_out_nobias, weight) -> Tensor: ...

    def bias_delta(self, device="cpu", dtype: torch.dtype = torch.float32) -> Tensor | None:
        """The ``diff_b`` output offset [out] (not times strength), or None."""
        if self.diff_b is None:
            return None
        return self._on(device, dtype, "diff_b", lambda: self.diff_b)

    # --- helpers ------------------------------------------------------------------------
    def _on(self, device, dtype: torch.dtype, name: str, make) -> Tensor:
        """`make()` cast to (device, dtype), cached per (name, device, dtype)."""
        key = ("cast", name, str(_dev(device)), dtype)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = make().to(device=_dev(device), dtype=dtype)
        return t

    def _err(self, msg: str) -> AdapterFormatError:
        return AdapterFormatError(f"{self.stem}: {msg}")

    def _check_bias(self) -> None:
        if self.diff_b is not None and self.diff_b.numel() != self.out_features:
            raise self._err(f"diff_b has {self.diff_b.numel()} values; the weight delta has "
                            f"{self.out_features} output rows")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.stem!r}, out={self.out_features}, in={self.in_features}, "
                f"scale={self.scale:g})")


class LoRA(Variant):
    """Plain LoRA: delta = scale * up @ down; down [r, in], up [out, r]."""

    kind = "lora"

    def __init__(self, down: Tensor, up: Tensor, alpha: float | None = None, *, stem: str = "",
                 rslora: bool = False, diff_b: Tensor | None = None):
        super().__init__(stem, alpha, diff_b)
        self.down = _as_linear(down, self.stem, "down")
        self.up = _as_linear(up, self.stem, "up")
        self.rslora = bool(rslora)
        if self.up.shape[1] != self.down.shape[0]:
            raise self._err(f"up is {tuple(self.up.shape)} and down is {tuple(self.down.shape)}: "
                            f"up has {self.up.shape[1]} columns, down has {self.down.shape[0]} rows (the rank)")
        self._check_bias()

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def scale(self) -> float:
        if self.alpha is None:
            return 1.0
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @property
    def out_features(self) -> int:
        return int(self.up.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.down.shape[1])

    @property
    def fusable(self) -> bool:
        return True

    def tensors(self) -> dict[str, Tensor]:
        t = {"down": self.down, "up": self.up}
        if self.diff_b is not None:
            t["diff_b"] = self.diff_b
        return t

    def factors(self, device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(down [r, in], up [out, r]) on device in dtype, unscaled; cached."""
        return (self._on(device, dtype, "down", lambda: self.down),
                self._on(device, dtype, "up", lambda: self.up))

    def _delta(self, device, ct, rows, weight) -> Tensor:
        down, up = self.factors(device, ct)
        if rows is not None:
            up = up[_rows_on(rows, device)]
        return (up @ down).mul_(self.scale)

    def _forward(self, x, strength, base_out_nobias, weight) -> Tensor:
        down, up = self.factors(x.device, x.dtype)
        h = F.linear(x, down)
        c = self.scale * strength
        if c != 1.0:
            h = h * c  # on the small [..., r] tensor
        return F.linear(h, up)


class Full(Variant):
    """A full weight delta (``diff``, [out, in]); no scale."""

    kind = "diff"

    def __init__(self, diff: Tensor, alpha: float | None = None, *, stem: str = "", diff_b: Tensor | None = None):
        super().__init__(stem, alpha, diff_b)
        self.diff = _as_linear(diff, self.stem, "diff")
        self._check_bias()

    @property
    def scale(self) -> float:
        return 1.0

    @property
    def out_features(self) -> int:
        return int(self.diff.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.diff.shape[1])

    def tensors(self) -> dict[str, Tensor]:
        t = {"diff": self.diff}
        if self.diff_b is not None:
            t["diff_b"] = self.diff_b
        return t

    def _delta(self, device, ct, rows, weight) -> Tensor:
        d = self.diff if rows is None else self.diff[_rows_on(rows, self.diff.device)]
        return d.to(device=device, dtype=ct, copy=True)

    def _forward(self, x, strength, base_out_nobias, weight) -> Tensor:
        y = F.linear(x, self._on(x.device, x.dtype, "diff", lambda: self.diff))
        return y * strength if strength != 1.0 else y


class BiasOnly(Variant):
    """Only a ``diff_b`` output offset: no weight delta. `in_features` is unknown until
    `check_module` (or a `weight` passed to `delta`) tells it."""

    kind = "diff_b"

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

    def tensors(self) -> dict[str, Tensor]:
        return {"diff_b": self.diff_b}

    def _delta(self, device, ct, rows, weight) -> Tensor:
        n_in = int(weight.shape[1]) if weight is not None else self._in
        if n_in is None:
            raise self._err("a diff_b-only layer has no weight delta and its input size is unknown; "
                            "call check_module(out, in) first or pass weight=")
        n = self.out_features if rows is None else torch.arange(self.out_features)[rows].numel()
        return torch.zeros(n, n_in, device=device, dtype=ct)

    def _forward(self, x, strength, base_out_nobias, weight) -> Tensor:
        return x.new_zeros(*x.shape[:-1], self.out_features)


class LoHa(Variant):
    """LoHa (LyCORIS): delta = scale * (W1a W1b) ⊙ (W2a W2b).

    Plain: hada_w1_a [out, r1], hada_w1_b [r1, in], hada_w2_a [out, r2], hada_w2_b [r2, in].
    CP/Tucker (``hada_t1``/``hada_t2``): w_a [ra, out], t [ra, rb], w_b [rb, in] and
    each factor is ``w_a^T t w_b`` (ComfyUI/LyCORIS einsum ``i j, j r, i p -> p r``).

    Dynamic path: a Hadamard product of two rank-k factors is a rank-k1*k2 product of
    row-wise Khatri-Rao factors (U [out, k1 k2], Z [k1 k2, in]); `forward_delta` runs
    that pair of GEMMs when k1*k2*(out+in) < out*in, else it builds the dense delta
    once per (device, dtype), caches it (`cached_nbytes`, `clear_cache`) and runs one
    F.linear. Either way the cost is that of a rank-k1*k2 LoRA at most (same-parameter
    plain LoRA has rank ~k1+k2: LoHa costs about k/2 times more per token, by design).
    """

    kind = "loha"

    def __init__(self, w1a: Tensor, w1b: Tensor, w2a: Tensor, w2b: Tensor, alpha: float | None = None, *,
                 t1: Tensor | None = None, t2: Tensor | None = None, stem: str = "",
                 diff_b: Tensor | None = None):
        super().__init__(stem, alpha, diff_b)
        if (t1 is None) != (t2 is None):
            raise self._err("hada_t1 and hada_t2 come together (CP decomposition); only one is present")
        s = self.stem
        self.w1a, self.w1b = _as_linear(w1a, s, "hada_w1_a"), _as_linear(w1b, s, "hada_w1_b")
        self.w2a, self.w2b = _as_linear(w2a, s, "hada_w2_a"), _as_linear(w2b, s, "hada_w2_b")
        self.t1 = None if t1 is None else _as_linear(t1, s, "hada_t1")
        self.t2 = None if t2 is None else _as_linear(t2, s, "hada_t2")
        self._check_side(1, self.w1a, self.w1b, self.t1)
        self._check_side(2, self.w2a, self.w2b, self.t2)
        if (self._out(1), self.w1b.shape[1]) != (self._out(2), self.w2b.shape[1]):
            raise self._err(f"the two Hadamard factors differ: [{self._out(1)}, {self.w1b.shape[1]}] "
                            f"(hada_w1_*) vs [{self._out(2)}, {self.w2b.shape[1]}] (hada_w2_*)")
        self._check_bias()

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
        r = _rows_on(rows, device)
        if not self.cp:
            return (a if rows is None else a[r]) @ b
        t = self._on(device, ct, f"t{i}", lambda: self.t1 if i == 1 else self.t2)
        a_sel = a if rows is None else a[:, r]
        return (a_sel.t() @ t) @ b

    def _delta(self, device, ct, rows, weight) -> Tensor:
        m = self._factor(1, device, ct, rows)
        return m.mul_(self._factor(2, device, ct, rows)).mul_(self.scale)

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

    def _forward(self, x, strength, base_out_nobias, weight) -> Tensor:
        o, i = self.out_features, self.in_features
        k = self.hadamard_rank
        if k * (o + i) < o * i:
            # (L1 R1) ⊙ (L2 R2) = U Z with U[o,(p,q)] = L1[o,p] L2[o,q] and Z[(p,q),j] = R1[p,j] R2[q,j]
            # (row-wise Khatri-Rao products): a rank-k1*k2 LoRA, no dense [out, in] delta.
            key = ("kr", str(x.device), x.dtype)
            uz = self._cache.get(key)
            if uz is None:
                ct = _ct(x.dtype)
                (l1, r1), (l2, r2) = self._pair(1, x.device, ct), self._pair(2, x.device, ct)
                u = (l1.unsqueeze(2) * l2.unsqueeze(1)).reshape(o, k)
                z = (r1.unsqueeze(1) * r2.unsqueeze(0)).reshape(k, i)
                uz = self._cache[key] = (u.to(x.dtype).contiguous(), z.to(x.dtype).contiguous())
            u, z = uz
            h = F.linear(x, z)
            c = self.scale * strength
            if c != 1.0:
                h = h * c
            return F.linear(h, u)
        key = ("dense", str(x.device), x.dtype)
        d = self._cache.get(key)
        if d is None:
            d = self._cache[key] = self._delta(x.device, _ct(x.dtype), None, None).to(x.dtype)
        y = F.linear(x, d)
        return y * strength if strength != 1.0 else y


class LoKr(Variant):
    """LoKr (LyCORIS): delta = scale * kron(w1, w2), w1 [a, b], w2 [c, d], out = a*c, in = b*d.

    w1 = ``lokr_w1`` or ``lokr_w1_a`` [a, r1] @ ``lokr_w1_b`` [r1, b];
    w2 = ``lokr_w2`` or ``lokr_w2_a`` [c, r2] @ ``lokr_w2_b`` [r2, d], or with Tucker
    ``lokr_t2`` [ra, rb]: w2 = w2_a^T t2 w2_b with w2_a [ra, c], w2_b [rb, d].

    Dynamic path without the dense [out, in] delta: kron(w1, w2)[p*c+q, j*d+k] =
    w1[p, j] w2[q, k], so for x viewed as X [..., b, d], y viewed as [..., a, c] is
    (w1 @ X) @ w2^T: w1 mixes the input-sized tensor first, so the output-sized tensor is
    written once. Only the small dense w1 and w2 are built (cached per device/dtype); a
    factorised w2 runs as two thin GEMMs when that halves the flops.
    """

    kind = "lokr"

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
        cv = lambda t, n: None if t is None else _as_linear(t, s, n)  # noqa: E731
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
        self._check_bias()

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
    def scale(self) -> float:
        return 1.0 if self.alpha is None or self.dim is None else self.alpha / self.dim

    @property
    def out_features(self) -> int:
        return self.w1_shape[0] * self.w2_shape[0]

    @property
    def in_features(self) -> int:
        return self.w1_shape[1] * self.w2_shape[1]

    def tensors(self) -> dict[str, Tensor]:
        names = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
        vals = (self.w1, self.w1_a, self.w1_b, self.w2, self.w2_a, self.w2_b, self.t2)
        t = {n: v for n, v in zip(names, vals) if v is not None}
        if self.diff_b is not None:
            t["diff_b"] = self.diff_b
        return t

    def kron_factors(self, device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Dense (w1 [a, b], w2 [c, d]) on device in dtype, unscaled; cached."""
        def make1():
            return self.w1 if self.w1 is not None else self.w1_a.double() @ self.w1_b.double()

        def make2():
            if self.w2 is not None:
                return self.w2
            if self.t2 is not None:
                return (self.w2_a.double().t() @ self.t2.double()) @ self.w2_b.double()
            return self.w2_a.double() @ self.w2_b.double()

        # contiguous: torch.kron fails on some non-contiguous inputs (einsum/transposed outputs)
        return (self._on(device, dtype, "w1", lambda: make1().contiguous()),
                self._on(device, dtype, "w2", lambda: make2().contiguous()))

    def _delta(self, device, ct, rows, weight) -> Tensor:
        w1, w2 = self.kron_factors(device, ct)
        if rows is None:
            return torch.kron(w1, w2).mul_(self.scale)
        c = w2.shape[0]
        idx = torch.arange(self.out_features, device=device)[_rows_on(rows, device)]
        p, q = idx // c, idx % c
        block = w1[p].unsqueeze(2) * w2[q].unsqueeze(1)  # [n, b, d]
        return block.reshape(idx.numel(), -1).mul_(self.scale)

    def _forward(self, x, strength, base_out_nobias, weight) -> Tensor:
        w1, w2 = self.kron_factors(x.device, x.dtype)
        c = self.scale * strength
        if c != 1.0:
            w1 = w1 * c  # the smaller factor
        b, d = w1.shape[1], w2.shape[1]
        xv = x.reshape(*x.shape[:-1], b, d)
        # mix over w1 first, on the input-sized [..., b, d] -> [..., a, d] (cheap), so the only
        # output-sized tensor is the final one: y[..., p, :] = (sum_j w1[p, j] X[..., j, :]) w2^T
        u = torch.matmul(w1, xv)
        r = None if self.w2 is not None or self.t2 is not None else int(self.w2_b.shape[0])
        if r is not None and 2 * r * (w2.shape[0] + d) < w2.shape[0] * d:
            # factorised w2 = w2_a w2_b: two thin GEMMs at under half the dense product's flops
            w2a = self._on(x.device, x.dtype, "w2_a", lambda: self.w2_a)
            w2b = self._on(x.device, x.dtype, "w2_b", lambda: self.w2_b)
            y = F.linear(F.linear(u, w2b), w2a)
        else:
            y = F.linear(u, w2)  # [..., a, c]
        return y.reshape(*x.shape[:-1], self.out_features)


class DoRA(Variant):
    """DoRA: W' = m ⊙ (W + s·dW) / ||W + s·dW|| around a LoRA / LoHa / LoKr `inner`.

    ``delta`` (needs ``weight=``) is W' - W; strength multiplies it (ComfyUI's rule).

    Per-row norm (``axis == "out"``), dynamic path without a dense delta per call:
    with g = m / (||W + s·dW||_row + eps) (a vector [out], cached per base weight; its
    norms are computed once from dense row chunks of W + s·dW, bounded in memory),
    ``y' - y = strength * ((g - 1) ⊙ (x W^T) + g ⊙ inner(x))`` where inner(x) = s·x dW^T
    comes from the inner variant's factorised path (bias excluded: it is not scaled).

    Per-column norm (``axis == "in"``): W' = (W + s·dW) ⊙ (m / ||·||_col) scales columns,
    so there is no per-output factor; `forward_delta` builds the dense W' - W once per
    base weight and (device, dtype), caches it and runs one F.linear (times strength).
    """

    kind = "dora"

    def __init__(self, inner: Variant, magnitude: Tensor, *, stem: str = "", comfy_quirk: bool = False,
                 eps: float | None = None, diff_b: Tensor | None = None):
        if not isinstance(inner, (LoRA, LoHa, LoKr)):
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
        self._check_bias()

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
        if len(self._cache) >= 4 * _MAX_CACHE:
            for k in [k for k in self._cache if k[0] in ("norm", "g", "dense")][:_MAX_CACHE]:
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
        ct = _ct(dtype)
        key = ("norm", _wkey(weight), ct)
        n = self._cache.get(key)
        if n is not None:
            return n
        dev, out_f, in_f = weight.device, self.out_features, self.in_features
        if self.axis == "out" and self.comfy_quirk:
            n = torch.linalg.vector_norm(weight.to(ct), dim=1)
        else:
            step = max(1, _CHUNK_ELEMS // max(1, in_f))
            acc = torch.zeros(out_f if self.axis == "out" else in_f, device=dev, dtype=ct)
            for r0 in range(0, out_f, step):
                rs = slice(r0, min(out_f, r0 + step))
                wc = weight[rs].to(ct) + self.inner._delta(dev, ct, rs, None)
                if self.axis == "out":
                    acc[rs] = torch.linalg.vector_norm(wc, dim=1)
                else:
                    acc += wc.square().sum(0)
            n = acc if self.axis == "out" else acc.sqrt_()
        return self._remember(key, n.add_(self.eps))

    def magnitude_over_norm(self, weight: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """g = m / norm: [out] (axis "out") or [in] (axis "in"); cached with the norm."""
        ct = _ct(dtype)
        key = ("g", _wkey(weight), ct)
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
                            "use delta()/forward_delta(), which build the dense delta")
        g = self.magnitude_over_norm(weight)
        return g.clone() if strength == 1.0 else (g - 1.0).mul_(strength).add_(1.0)

    def delta(self, device="cpu", dtype: torch.dtype = torch.float32, rows=None, *,
              weight: Tensor | None = None, norm: Tensor | None = None) -> Tensor:
        """W' - W (rows optional), not times strength. `weight` is required; `norm` lets a
        chunked in-place merge use norms taken before the first write (see `norm_of`)."""
        d = self._dora_delta(_dev(device), _ct(dtype), rows, weight, norm)
        return d if d.dtype == dtype else d.to(dtype)

    def _delta(self, device, ct, rows, weight) -> Tensor:
        return self._dora_delta(device, ct, rows, weight, None)

    @torch.no_grad()
    def _dora_delta(self, device, ct, rows, weight, norm) -> Tensor:
        weight = self._check_weight(weight)
        r = _rows_on(rows, weight.device)
        w = (weight if rows is None else weight[r]).to(device=device, dtype=ct)
        wc = w + self.inner._delta(device, ct, rows, None)
        m = self._m(device, ct)
        if self.axis == "out":
            if norm is not None:
                n = norm.to(device=device, dtype=ct)
                n = n if rows is None else n[_rows_on(rows, device)]
            elif ("norm", _wkey(weight), ct) in self._cache:
                n = self._cache[("norm", _wkey(weight), ct)].to(device)
                n = n if rows is None else n[_rows_on(rows, device)]
            else:  # per-row norms need only these rows
                src = w if self.comfy_quirk else wc
                n = torch.linalg.vector_norm(src, dim=1).add_(self.eps)
            mr = m if rows is None else m[_rows_on(rows, device)]
            return wc.mul_((mr / n).unsqueeze(1)).sub_(w)
        n = (norm if norm is not None else self.norm_of(weight, ct)).to(device=device, dtype=ct)
        return wc.mul_((m / n).unsqueeze(0)).sub_(w)

    def forward_delta(self, x: Tensor, strength: float = 1.0, base_out_nobias: Tensor | None = None,
                      weight: Tensor | None = None, *, include_bias: bool = True) -> Tensor:
        """strength * (x W'^T - x W^T) (+ strength * diff_b). `weight` is required;
        `base_out_nobias` (= x W^T, no bias) saves a GEMM on the per-row path."""
        return super().forward_delta(x, strength, base_out_nobias, weight, include_bias=include_bias)

    def _forward(self, x, strength, base_out_nobias, weight) -> Tensor:
        weight = self._check_weight(weight)
        if strength == 0.0:
            return x.new_zeros(*x.shape[:-1], self.out_features)
        if self.axis == "out":
            g = self.magnitude_over_norm(weight).to(device=x.device, dtype=x.dtype)
            y0 = base_out_nobias if base_out_nobias is not None else F.linear(x, weight.to(x.device, x.dtype))
            y = (g - 1) * y0 + g * self.inner._forward(x, 1.0, None, None)
        else:
            key = ("dense", _wkey(weight), str(x.device), x.dtype)
            d = self._cache.get(key)
            if d is None:
                d = self._remember(key, self._dora_delta(x.device, _ct(x.dtype), None, weight, None).to(x.dtype))
            y = F.linear(x, d)
        return y * strength if strength != 1.0 else y


class Sliced(Variant):
    """Updates on output-row slices of one fused weight (Flux ``to_q``/``to_k``/``to_v`` ->
    ``qkv``, single-block ``proj_mlp`` -> ``linear1``, ...).

    ``parts`` is a list of ``(start, stop, variant)``: each variant's update lands in
    rows [start, stop) of the [out_features, in] weight; rows no part covers get zero.
    Parts may not overlap. Each part keeps its own scale and its own ``diff_b`` (gathered
    here into one [out] offset with zeros elsewhere). DoRA parts get ``weight[start:stop]``.
    Not fusable: a LoRA-aware fused kernel takes one stacked full-width pair.
    """

    kind = "sliced"

    def __init__(self, parts, out_features: int, *, stem: str = ""):
        # shallow copies: the parts' diff_b move into this offset without touching the
        # variants the caller (a cached adapter) keeps
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
            idx = idx[_rows_on(rows, device)]
        out = torch.zeros(idx.numel(), self._in, device=device, dtype=ct)
        for a, b, v in self.parts:
            sel = ((idx >= a) & (idx < b)).nonzero().squeeze(1)
            if sel.numel():
                w = None if weight is None else weight[a:b]
                out[sel] = v._delta(device, ct, idx[sel] - a, w)
        return out

    def _forward(self, x, strength, base_out_nobias, weight) -> Tensor:
        y = x.new_zeros(*x.shape[:-1], self._out)
        for a, b, v in self.parts:
            w = None if weight is None else weight[a:b]
            y0 = None if base_out_nobias is None else base_out_nobias[..., a:b]
            y[..., a:b] = v._forward(x, strength, y0, w)
        return y


# --- detection ------------------------------------------------------------------------
_ROLE_PATTERNS: list[tuple[re.Pattern, str]] = [
    (re.compile(r"^(?:lora_down\.weight|lora\.down\.weight|lora_linear_layer\.down\.weight"
                r"|lora_A(?:\.[A-Za-z0-9_\-]+)?\.weight|lora_A|down)$"), "down"),
    (re.compile(r"^(?:lora_up\.weight|lora\.up\.weight|lora_linear_layer\.up\.weight"
                r"|lora_B(?:\.[A-Za-z0-9_\-]+)?\.weight|lora_B|up)$"), "up"),
    (re.compile(r"^(?:dora_scale|dora|lora_magnitude_vector(?:\.[A-Za-z0-9_\-]+)?(?:\.weight)?)$"), "dora"),
    (re.compile(r"^(?:alpha|hada_w1_a|hada_w1_b|hada_w2_a|hada_w2_b|hada_t1|hada_t2|lokr_w1|lokr_w1_a"
                r"|lokr_w1_b|lokr_w2|lokr_w2_a|lokr_w2_b|lokr_t2|diff|diff_b)$"), ""),  # role = the name
]

_UNSUPPORTED: dict[str, str] = {
    "lora_mid.weight": "LoCon Tucker mid factor (convolutions only)",
    "oft_blocks": "OFT/BOFT", "oft_diag": "OFT", "rescale": "OFT/BOFT",
    "a1.weight": "GLoRA", "a2.weight": "GLoRA", "b1.weight": "GLoRA", "b2.weight": "GLoRA",
    "reshape_weight": "weight reshaping", "w_norm": "norm-layer diff", "b_norm": "norm-layer diff",
    "set_weight": "weight replacement ('set')",
}


def classify_part(part: str) -> str | None:
    """The role of a key part: 'down', 'up', 'dora', or the canonical name (alpha,
    hada_*, lokr_*, diff, diff_b); None when unknown."""
    for pattern, role in _ROLE_PATTERNS:
        if pattern.match(part):
            return role or part
    return None


def detect(parts: Mapping[str, Tensor], alpha: float | None = None, *, stem: str = "", rslora: bool = False,
           comfy_quirk: bool = False, eps: float | None = None) -> Variant:
    """Pick and build the variant the key parts describe (accepted names: module docstring).

    `alpha` wins over an ``alpha`` part. `rslora` applies to LoRA only; `comfy_quirk`
    and `eps` to DoRA only.
    """
    stem = stem or "<layer>"
    roles: dict[str, Tensor] = {}
    names: dict[str, str] = {}
    for part, t in parts.items():
        if part in _UNSUPPORTED:
            raise NotImplementedError(f"{stem}.{part}: {_UNSUPPORTED[part]} is not supported")
        role = classify_part(part)
        if role is None:
            raise AdapterFormatError(f"{stem}.{part}: unknown adapter key part")
        if role in roles:
            raise AdapterFormatError(f"{stem}: {names[role]!r} and {part!r} both give the {role!r} tensor")
        roles[role], names[role] = t, part

    if "alpha" in roles:
        a = roles.pop("alpha")
        if alpha is None:
            if isinstance(a, Tensor) and a.numel() != 1:
                raise AdapterFormatError(f"{stem}.{names['alpha']}: alpha must be a scalar, "
                                         f"got shape {tuple(a.shape)}")
            alpha = float(a.item() if isinstance(a, Tensor) else a)
    dora = roles.pop("dora", None)
    diff_b = roles.pop("diff_b", None)

    fams = {
        "LoRA": [r for r in ("down", "up") if r in roles],
        "LoHa": [r for r in roles if r.startswith("hada_")],
        "LoKr": [r for r in roles if r.startswith("lokr_")],
        "diff": [r for r in ("diff",) if r in roles],
    }
    present = [f for f, rs in fams.items() if rs]
    if len(present) > 1:
        raise AdapterFormatError(
            f"{stem}: keys of several adapter types on one layer ({', '.join(present)}: "
            f"{sorted(names[r] for f in present for r in fams[f])}); save one type per layer")
    if not present:
        if dora is not None:
            raise AdapterFormatError(f"{stem}: {names['dora']} without LoRA/LoHa/LoKr weights")
        if diff_b is not None:
            return BiasOnly(diff_b, alpha, stem=stem)
        raise AdapterFormatError(f"{stem}: no adapter weights among {sorted(parts)}")

    fam = present[0]
    if fam == "LoRA":
        missing = [r for r in ("down", "up") if r not in roles]
        if missing:
            raise AdapterFormatError(f"{stem}: LoRA {names[fams['LoRA'][0]]!r} without its "
                                     f"{missing[0]} matrix (lora_{missing[0]}.weight / "
                                     f"lora_{'A' if missing[0] == 'down' else 'B'}.weight)")
        v: Variant = LoRA(roles["down"], roles["up"], alpha, stem=stem, rslora=rslora)
    elif fam == "LoHa":
        need = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
        missing = [n for n in need if n not in roles]
        if missing:
            raise AdapterFormatError(f"{stem}: LoHa is missing {missing}")
        v = LoHa(*(roles[n] for n in need), alpha, t1=roles.get("hada_t1"), t2=roles.get("hada_t2"), stem=stem)
    elif fam == "LoKr":
        g = roles.get
        v = LoKr(w1=g("lokr_w1"), w1_a=g("lokr_w1_a"), w1_b=g("lokr_w1_b"), w2=g("lokr_w2"),
                 w2_a=g("lokr_w2_a"), w2_b=g("lokr_w2_b"), t2=g("lokr_t2"), alpha=alpha, stem=stem)
    else:
        if dora is not None:
            raise AdapterFormatError(f"{stem}: {names['dora']} with a full 'diff' (ComfyUI applies DoRA "
                                     "to LoRA/LoHa/LoKr only)")
        return Full(roles["diff"], alpha, stem=stem, diff_b=diff_b)
    if dora is not None:
        return DoRA(v, dora, stem=stem, comfy_quirk=comfy_quirk, eps=eps, diff_b=diff_b)
    if diff_b is not None:
        v.diff_b = diff_b.reshape(-1)
        v._check_bias()
    return v
