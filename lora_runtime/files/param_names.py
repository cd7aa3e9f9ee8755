"""Parameter deltas whose key names the module that owns the parameter.

LightX2V's LoRA extractor writes the delta of Wan's ``blocks.N.modulation`` parameter as
``blocks.N.diff_m`` and that of ``head.modulation`` as ``head.diff_m`` (the ``m`` is the
modulation); other exporters write ``blocks.N.modulation.diff_m``. Both name the same
parameter. `redirect_modulation` rewrites the resolved target of a ``diff_m``-only
layer whose stem names a module (not a parameter) to that module's ``modulation``
parameter, when the model has one; anything else is left for the matcher to report.
"""
from __future__ import annotations

from typing import Mapping

from . import dialects


def redirect_modulation(layers: Mapping, resolved: dict, modules: Mapping) -> None:
    """In place: ``resolved[stem]`` -> the ``<module>.modulation`` parameter target for each
    ``diff_m``-only layer whose stem resolved to a module or to nothing."""
    for stem, la in layers.items():
        if set(la.parts) - {"alpha"} != {"diff_m"}:
            continue
        t = resolved.get(stem)
        if t is not None and t.param:
            continue
        for alt in (f"{stem}.modulation", f"{stem}_modulation"):
            target = dialects.resolve(alt, modules)
            if target is not None and target.param and target.module.endswith("modulation"):
                resolved[stem] = target
                break
