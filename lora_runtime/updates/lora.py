"""LoRA: delta = scale * up @ down; down (A) [r, in], up (B) [out, r].

Keys: ``lora_down.weight`` / ``lora_up.weight``, ``lora.down.weight``, ``lora_linear_layer.down.weight``,
``lora_A[.<slot>].weight`` / ``lora_B[...]``, ``lora_A`` / ``lora_B``, ``down`` / ``up``.
Scale: ``alpha / rank`` (rsLoRA: ``alpha / sqrt(rank)``); no alpha: 1.0.
The only type that answers `stack()`.
"""
from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import AdapterFormatError
from ..scaling import combined_factor, times
from .base import Update, as_linear, rows_on, swap_halves
from .conv_cores import fold_mid
from .trace_forms import PairForm


class LoRA(Update):
    kind = "lora"
    label = "LoRA"
    KEY_PARTS = (
        (re.compile(r"^(?:lora_down\.weight|lora\.down\.weight|lora_linear_layer\.down\.weight"
                    r"|lora_A(?:\.[A-Za-z0-9_\-]+)?\.weight|lora_A|down)$"), "down"),
        (re.compile(r"^(?:lora_up\.weight|lora\.up\.weight|lora_linear_layer\.up\.weight"
                    r"|lora_B(?:\.[A-Za-z0-9_\-]+)?\.weight|lora_B|up)$"), "up"),
    )
    ROLES = ("down", "up")
    FILE_KEYS = (
        (re.compile(r"\.lora_down\.weight$"), "down"),
        (re.compile(r"\.lora_up\.weight$"), "up"),
        (re.compile(r"\.lora\.down\.weight$"), "down"),
        (re.compile(r"\.lora\.up\.weight$"), "up"),
        (re.compile(r"\.lora_linear_layer\.down\.weight$"), "down"),
        (re.compile(r"\.lora_linear_layer\.up\.weight$"), "up"),
        (re.compile(r"\.lora_A(?:\.(?P<slot>[A-Za-z0-9_\-]+))?\.weight$"), "down"),
        (re.compile(r"\.lora_B(?:\.(?P<slot>[A-Za-z0-9_\-]+))?\.weight$"), "up"),
        # XLabs: double_blocks.0.processor.qkv_lora1.down.weight (ComfyUI lora_convert.convert_uso_lora)
        (re.compile(r"(?<=_lora[12])\.down\.weight$|(?<=_lora)\.down\.weight$"), "down"),
        (re.compile(r"(?<=_lora[12])\.up\.weight$|(?<=_lora)\.up\.weight$"), "up"),
    )
    FORMATS = ((0, re.compile(r"\.lora_[AB]"), "peft"), (2, re.compile(r"lora_down|lora_up"), "kohya"))
    SUPPORTED = "lora_down/lora_up, lora_A/lora_B"
    takes_dora = True
    scaled_by_alpha = True

    def __init__(self, down: Tensor, up: Tensor, alpha: float | None = None, *, stem: str = "",
                 rslora: bool = False, diff_b: Tensor | None = None):
        super().__init__(stem, alpha, diff_b)
        self.down = as_linear(down, self.stem, "down")
        self.up = as_linear(up, self.stem, "up")
        self.rslora = bool(rslora)
        if self.up.shape[1] != self.down.shape[0]:
            raise self._err(f"up is {tuple(self.up.shape)} and down is {tuple(self.down.shape)}: "
                            f"up has {self.up.shape[1]} columns, down has {self.down.shape[0]} rows (the rank)")
        self.check_bias()

    @classmethod
    def to_matrices(cls, parts, stem):
        """A LoCon Tucker core folded into down; a conv down flattened to [r, in * K]; a 1x1 up squeezed."""
        if "lora_mid.weight" in parts and "down" in parts:
            parts["down"] = fold_mid(parts.pop("lora_mid.weight"), parts["down"], stem)
        down, up = parts.get("down"), parts.get("up")
        kernel: tuple[int, ...] = ()
        if down is not None and down.dim() > 2:
            kernel = tuple(int(k) for k in down.shape[2:])
            parts["down"] = down.reshape(down.shape[0], -1)
            if up is not None and up.dim() > 2:
                if any(k != 1 for k in up.shape[2:]):
                    raise AdapterFormatError(f"{stem}: the up factor has a {tuple(up.shape[2:])} kernel; only "
                                             "LoCon with a 1x1 up convolution is supported")
                parts["up"] = up.reshape(up.shape[0], up.shape[1])
        elif up is not None and up.dim() > 2 and all(k == 1 for k in up.shape[2:]):
            parts["up"] = up.reshape(up.shape[0], up.shape[1])
        return kernel

    @classmethod
    def from_roles(cls, roles, names, alpha, *, stem, diff_b=None, rslora: bool = False, **_):
        missing = [r for r in cls.ROLES if r not in roles]
        if missing:
            first = names[[r for r in cls.ROLES if r in roles][0]]
            raise AdapterFormatError(f"{stem}: LoRA {first!r} without its "
                                     f"{missing[0]} matrix (lora_{missing[0]}.weight / "
                                     f"lora_{'A' if missing[0] == 'down' else 'B'}.weight)")
        return cls(roles["down"], roles["up"], alpha, stem=stem, rslora=rslora)

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

    def stack(self, device=None, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, float]:
        if device is None and dtype is None:
            return self.down, self.up, self.scale
        down, up = self.factors(device, dtype)
        return down, up, self.scale

    def swapped_halves(self) -> "LoRA":
        return LoRA(self.down, swap_halves(self.up), self.alpha, stem=self.stem, rslora=self.rslora,
                    diff_b=swap_halves(self.diff_b))

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
            up = up[rows_on(rows, device)]
        return times(up @ down, self.scale, inplace=True)

    def trace_form(self, device, dtype: torch.dtype, weight: Tensor | None = None):
        down, up = self.factors(device, dtype)
        return PairForm(down, up), self.scale

    def folded_delta(self, device, factor: float, rows=None, *, weight: Tensor | None = None) -> Tensor:
        """``(up @ down) * (scale * factor)``: one pass over the delta with the fp64 product of the
        factors (ComfyUI's `calculate_weight` order, so a lossless merge writes its bits), not
        one pass per factor."""
        down, up = self.factors(device, torch.float32)
        if rows is not None:
            up = up[rows_on(rows, device)]
        return times(up @ down, combined_factor(self.scale, factor), inplace=True)

    def _forward(self, x, factor, base_out_nobias, weight) -> Tensor:
        down, up = self.factors(x.device, x.dtype)
        h = times(F.linear(x, down), combined_factor(self.scale, factor))  # on the small [..., r] tensor
        return F.linear(h, up)
