"""`match_adapter`: line an adapter's layers up with a model's modules and parameters.

Returns the targets (module name -> `LayerAdapter`, parameter name -> `ParamDelta`) and a
`CoverageReport`. Every key is applied or the load fails naming the keys (``lenient``: the rest
is applied and the skipped keys are listed); a file of which fewer than half the layers match,
or none, is an adapter for another model: always an error (`coverage.refuse`).
"""
from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass

from torch import nn

from .. import updates
from ..errors import AdapterFormatError, AdapterMatchError
from ..layer.base_weight import adapter_kind, real_shape
from . import host_keys, param_names, text_encoder_keys
from .coverage import CoverageReport, coverage_report, refuse
from .dialect_name import dialect_name
from .layer_adapter import LayerAdapter, LoraAdapter
from .param_deltas import param_deltas
from .resolve import Target, resolve_all
from .unresolved import why_unresolved

log = logging.getLogger(__name__)


def linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module for every Linear-like module (`adapter_kind`), seen through LoRA wrappers."""
    out: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        if getattr(mod, "is_lora_wrapper", False):
            out[name] = mod
        elif not name.endswith(".base_layer") and adapter_kind(mod)[0] == "linear":
            out[name] = mod
    return out


def target_kind(module: nn.Module | None) -> str:
    """'linear', 'conv', 'norm' (a module with a 1-D weight or bias: LayerNorm, RMSNorm,
    GroupNorm, ...) or '' (takes no adapter; `adapter_kind` says why)."""
    return adapter_kind(module)[0]


@dataclass
class _Model:
    """What matching reads off the model, once."""
    modules: dict
    params: dict
    hmap: object        # the host's key map for this model (inside ComfyUI), or None
    family: str | None


@dataclass
class _Placed:
    """What matching found so far: targets, fused-weight slices, unmatched stems, applied stems."""
    targets: dict
    slices: dict
    unmatched: dict
    applied: list


def match_adapter(adapter: LoraAdapter, model: nn.Module, *, lenient: bool = False, log_coverage: bool = True
                  ) -> tuple[dict, CoverageReport]:
    """Map the adapter's layers onto the model: ``(targets, report)`` (see the module doc).
    Several file layers on row slices of one fused weight become one update (`updates.row_slices`)."""
    if not adapter.layers and adapter.text_encoder:
        raise AdapterMatchError(text_encoder_keys.only_text_encoder_message(adapter.name, adapter.text_encoder))
    hmap = host_keys.key_map_for(model)   # inside ComfyUI: its own key map for this model
    m = _Model(dict(model.named_modules()), dict(model.named_parameters()), hmap,
               hmap.family if hmap is not None else None)
    resolved, host_why, host_notes = _resolve(adapter, m)
    found = _Placed({}, {}, dict(adapter.ignored_keys), [])
    for stem, la in adapter.layers.items():
        la = copy.copy(la)  # the adapter is cached and shared by every match: never change its layers
        t = resolved.get(stem)
        why = (host_why.get(stem) or why_unresolved(stem, m.modules, m.family)) if t is None else \
            _place(adapter, stem, la, t, m, found)
        if why is not None:
            found.unmatched[stem] = why
        else:
            found.applied.append(stem)
    _join_slices(found, m.modules)
    fmt = dialect_name(list(adapter.layers), m.modules, family=m.family)
    if adapter.format not in ("", "unknown"):
        fmt = f"{fmt} ({adapter.format} keys)"
    report = coverage_report(adapter, fmt, found.targets, found.unmatched, found.applied, len(linear_modules(model)))
    report.notes.extend(host_notes)
    refuse(adapter, report, found.applied, hmap, lenient)
    if log_coverage:  # the loader node checks first and says nothing; the run logs it once
        log_report(report)
    return found.targets, report


def log_report(report: CoverageReport) -> None:
    """One log line for a match: a warning when it is partial."""
    if report.partial:
        log.warning("LoRA only partly matches the model: %s", report.summary())
    else:
        log.info("LoRA %s", report.summary())


def _resolve(adapter: LoraAdapter, m: _Model) -> tuple[dict, dict[str, str], list[str]]:
    """(stem -> Target, {stem: why the host's entry is not used}, report notes): the family
    tables' targets, then the host's where it has a key map."""
    resolved = resolve_all(list(adapter.layers), m.modules, family=m.family)
    host_why: dict[str, str] = {}
    host_notes: list[str] = []
    if m.hmap is not None:
        host_why, host_notes = host_keys.place_as_host(adapter, m.hmap, resolved, m.modules, m.params)
    param_names.redirect_modulation(adapter.layers, resolved, m.modules)  # LightX2V blocks.N.diff_m
    return resolved, host_why, host_notes


def _place(adapter: LoraAdapter, stem: str, la: LayerAdapter, t: Target, m: _Model, found: _Placed) -> str | None:
    """Put one file layer on its target; why it cannot, or None."""
    target = t.module
    module = None if t.param else m.modules.get(target)
    kind = target_kind(module) if module is not None else ("param" if target in m.params else "")
    if t.rows is not None:
        la.rows = t.rows
    if t.swap_halves and kind in ("linear", "conv") and la.update is not None:
        why = _swap_halves(la)
        if why is not None:
            return why
    if kind in ("linear", "conv"):
        return _place_on_weight(adapter, stem, la, module, target, kind, found)
    if kind in ("norm", "param"):
        return _place_on_params(adapter, la, target, module, m.params, found)
    return f"targets {type(module).__name__} {target!r}, which takes no adapter: {adapter_kind(module)[1]}"


def _place_on_weight(adapter, stem, la: LayerAdapter, module, target: str, kind: str, found: _Placed) -> str | None:
    if la.update is None:
        if not (la.param_like and kind == "conv" and set(la.parts) <= {"diff", "diff_b"}):
            return f"a parameter delta ({', '.join(sorted(la.parts))}) on {type(module).__name__} {target!r}"
        _build(adapter, la)
    _check_shapes(adapter, stem, la, module, target, kind)
    if la.rows is not None:
        found.slices.setdefault(target, []).append(la)
    elif target in found.targets or target in found.slices:
        return f"second entry for {target!r}"
    else:
        found.targets[target] = la
    return None


def _place_on_params(adapter, la: LayerAdapter, target: str, module, params: dict, found: _Placed) -> str | None:
    deltas = param_deltas(adapter.name, la, target, module, params)
    if isinstance(deltas, str):
        return deltas
    for d in deltas:
        if d.target in found.targets:
            return f"second entry for {d.target!r}"
    found.targets.update((d.target, d) for d in deltas)
    return None


def _join_slices(found: _Placed, modules: dict) -> None:
    """The file layers on row slices of one fused weight, as one update of that weight."""
    for target, parts in found.slices.items():
        if target in found.targets:
            for la in parts:
                found.unmatched[la.stem] = f"slice of {target!r}, which another key targets whole"
                found.applied.remove(la.stem)
            continue
        shape = real_shape(modules[target].weight)  # a packed weight's storage is not its shape
        sliced = updates.row_slices([(la.rows[0], la.rows[1], la.update) for la in parts], shape[0], stem=target)
        sliced.check_module(shape[0], math.prod(shape[1:]))
        found.targets[target] = LayerAdapter(target, update=sliced, keys=[k for la in parts for k in la.keys],
                                             alpha_source=parts[0].alpha_source)


def _swap_halves(la: LayerAdapter) -> str | None:
    """Exchange the two halves of the update's output rows (diffusers' ``norm_out.linear`` is
    [scale, shift], the native ``final_layer.adaLN_modulation.1`` is [shift, scale]).
    Returns why it cannot, or None."""
    swapped = la.update.swapped_halves()
    if swapped is None:
        return (f"the model stores this [scale, shift] layer's rows in the other order, and "
                f"{la.update.why_not_swapped()}")
    la.update = swapped
    return None


def _build(adapter: LoraAdapter, la: LayerAdapter) -> None:
    try:
        la.build_update()
    except (AdapterFormatError, NotImplementedError) as e:
        raise AdapterFormatError(f"{adapter.name}: {e}") from None


def _check_shapes(adapter: LoraAdapter, stem: str, la: LayerAdapter, module: nn.Module, target: str,
                  kind: str) -> None:
    shape = real_shape(module.weight)  # a packed weight's storage is not its shape
    out_f = shape[0]
    in_f = math.prod(shape[1:]) if kind == "conv" else shape[1]
    if la.rows is not None:
        a, b = la.rows
        if not (0 <= a < b <= out_f):
            raise AdapterFormatError(f"{adapter.name}: key {stem!r} -> rows [{a}, {b}) of {target!r}, which has "
                                     f"{out_f} rows")
        out_f = b - a
    kernel = shape[2:] if kind == "conv" else ()
    bad = None
    if la.kernel and kind != "conv":
        bad = f"it is a convolution update (kernel {la.kernel}) but the layer is a {type(module).__name__}"
    elif kind == "conv" and la.kernel and la.kernel != kernel:
        bad = f"its kernel is {la.kernel} but the layer's is {kernel}"
    elif kind == "conv" and la.update.conv_refusal is not None:
        bad = la.update.conv_refusal
    if bad is None:
        try:
            la.update.check_module(out_f, in_f)
        except AdapterFormatError as e:  # "<stem>: the factors make ... (adapter made for ...)"
            bad = str(e).split(": ", 1)[-1].replace(" (adapter made for another model or layer)", "")
    if bad:
        raise AdapterFormatError(
            f"{adapter.name}: key {stem!r} -> layer {target!r}: {bad}. The adapter was trained for a "
            "different model or model size; pick the matching adapter"
        )
