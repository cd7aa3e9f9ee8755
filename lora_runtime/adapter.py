"""Adapters: what a file holds, normalised, and how it lines up with a model.

`load_adapter(path)` reads a safetensors file (never a pickle), groups its keys per
target module, resolves alpha (per-layer tensor, then file metadata, then rank;
always a float) and checks every tensor is finite and consistently shaped.

`match_adapter(adapter, model)` maps the adapter's layers onto the model's Linear
modules and returns a `CoverageReport`: modules matched, keys unmatched (with
examples and reasons). Zero matches raises `AdapterMatchError`; partial coverage is
reported and logged, never silent.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .errors import AdapterFormatError, AdapterMatchError, LoraRuntimeError
from .key_formats import candidate_names, guess_family, split_key
from . import scale_sources
from .safetensors_file import load_safetensors, read_header

log = logging.getLogger(__name__)


@dataclass
class LayerAdapter:
    """One adapter's weights for one module. down: [r, in], up: [out, r]."""

    stem: str
    down: torch.Tensor | None = None
    up: torch.Tensor | None = None
    alpha: float | None = None
    dora_scale: torch.Tensor | None = None
    diff: torch.Tensor | None = None      # [out, in] full weight delta
    diff_b: torch.Tensor | None = None    # [out] output offset, never folded into the weight
    keys: list[str] = field(default_factory=list)
    rslora: bool = False                  # scale alpha / sqrt(rank) (PEFT use_rslora)
    alpha_source: str = ""                # where alpha came from (scale_sources)

    @property
    def rank(self) -> int:
        return int(self.down.shape[0]) if self.down is not None else 0

    @property
    def alpha_over_rank(self) -> float:
        if self.down is None:
            return 1.0
        a = self.alpha if self.alpha is not None else float(self.rank)
        return float(a) / (math.sqrt(self.rank) if self.rslora else float(self.rank))

    @property
    def has_lowrank(self) -> bool:
        return self.down is not None and self.up is not None

    def nbytes(self) -> int:
        ts = (self.down, self.up, self.dora_scale, self.diff, self.diff_b)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


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


@dataclass
class CoverageReport:
    adapter: str
    format: str
    matched: list[str]                  # model module names
    unmatched: dict[str, str]           # file stem or key -> reason
    model_linears: int
    file_layers: int
    scale_source: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def partial(self) -> bool:
        return bool(self.unmatched)

    def examples(self, n: int = 5) -> list[str]:
        return [f"{k} ({v})" for k, v in list(self.unmatched.items())[:n]]

    def summary(self) -> str:
        s = f"{self.adapter}: {len(self.matched)}/{self.file_layers} adapter layers matched ({self.format})"
        if self.unmatched:
            s += f"; {len(self.unmatched)} not loaded, e.g. " + ", ".join(self.examples(3))
        return s

    def to_dict(self) -> dict:
        return {
            "adapter": self.adapter,
            "format": self.format,
            "matched": len(self.matched),
            "file_layers": self.file_layers,
            "model_linears": self.model_linears,
            "unmatched": len(self.unmatched),
            "unmatched_examples": self.examples(20),
            "scale_source": self.scale_source,
            "notes": list(self.notes),
        }


_HEADER_CHECKS: dict[tuple, str] = {}


