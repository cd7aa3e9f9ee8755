"""Deltas on parameters that have no matrix product of their own to ride on.

Norm weights and biases (``w_norm`` / ``b_norm``, or ``diff`` / ``diff_b`` on a norm
module) and bare parameters (``diff_m`` or ``diff`` on e.g. Wan's ``blocks.N.modulation``
and ``head.modulation``) are what distillation adapters (lightx2v-style) carry beside
their LoRA layers. ComfyUI adds them into the parameters; so does this module, in every
merge mode: such a parameter is read inside the block's own code (``x * (1 + scale) +
shift``, a norm's affine), so there is no module output to add a delta to at run time.

Contract
- `ParamPatch` holds the deltas of all adapters for one parameter; ``merge()`` writes
  ``round(fp32(p) + sum_i strength_i * delta_i)`` with the same one-rounding, finite-check-
  before-write merge as Linear weights (`merge.merge_weight`) and ``restore()`` puts the
  parameter back bit for bit (fingerprint-checked), also after the parameter moved device.
- ``share_lost`` is the share of the update the merge rounded away (the report shows
  it: a sub-ulp norm delta merged into bf16 is visible, never silent).
- A parameter that is not a plain float tensor (quantized, fp8, meta) refuses the merge
  with an error naming it.
- A weight or bias of a module whose weights the host stages itself (`cast_site`: ComfyUI dynamic
  VRAM streams the module through a virtual-VRAM range and copies of it) is never written: its
  deltas ride as a cast-time patch on the module's own ``weight_function`` / ``bias_function`` list
  (``p + sum_i strength_i * delta_i`` in fp32, rounded once to the cast dtype, at every cast), and
  ``restore()`` takes that patch off. A write into the stored tensor would miss the host's staged
  copies, and would stay in them after the restore.
"""
from __future__ import annotations

import torch

from .errors import MergeRefusedError
from .files.param_deltas import ParamDelta
from .layer.base_weight import float_view, instance_list, own_storage, packed_reason
from .layer.merge import RestoreRecord, merge_weight, restore_weight, rounding_loss_sums


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view (rows, cols) of a parameter or delta: [n] -> [1, n], [a, ...] -> [a, -1].
    A view (never a copy), so writes reach the parameter."""
    return t.view(1, -1) if t.dim() <= 1 else t.view(t.shape[0], -1)


class ParamPatch:
    """The merged deltas of every adapter on one parameter."""

    def __init__(self, name: str, param: torch.Tensor, cast_site: tuple | None = None):
        self.name = name
        self.param = param
        self.cast_site = cast_site   # (module, "weight" | "bias") when the host stages the module's weights
        self.entries: list[tuple[str, ParamDelta, float]] = []   # (adapter name, delta, strength)
        self._restore: RestoreRecord | None = None
        self._cast_fn = None         # the cast-time patch while on (cast_site only)
        self.share_lost = 0.0

    def add(self, adapter: str, delta: ParamDelta, strength: float) -> None:
        self.entries.append((adapter, delta, float(strength)))

    @property
    def merged(self) -> bool:
        return self._restore is not None or self._cast_fn is not None

    def _view(self) -> torch.Tensor | None:
        """The parameter as a plain float tensor (a view: writes reach it; a GGUF F32/F16/BF16
        tensor included, `base_weight.float_view`), or None when it is not stored as floats."""
        v = float_view(self.param)
        return None if v is None else v.detach()

    def _rows(self, rows) -> torch.Tensor:
        p = _as_rows(self._view())
        out = torch.zeros(p[rows].shape, dtype=torch.float32, device=p.device)
        for _, d, s in self.entries:
            if s != 0.0:
                out += _as_rows(d.delta.contiguous()).to(p.device, torch.float32)[rows] * s
        return out

    def merge(self) -> None:
        p = self.param
        if self._view() is None:
            raise MergeRefusedError(f"parameter {self.name}: cannot add the adapters' delta to a "
                                    f"{type(p).__name__} of dtype {p.dtype} ({packed_reason(p)}); this parameter "
                                    "is read inside the block's own code, so no merge mode can apply it. Load the "
                                    "model in bf16/fp16/fp32 (a GGUF F16/BF16 file works too)")
        if self.merged or not any(s != 0.0 for _, _, s in self.entries):
            return
        view = _as_rows(self._view())
        err, tot = rounding_loss_sums(view, self._rows)
        self.share_lost = (err / tot) ** 0.5 if tot > 0 else 0.0
        who = ", ".join(sorted({a for a, _, _ in self.entries}))
        if self.cast_site is not None:
            self._patch_at_cast(who)
            return
        own_storage(p)  # a GGUF file's read-only map is never written
        self._restore = merge_weight(view, self._rows, what=f"adapter(s) {who}: parameter {self.name}")

    def _patch_at_cast(self, who: str) -> None:
        module, attr = self.cast_site
        lst = instance_list(module, f"{attr}_function")
        if lst is None:
            raise MergeRefusedError(f"adapter(s) {who}: parameter {self.name}: the host stages this module's "
                                    f"weights itself and its {type(module).__name__} takes no {attr} patch at cast "
                                    "time, so its delta cannot be applied")
        delta = self._rows(slice(None)).reshape(self.param.shape)
        if not bool(torch.isfinite(delta).all()):
            raise MergeRefusedError(f"adapter(s) {who}: parameter {self.name}: the delta is not finite (inf/NaN)")

        def at_cast(t: torch.Tensor) -> torch.Tensor:
            return (t.to(torch.float32) + delta.to(t.device)).to(t.dtype)

        lst.append(at_cast)
        self._cast_fn = at_cast

    def restore(self) -> None:
        if self._cast_fn is not None:
            module, attr = self.cast_site
            lst = getattr(module, f"{attr}_function", None)
            if isinstance(lst, list) and self._cast_fn in lst:
                lst.remove(self._cast_fn)
            self._cast_fn = None
            return
        if self._restore is None:
            return
        restore_weight(_as_rows(self._view()), self._restore, self._rows, what=f"parameter {self.name}")
        self._restore = None

    @property
    def restore_bytes(self) -> int:
        return self._restore.nbytes if self._restore is not None else 0
