"""Parameter deltas: a file layer's deltas of parameters that have no matrix product to ride on.

Norm weights and biases (``w_norm`` / ``b_norm``, or ``diff`` / ``diff_b`` on a norm module) and
bare parameters (``diff_m`` or ``diff`` on e.g. Wan's ``blocks.N.modulation``). `param_deltas`
makes a layer's `ParamDelta`s or says why it cannot; `param_patch.ParamPatch` merges them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import AdapterFormatError
from ..layer.base_weight import real_shape

PARAM_ONLY = frozenset({"diff", "diff_b", "diff_m", "w_norm", "b_norm"})   # the parts a parameter delta has


@dataclass
class ParamDelta:
    """One file layer's delta for one parameter of the model."""

    stem: str        # the file's stem
    part: str        # diff / diff_b / diff_m / w_norm / b_norm
    target: str      # the model's parameter name
    delta: torch.Tensor

    kind = "param"

    @property
    def keys(self) -> list[str]:
        return [f"{self.stem}.{self.part}"]

    def nbytes(self) -> int:
        return self.delta.numel() * self.delta.element_size()


def param_deltas(adapter_name: str, la, target: str, module: nn.Module | None,
                 params: dict) -> list[ParamDelta] | str:
    """The parameter deltas of a file layer that targets a norm module or a bare
    parameter, or the reason it cannot (a string)."""
    parts = {k: v for k, v in la.parts.items() if k != "alpha"}
    if not set(parts) <= PARAM_ONLY:
        return (f"a {la.update.kind if la.update is not None else 'param'} update on {type(module).__name__ if module is not None else 'parameter'} "
                f"{target!r}, which has no matrix weight")
    out: list[ParamDelta] = []
    if module is None:  # a bare parameter: diff / diff_m
        extra = set(parts) - {"diff", "diff_m"}
        if extra or len(parts) != 1:
            return f"parameter {target!r} takes one diff/diff_m delta, the file has {sorted(parts)}"
        (part, t), = parts.items()
        wanted = [(target, part, t)]
    else:
        wanted = []
        for part, attr in (("diff", "weight"), ("w_norm", "weight"), ("diff_b", "bias"), ("b_norm", "bias")):
            if part in parts:
                wanted.append((f"{target}.{attr}" if target else attr, part, parts[part]))
        if "diff_m" in parts:
            return f"diff_m names a bare parameter, but {target!r} is a {type(module).__name__}"
    for name, part, t in wanted:
        p = params.get(name)
        if p is None:
            return f"{part} for {name!r}, which the model does not have"
        shape = real_shape(p)  # a packed parameter's storage is not its shape
        if t.numel() != math.prod(shape):
            raise AdapterFormatError(
                f"{adapter_name}: key {la.stem}.{part} has {tuple(t.shape)} values but {name!r} is "
                f"{shape}. The adapter was trained for a different model size; pick the matching adapter")
        out.append(ParamDelta(la.stem, part, name, t.reshape(shape)))
    return out