def check_adapter_file(path: str | os.PathLike) -> str:
    """The checks that need only the header, cheap enough for ComfyUI's validation of a
    prompt (before anything runs): not safetensors (pickle, zip, HTML, GGUF: never
    opened), truncated or corrupt header, no tensor that looks like a LoRA key, a
    non-finite or non-numeric alpha in the header's metadata. '' when it passes, else the
    message (naming the file, the key and the fix). Cached by (path, size, mtime).
    What needs the tensors or the model (NaN inside a tensor, shapes, layers matched)
    is checked when the node runs."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        return f"adapter file {p.name} cannot be read ({e.strerror or e})"
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HEADER_CHECKS:
        _HEADER_CHECKS[key] = _check_header(p)
    return _HEADER_CHECKS[key]


def _check_header(p: Path) -> str:
    try:
        header, _ = read_header(p)
    except LoraRuntimeError as e:
        return str(e)
    names = [k for k in header if k != "__metadata__"]
    if not names:
        return f"{p.name} holds no tensors; it is not a LoRA adapter"
    if not any(split_key(k) is not None for k in names):
        return (f"{p.name} has no LoRA weights this loader understands (e.g. {names[:3]}); "
                "supported: lora_down/lora_up, lora_A/lora_B, diff, diff_b")
    meta = {str(k): str(v) for k, v in (header.get("__metadata__") or {}).items()}
    try:
        scale_sources.find_config(p, meta)
    except LoraRuntimeError as e:
        return str(e)
    return ""


def load_adapter(path: str | os.PathLike, name: str | None = None) -> LoraAdapter:
    """Read and validate an adapter file. Errors name the file and the key."""
    p = Path(path)
    name = name or p.name
    tensors, meta, digest = load_safetensors(p)
    if not tensors:
        raise AdapterFormatError(f"{p.name} holds no tensors; it is not a LoRA adapter")
    layers: dict[str, LayerAdapter] = {}
    ignored: dict[str, str] = {}
    notes: list[str] = []
    fp8_noted = False
    slots: set[str] = set()
    formats: set[str] = set()
    for key, t in tensors.items():
        parts = split_key(key)
        if parts is None:
            ignored[key] = "not a LoRA key"
            continue
        stem, part, slot = parts
        if slot:
            slots.add(slot)
        formats.add(_format_of(key, part))
        if not t.is_floating_point():
            raise AdapterFormatError(f"{p.name}: tensor {key!r} has dtype {t.dtype}; LoRA tensors must be floating point")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            # fp8 and other narrow floats: torch has no matmul for them on every device; upcast once
            if not fp8_noted:
                notes.append(f"factors stored as {t.dtype} were upcast to float32 at load")
                fp8_noted = True
            t = t.to(torch.float32)
        if not torch.isfinite(t).all():
            raise AdapterFormatError(f"{p.name}: tensor {key!r} contains NaN or Inf; the file is damaged — re-export the adapter")
        la = layers.setdefault(stem, LayerAdapter(stem=stem))
        la.keys.append(key)
        if part == "alpha":
            if t.numel() != 1:
                raise AdapterFormatError(f"{p.name}: {key!r} should be a scalar alpha, got shape {tuple(t.shape)}")
            la.alpha = float(t.float().item())
        elif part == "dora":
            la.dora_scale = t
        else:
            setattr(la, part, t)
    if len(slots) > 1:
        raise AdapterFormatError(
            f"{p.name} holds several PEFT adapter slots ({', '.join(sorted(slots))}); save one adapter per file"
        )
    cfg = scale_sources.find_config(p, meta)
    counts: dict[str, int] = {}
    for stem, la in list(layers.items()):
        _check_layer(p.name, la)
        if la.down is not None:
            if la.alpha is not None:
                la.alpha_source = "per-layer .alpha tensors"
            elif cfg is not None:
                a = scale_sources.pattern_value(stem, cfg.alpha_pattern)
                la.alpha = a if a is not None else cfg.lora_alpha
                la.alpha_source = (f"{cfg.source} alpha_pattern" if a is not None else
                                   f"{cfg.source} lora_alpha={cfg.lora_alpha:g}" if cfg.lora_alpha is not None else
                                   "none: alpha = rank (scale 1.0)")
                la.rslora = cfg.use_rslora and la.alpha is not None
                want_r = scale_sources.pattern_value(stem, cfg.rank_pattern) or cfg.r
                if want_r is not None and want_r != la.rank:
                    notes.append(f"{stem}: the config says rank {want_r}, the tensors have rank {la.rank}; "
                                 "the tensors' rank is used")
            else:
                la.alpha_source = "none: alpha = rank (scale 1.0)"
            counts[la.alpha_source] = counts.get(la.alpha_source, 0) + 1
        if la.down is None and la.diff is None and la.diff_b is None:
            for k in la.keys:
                ignored[k] = "alpha/DoRA scale without LoRA weights"
            del layers[stem]
    if not layers:
        raise AdapterFormatError(
            f"{p.name} has no LoRA weights this loader understands (e.g. {list(tensors)[:3]}); "
            "supported: lora_down/lora_up, lora_A/lora_B, diff, diff_b"
        )
    fmt = "+".join(sorted(formats - {"other"})) or "unknown"
    source, more = scale_sources.describe(counts, cfg, meta)
    return LoraAdapter(name, str(p), layers, fmt, digest, meta, ignored, source, notes[:5] + more)


def _format_of(key: str, part: str) -> str:
    if ".lora_A" in key or ".lora_B" in key or "lora_magnitude_vector" in key:
        return "peft"
    if "lora_down" in key or "lora_up" in key or key.endswith(".alpha") or "dora_scale" in key:
        return "kohya"
    if part in ("diff", "diff_b"):
        return "diff"
    return "other"


def _check_layer(fname: str, la: LayerAdapter) -> None:
    if (la.down is None) != (la.up is None):
        have = "down (lora_A)" if la.down is not None else "up (lora_B)"
        raise AdapterFormatError(f"{fname}: layer {la.stem!r} has only its {have} matrix; the file is incomplete")
    if la.down is not None:
        if la.down.dim() != 2 or la.up.dim() != 2:
            raise AdapterFormatError(
                f"{fname}: layer {la.stem!r} has {la.down.dim()}-D/{la.up.dim()}-D LoRA matrices; "
                "only Linear layers (2-D) are supported"
            )
        if la.down.shape[0] != la.up.shape[1]:
            raise AdapterFormatError(
                f"{fname}: layer {la.stem!r}: down is {tuple(la.down.shape)} and up is {tuple(la.up.shape)}; "
                "their ranks differ"
            )
        if la.rank == 0:
            raise AdapterFormatError(f"{fname}: layer {la.stem!r} has rank 0")


# --- matching against a model ------------------------------------------------------


def linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module for every Linear-like module, seen through LoRA wrappers."""
    out: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        if getattr(mod, "is_lora_wrapper", False):
            out[name] = mod
        elif isinstance(mod, nn.Linear) and not name.endswith(".base_layer"):
            out[name] = mod
    return out


