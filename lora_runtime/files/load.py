"""`load_adapter`: read an adapter file (safetensors only), group its keys per target module,
resolve alpha (per-layer tensor, then file metadata, then rank; always a float) and check every
tensor is finite and consistently shaped. Errors name the file and the key."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import AdapterFormatError
from ..updates.registry import format_of, scaled_by_alpha, supported
from . import scale_sources, text_encoder_keys
from .key_formats import split_key
from .layer_adapter import LayerAdapter, LoraAdapter
from .safetensors_file import load_safetensors

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def load_adapter(path: str | os.PathLike, name: str | None = None) -> LoraAdapter:
    """Read and validate an adapter file. Errors name the file and the key."""
    p = Path(path)
    name = name or p.name
    tensors, meta, digest = load_safetensors(p)
    if not tensors:
        raise AdapterFormatError(f"{p.name} holds no tensors; it is not a LoRA adapter")
    g = _group(p, tensors)
    cfg = scale_sources.find_config(p, meta)
    layers, counts = _layers(p, g, cfg)
    notes = g.notes
    if g.inf_alpha:
        notes.append(f"{len(g.inf_alpha)} LoKr layers store alpha = inf (ai-toolkit's 'full rank' LoKr alpha "
                     "9999999999 saved as float16): both Kronecker factors are full, so alpha is not used "
                     "(scale 1.0), as in ComfyUI and LyCORIS")
    te_layers = text_encoder_keys.split(layers)
    if any(la.update is not None and la.update.per_row_magnitude for la in layers.values()):
        notes.append("DoRA with a per-row magnitude: normalised by ||W + s·ΔW|| as PEFT and LyCORIS train it; "
                     "ComfyUI's LoraLoader divides by ||W|| instead, so its images differ from these")
    if not layers and not te_layers:
        raise AdapterFormatError(
            f"{p.name} has no adapter weights this loader understands (e.g. {list(tensors)[:3]}); "
            f"supported: {supported()}"
        )
    fmt = "+".join(sorted(g.formats - {"other"})) or "unknown"
    source, more = scale_sources.describe(counts, cfg, meta)
    return LoraAdapter(name, str(p), layers, fmt, digest, meta, g.ignored, source, notes[:5] + more,
                       text_encoder=te_layers,
                       text_encoder_tensors={k: tensors[k] for la in te_layers.values() for k in la.keys})


@dataclass
class _Grouped:
    """A file's tensors grouped per stem, checked one by one."""
    groups: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    keys: dict[str, list[str]] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    inf_alpha: dict[str, str] = field(default_factory=dict)   # stem -> its alpha key holding +inf
    formats: set[str] = field(default_factory=set)
    upcast_noted: bool = False


def _group(p: Path, tensors: dict) -> _Grouped:
    g = _Grouped()
    slots: set[str] = set()
    for key, t in tensors.items():
        parts = split_key(key)
        if parts is None:
            g.ignored[key] = "not an adapter key"
            continue
        stem, part, slot = parts
        if slot:
            slots.add(slot)
        g.formats.add(format_of(key))
        t, inf_alpha = _checked(p, key, part, t, g)
        if inf_alpha:
            g.inf_alpha[stem] = key   # an overflowed alpha: judged once the layer's type is known
        if part == "alpha" and t.numel() != 1:
            raise AdapterFormatError(f"{p.name}: {key!r} should be a scalar alpha, got shape {tuple(t.shape)}")
        layer = g.groups.setdefault(stem, {})
        if part in layer:
            raise AdapterFormatError(f"{p.name}: two keys give the {part!r} tensor of {stem!r} "
                                     f"({[k for k in g.keys[stem] if split_key(k)[1] == part][0]!r} and {key!r})")
        layer[part] = t
        g.keys.setdefault(stem, []).append(key)
    if len(slots) > 1:
        raise AdapterFormatError(
            f"{p.name} holds several PEFT adapter slots ({', '.join(sorted(slots))}); save one adapter per file"
        )
    return g


