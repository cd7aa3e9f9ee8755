"""Key dialects: where an adapter key's stem goes in a ComfyUI diffusion model.

Contract
- ``resolve(stem, modules, *, prefer=None, family=None) -> Target | None``: ``stem`` is a file
  key without its part suffix (`key_formats.split_key`), ``modules`` the diffusion model's own
  ``dict(model.named_modules())`` (names like ``double_blocks.0.img_attn.qkv``). A `Target`
  names the native module (or a bare parameter, ``param=True``), the OUTPUT rows
  ``[start, stop)`` of its weight the delta covers (``rows``; None = whole; a ``diff_b`` covers
  the same rows of the bias), the dialect label, and ``swap_halves`` (the adapter's rows are the
  target's two halves exchanged; never with ``rows``). None: the stem names nothing in this
  model, or names it ambiguously. ``prefer``: the naming that wins where a name means different
  modules in two namings; ``family``: the host's family ('' = none of the tables; None = read
  from the module names).
- ``resolve_all(stems, modules)``: one file's stems, read in the naming the file as a whole uses.
- ``dialect_name(stems, modules=None)``: the dialect most stems are written in (a `DIALECTS`
  name); never ``"unknown"`` when a stem resolved.
- ``overlaps(targets)``: pairs of targets on intersecting rows of one module.
The jobs live in their own modules (`stem_prefix`, `family_tables`, `dialect_table`,
`model_index`, `resolve`, `dialect_name`); this module is their one way in. How a stem is read
and where the facts come from: docs/engine.md (key dialects) and DIALECTS.md.
"""
from __future__ import annotations

from .dialect_name import dialect_name
from .dialect_table import DIALECTS, Dialect
from .key_formats import guess_family, split_key
from .model_index import model_family
from .resolve import Target, overlaps, resolve, resolve_all

__all__ = ["Target", "Dialect", "DIALECTS", "resolve", "resolve_all", "dialect_name", "split_key",
           "model_family", "guess_family", "overlaps"]