def match_adapter(adapter: LoraAdapter, model: nn.Module, *, lenient: bool = False, log_coverage: bool = True
                  ) -> tuple[dict[str, LayerAdapter], CoverageReport]:
    """Map the adapter's layers onto the model's Linear modules.

    Every key of the file is applied or the load fails, naming the keys (``lenient``:
    the rest is applied and the skipped keys are listed on the report). A file of which
    fewer than half the layers match, or none, is an adapter for another model: always
    an error, naming the family its keys look like."""
    linears = linear_modules(model)
    by_underscore = {n.replace(".", "_"): n for n in linears}
    all_modules = dict(model.named_modules())
    matched: dict[str, LayerAdapter] = {}
    unmatched: dict[str, str] = dict(adapter.ignored_keys)
    for stem, la in adapter.layers.items():
        target = next((c for c in candidate_names(stem, by_underscore) if c in linears), None)
        if target is None:
            other = next((c for c in candidate_names(stem, by_underscore) if c in all_modules), None)
            unmatched[stem] = (
                f"targets {type(all_modules[other]).__name__} {other!r}, not a Linear" if other else "no such layer in the model"
            )
            continue
        if target in matched:
            unmatched[stem] = f"second entry for {target!r}"
            continue
        _check_shapes(adapter, stem, la, linears[target], target)
        matched[target] = la
    report = CoverageReport(adapter.name, adapter.format, sorted(matched), unmatched, len(linears), len(adapter.layers),
                            adapter.scale_source, list(adapter.notes))
    family = guess_family(adapter.layers)
    looks = f"; its keys look like an adapter for {family}" if family else ""
    if not matched:
        raise AdapterMatchError(
            f"{adapter.name} matches no layer of this model ({len(adapter.layers)} adapter layers, e.g. "
            f"{', '.join(list(adapter.layers)[:3])}){looks}. Pick the adapter made for this model.")
    if len(matched) < 0.5 * len(adapter.layers):
        raise AdapterMatchError(
            f"{adapter.name}: only {len(matched)} of its {len(adapter.layers)} layers match this model "
            f"(e.g. not loaded: {', '.join(report.examples(3))}){looks}. It is most likely an adapter for another "
            "model; pick the one made for this model.")
    if report.unmatched and not lenient:
        raise AdapterMatchError(
            f"{adapter.name}: {len(report.unmatched)} of its keys would not be applied: "
            f"{', '.join(report.examples(5))}. Nothing is dropped silently: use the matching adapter, or set "
            "'unmatched keys' to 'skip and report' on the Load LoRA Adapter node to apply the rest.")
    if log_coverage:  # the loader node checks first and says nothing; the run logs it once
        if report.partial:
            log.warning("LoRA only partly matches the model: %s", report.summary())
        else:
            log.info("LoRA %s", report.summary())
    return matched, report


def _check_shapes(adapter: LoraAdapter, stem: str, la: LayerAdapter, module: nn.Module, target: str) -> None:
    w = module.weight
    out_f, in_f = int(w.shape[0]), int(w.shape[1])
    bad = None
    if la.down is not None and (la.down.shape[1] != in_f or la.up.shape[0] != out_f):
        bad = f"LoRA is {la.up.shape[0]}x{la.down.shape[1]} (out x in) but the layer is {out_f}x{in_f}"
    elif la.diff is not None and tuple(la.diff.shape) != (out_f, in_f):
        bad = f"diff is {tuple(la.diff.shape)} but the layer weight is {(out_f, in_f)}"
    elif la.diff_b is not None and la.diff_b.numel() != out_f:
        bad = f"diff_b has {la.diff_b.numel()} values but the layer has {out_f} outputs"
    elif la.dora_scale is not None and la.dora_scale.numel() not in (out_f, in_f):
        bad = f"dora_scale has shape {tuple(la.dora_scale.shape)}; expected {out_f} or {in_f} values"
    if bad:
        raise AdapterFormatError(
            f"{adapter.name}: key {stem!r} -> layer {target!r}: {bad}. The adapter was trained for a "
            "different model size; pick the matching adapter"
        )