def _checked(p: Path, key: str, part: str, t: torch.Tensor, g: _Grouped) -> tuple[torch.Tensor, bool]:
    """(the tensor as the engine reads it (an integer alpha as float64, narrow floats as float32),
    whether it is a +inf scalar alpha (judged later)). Raises naming the key."""
    if part == "alpha" and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
        t = t.to(torch.float64)  # an integer alpha (some trainers write int64), read as ComfyUI's .item() does
    if t.numel() == 0:
        raise AdapterFormatError(f"{p.name}: tensor {key!r} is empty (shape {tuple(t.shape)}): a rank-0 layer "
                                 "holds no update. Re-export the adapter without it")
    if not t.is_floating_point():
        raise AdapterFormatError(f"{p.name}: tensor {key!r} has dtype {t.dtype}; LoRA tensors must be floating point")
    if t.dtype not in _FLOATS:
        # fp8 and other narrow floats: torch has no matmul for them on every device; upcast once
        if not g.upcast_noted:
            g.notes.append(f"factors stored as {t.dtype} were upcast to float32 at load")
            g.upcast_noted = True
        t = t.to(torch.float32)
    if not torch.isfinite(t).all():
        if part == "alpha" and t.numel() == 1 and bool(torch.isposinf(t).all()):
            return t, True
        raise AdapterFormatError(f"{p.name}: tensor {key!r} contains NaN or Inf; the file is damaged — "
                                 "re-export the adapter")
    return t, False


def _layers(p: Path, g: _Grouped, cfg) -> tuple[dict[str, LayerAdapter], dict[str, int]]:
    """The file's layers, and how many model layers took their alpha from each source."""
    counts: dict[str, int] = {}
    layers: dict[str, LayerAdapter] = {}
    for stem, parts in g.groups.items():
        names = set(parts) - {"alpha"}
        if not names or names == {"dora"}:
            for k in g.keys[stem]:
                g.ignored[k] = "alpha/DoRA scale without adapter weights"
            continue
        if stem in g.inf_alpha:
            parts = {k: v for k, v in parts.items() if k != "alpha"}
        alpha, source, rslora = _layer_alpha(stem, parts, cfg, g.notes)
        try:
            la = LayerAdapter(stem, alpha=alpha, keys=g.keys[stem], rslora=rslora, alpha_source=source,
                              parts={k: v for k, v in parts.items() if k != "alpha"})
        except NotImplementedError as e:
            raise AdapterFormatError(f"{p.name}: {e}. Re-export the adapter as LoRA/LoHa/LoKr, or use a loader "
                                     "that supports this type") from None
        except AdapterFormatError as e:
            raise AdapterFormatError(f"{p.name}: {e}") from None
        if stem in g.inf_alpha:
            if la.update is None or not la.update.ignores_alpha:
                raise AdapterFormatError(f"{p.name}: tensor {g.inf_alpha[stem]!r} contains NaN or Inf; the file is "
                                         "damaged — re-export the adapter")
            source = la.alpha_source = "per-layer .alpha tensors"
        if (la.update is not None and la.update.has_weight_delta and la.update.scaled_by_alpha
                and not text_encoder_keys.is_text_encoder(stem)):  # the scale source line counts model layers
            counts[source] = counts.get(source, 0) + 1
        layers[stem] = la
    return layers, counts


def _layer_alpha(stem: str, parts: dict, cfg, notes: list[str]) -> tuple[float | None, str, bool]:
    """(alpha, where it came from, rsLoRA) for one layer, in `scale_sources`' precedence."""
    if "alpha" in parts:
        return float(parts["alpha"].float().item()), "per-layer .alpha tensors", False
    lowrank = "down" in parts
    if not scaled_by_alpha(parts):
        return None, "", False
    if cfg is not None and lowrank:
        a = scale_sources.pattern_value(stem, cfg.alpha_pattern, cfg)
        alpha = a if a is not None else cfg.lora_alpha
        source = (f"{cfg.source} alpha_pattern" if a is not None else
                  f"{cfg.source} lora_alpha={cfg.lora_alpha:g}" if cfg.lora_alpha is not None else
                  "none: alpha = rank (scale 1.0)")
        rank = int(parts["down"].shape[0])
        want_r = scale_sources.pattern_value(stem, cfg.rank_pattern, cfg) or cfg.r
        if want_r is not None and want_r != rank:
            notes.append(f"{stem}: the config says rank {want_r}, the tensors have rank {rank}; "
                         "the tensors' rank is used")
        return alpha, source, cfg.use_rslora and alpha is not None
    return None, "none: alpha = rank (scale 1.0)", False

