"""`LayerAdapter` (one file layer and its update) and `LoraAdapter` (one loaded file)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import updates
from ..updates.registry import to_matrices
from .param_deltas import PARAM_ONLY


class LayerAdapter:
    """One file layer: its ``stem`` (the file's naming), ``keys``, output ``rows`` of a fused
    weight (set by the matcher) and its ``update`` (`updates.Update`). A layer whose update
    targets a parameter rather than a Linear/Conv weight (``diff_m``, ``w_norm``/``b_norm``, a
    ``diff`` that is not a matrix) has ``update = None`` and keeps its raw ``parts`` (the matcher
    makes them parameter deltas). ``kernel``: the trailing kernel shape of a conv (LoCon) update,
    flattened into the input dim of the matrices. The keyword constructor (down / up / alpha /
    dora_scale / diff / diff_b) builds the update from raw tensors, as the loader does."""

    def __init__(self, stem: str, down=None, up=None, alpha: float | None = None, dora_scale=None, diff=None,
                 diff_b=None, keys=None, rslora: bool = False, alpha_source: str = "", *,
                 parts: dict | None = None, update: updates.Update | None = None):
        self.stem = stem
        self.keys = list(keys or [])
        self.alpha_source = alpha_source
        raw = dict(parts or {})
        for k, t in (("down", down), ("up", up), ("dora", dora_scale), ("diff", diff), ("diff_b", diff_b)):
            if t is not None:
                raw[k] = t
        self.parts = raw
        self.kernel: tuple[int, ...] = ()
        self.rows: tuple[int, int] | None = None   # output-row slice of a fused weight (set by the matcher)
        if update is None and not self.param_like:
            update = updates.detect(self._matrix_parts(), alpha, stem=stem, rslora=rslora)
        self.update = update

    @property
    def param_like(self) -> bool:
        """A delta of a parameter (bare parameter, norm weight/bias), not of a matrix."""
        names = set(self.parts) - {"alpha"}
        if not names or not names <= PARAM_ONLY:
            return False
        d = self.parts.get("diff")
        return bool(names & {"diff_m", "w_norm", "b_norm"}) or (d is not None and d.dim() != 2)

    def build_update(self, alpha: float | None = None) -> updates.Update:
        """The update of a ``diff`` kept raw at load (a conv-shaped full delta), once the
        target turned out to be a conv weight."""
        if self.update is None:
            self.update = updates.detect(self._matrix_parts(), alpha, stem=self.stem)
        return self.update

    def _matrix_parts(self) -> dict:
        """Parts for `updates.detect`, conv (LoCon) factors rewritten as matrices by their types."""
        out, kernel = to_matrices(self.parts, self.stem)
        if kernel:
            self.kernel = kernel
        return out

    def __repr__(self) -> str:
        return f"LayerAdapter({self.stem!r}, {self.update!r})"


@dataclass
class LoraAdapter:
    name: str
    path: str
    layers: dict[str, LayerAdapter]
    format: str
    content_hash: str
    metadata: dict[str, str] = field(default_factory=dict)
    ignored_keys: dict[str, str] = field(default_factory=dict)  # key -> why
    scale_source: str = ""                                      # where the layers' alphas came from
    notes: list[str] = field(default_factory=list)              # facts the user should see on the report
    text_encoder: dict[str, LayerAdapter] = field(default_factory=dict)  # text-encoder layers (not the model's)
    # the file's tensors of those layers, as stored (key -> tensor): what a CLIP loader reads
    text_encoder_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
