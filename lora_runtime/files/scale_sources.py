"""Where an adapter's scale comes from: one documented order of precedence.

For each layer of a low-rank adapter, alpha is the first of:

1. the layer's own ``.alpha`` tensor (kohya / ComfyUI / musubi files): what ComfyUI's
   LoraLoader and kohya's loader use;
2. an ``alpha_pattern`` entry of the adapter's config that matches the layer (the
   module path ends with the pattern key, or the key is a regex matching the path);
3. the config's ``lora_alpha``;
4. nothing: alpha = rank (scale 1.0), as ComfyUI and kohya do.

The config is the first found of: the safetensors header's ``lora_adapter_metadata``
(diffusers; nested, or flat ``<component>.lora_alpha`` / ``<component>.r`` keys, the
``transformer`` component first), the header's ``adapter_config`` or ``peft_config``
(PEFT JSON, possibly keyed by adapter name), an ``adapter_config.json`` beside the file
(PEFT ``save_pretrained``: used when the file is ``adapter_model.safetensors`` or the
only ``.safetensors`` file in its folder).

rsLoRA (``use_rslora: true`` in the config) scales by alpha / sqrt(rank) instead of
alpha / rank for the layers whose alpha came from the config. The rank is always the
tensors' (rows of the down matrix); a ``rank_pattern`` / ``r`` that disagrees is a
note on the report.

The kohya header key ``ss_network_alpha`` is **not** a source: kohya's own loader
(sd-scripts ``create_network_from_weights``) and ComfyUI's take alpha = rank for a layer
without an ``.alpha`` tensor. When the header says otherwise the report says so.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import AdapterFormatError

_HEADER_KEYS = ("lora_adapter_metadata", "adapter_config", "peft_config")
_COMPONENTS = ("transformer", "unet", "diffusion_model")


@dataclass
class ScaleConfig:
    source: str                                  # where it was found, for the report
    lora_alpha: float | None = None
    r: int | None = None
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    rank_pattern: dict[str, int] = field(default_factory=dict)
    use_rslora: bool = False


def _number(what: str, value, fname: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise AdapterFormatError(f"{fname}: {what} = {value!r} is not a number; fix the adapter's config") from None
    if not math.isfinite(v):
        raise AdapterFormatError(f"{fname}: {what} = {value!r} is not a finite number; fix the adapter's config")
    return v


def _unnest(cfg: dict) -> dict:
    """PEFT keys a config by adapter name ({"default": {...}}); diffusers may write flat
    ``<component>.<key>`` entries. Return one flat config."""
    if len(cfg) == 1 and isinstance(next(iter(cfg.values())), dict):
        cfg = next(iter(cfg.values()))
    if any("." in k for k in cfg) and not any(k in cfg for k in ("lora_alpha", "r", "alpha")):
        groups: dict[str, dict] = {}
        for k, v in cfg.items():
            comp, _, rest = k.partition(".")
            groups.setdefault(comp, {})[rest] = v
        for comp in _COMPONENTS:
            if comp in groups:
                return groups[comp]
        if len(groups) == 1:
            return next(iter(groups.values()))
    return cfg


def _parse(cfg: dict, source: str, fname: str) -> ScaleConfig:
    cfg = _unnest(cfg)
    alpha = cfg.get("lora_alpha", cfg.get("alpha"))
    out = ScaleConfig(source=source)
    if alpha is not None:
        out.lora_alpha = _number("lora_alpha", alpha, fname)
    if cfg.get("r") is not None:
        out.r = int(_number("r", cfg["r"], fname))
    out.alpha_pattern = {str(k): _number(f"alpha_pattern[{k!r}]", v, fname)
                         for k, v in (cfg.get("alpha_pattern") or {}).items()}
    out.rank_pattern = {str(k): int(_number(f"rank_pattern[{k!r}]", v, fname))
                        for k, v in (cfg.get("rank_pattern") or {}).items()}
    out.use_rslora = bool(cfg.get("use_rslora", False))
    return out


def find_config(path: Path, meta: dict[str, str]) -> ScaleConfig | None:
    """The adapter's config (see the module doc for where it is looked for), or None."""
    for key in _HEADER_KEYS:
        if key in meta:
            try:
                cfg = json.loads(meta[key])
            except json.JSONDecodeError as e:
                raise AdapterFormatError(f"{path.name}: header metadata {key!r} is not valid JSON ({e}); its scale "
                                         "cannot be read. Re-save the adapter") from None
            if isinstance(cfg, dict):
                return _parse(cfg, f"header {key}", path.name)
    beside = path.parent / "adapter_config.json"
    if beside.is_file():
        others = [p for p in path.parent.glob("*.safetensors") if p.name != path.name]
        if path.name == "adapter_model.safetensors" or not others:
            try:
                cfg = json.loads(beside.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise AdapterFormatError(f"{path.name}: {beside} cannot be read as JSON ({e}); fix or remove it") from None
            if isinstance(cfg, dict):
                return _parse(cfg, "adapter_config.json beside the file", path.name)
    return None


def pattern_value(stem: str, pattern: dict):
    """The pattern entry for a module path (PEFT: the key is a suffix of the path or a regex)."""
    for key, v in pattern.items():
        if stem == key or stem.endswith("." + key) or re.fullmatch(key, stem):
            return v
    return None


def describe(counts: dict[str, int], cfg: ScaleConfig | None, meta: dict[str, str]) -> tuple[str, list[str]]:
    """(one line for the report: where the scales came from, notes the user should see)."""
    parts = [f"{what} ({n} layers)" for what, n in counts.items() if n]
    text = "; ".join(parts) if parts else "no low-rank layer"
    notes = []
    if cfg is not None and cfg.use_rslora:
        text += "; rsLoRA: alpha / sqrt(rank)"
    if "ss_network_alpha" in meta and counts.get("none: alpha = rank (scale 1.0)"):
        notes.append(f"the header says ss_network_alpha={meta['ss_network_alpha']}, but layers without an .alpha "
                     "tensor use alpha = rank, as kohya's and ComfyUI's loaders do")
    return text, notes
