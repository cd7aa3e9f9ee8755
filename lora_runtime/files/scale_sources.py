"""Where an adapter's scale comes from: one documented order of precedence.

For each layer of a low-rank adapter, alpha is the first of:

1. the layer's own ``.alpha`` tensor (kohya / ComfyUI / musubi files): what ComfyUI's
   LoraLoader and kohya's loader use;
2. the first ``alpha_pattern`` entry of the adapter's config that matches the layer, as
   PEFT matches them: the key, a regular expression, matches the module path or a suffix
   of it after a dot (`pattern_match`: bounded cost, a documented subset of ``re``);
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

Every value is checked when the config is read: a value of the wrong type (a list for
``alpha_pattern``, a string for ``lora_alpha``, ``"false"`` where a boolean belongs is read
as false, anything else refused), a pattern key outside the supported subset, a rank
that is not a positive integer: `AdapterFormatError` naming the file and the key.

The kohya header key ``ss_network_alpha`` is **not** a source: kohya's own loader
(sd-scripts ``create_network_from_weights``) and ComfyUI's take alpha = rank for a layer
without an ``.alpha`` tensor. When the header says otherwise the report says so.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import AdapterFormatError
from .pattern_match import Budget, Pattern, PatternError, first_match

_HEADER_KEYS = ("lora_adapter_metadata", "adapter_config", "peft_config")
_COMPONENTS = ("transformer", "unet", "diffusion_model")


@dataclass
class ScaleConfig:
    source: str                                  # where it was found, for the report
    lora_alpha: float | None = None
    r: int | None = None
    alpha_pattern: list[tuple[Pattern, float]] = field(default_factory=list)   # in the config's order
    rank_pattern: list[tuple[Pattern, int]] = field(default_factory=list)
    use_rslora: bool = False
    file: str = ""                               # the adapter file's name, for errors
    budget: Budget = field(default_factory=Budget, repr=False)   # pattern matching work left


def _number(what: str, value, fname: str) -> float:
    if isinstance(value, bool):
        raise AdapterFormatError(f"{fname}: {what} = {value!r} is a boolean, not a number; fix the adapter's config")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise AdapterFormatError(f"{fname}: {what} = {value!r} is not a number; fix the adapter's config") from None
    if not math.isfinite(v):
        raise AdapterFormatError(f"{fname}: {what} = {value!r} is not a finite number; fix the adapter's config")
    return v


def _rank(what: str, value, fname: str) -> int:
    v = _number(what, value, fname)
    if v != int(v) or v < 1:
        raise AdapterFormatError(f"{fname}: {what} = {value!r} is not a positive whole number (a rank); fix the "
                                 "adapter's config")
    return int(v)


def _boolean(what: str, value, fname: str) -> bool:
    """A real boolean, or the strings true/false in any case (some exporters write strings)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise AdapterFormatError(f"{fname}: {what} = {value!r} is not a boolean (true or false); fix the adapter's "
                             "config")


def _patterns(what: str, value, fname: str, read) -> list[tuple[Pattern, object]]:
    if value is None:
        return []
    if not isinstance(value, dict):
        raise AdapterFormatError(f"{fname}: {what} is a {type(value).__name__}, not a mapping from module "
                                 "pattern to value; fix the adapter's config")
    out = []
    for k, v in value.items():
        try:
            pat = Pattern(k)
        except PatternError as e:
            raise AdapterFormatError(
                f"{fname}: {what} key {k!r}: {e}. Pattern keys are matched as PEFT does (a regular expression "
                "against the module path or a suffix after a dot), within a subset of Python's regex syntax that "
                "matches in bounded time; rewrite the key with literals, classes, groups, | and quantifiers") from None
        out.append((pat, read(f"{what}[{k!r}]", v, fname)))
    return out


def _unnest(cfg: dict) -> dict:
    """PEFT keys a config by adapter name ({"default": {...}}); diffusers may write flat
    ``<component>.<key>`` entries. Return one flat config."""
    if len(cfg) == 1 and isinstance(next(iter(cfg.values())), dict) and not any(
            k in cfg for k in ("alpha_pattern", "rank_pattern")):
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
    out = ScaleConfig(source=source, file=fname)
    if alpha is not None:
        out.lora_alpha = _number("lora_alpha", alpha, fname)
    if cfg.get("r") is not None:
        out.r = _rank("r", cfg["r"], fname)
    out.alpha_pattern = _patterns("alpha_pattern", cfg.get("alpha_pattern"), fname, _number)
    out.rank_pattern = _patterns("rank_pattern", cfg.get("rank_pattern"), fname, _rank)
    if cfg.get("use_rslora") is not None:
        out.use_rslora = _boolean("use_rslora", cfg["use_rslora"], fname)
    return out


def find_config(path: Path, meta: dict[str, str]) -> ScaleConfig | None:
    """The adapter's config (see the module doc for where it is looked for), or None."""
    for key in _HEADER_KEYS:
        if key in meta:
            try:
                cfg = json.loads(meta[key])
            except (json.JSONDecodeError, TypeError, RecursionError) as e:
                e = "nested too deeply" if isinstance(e, RecursionError) else e
                raise AdapterFormatError(f"{path.name}: header metadata {key!r} is not valid JSON ({e}); its scale "
                                         "cannot be read. Re-save the adapter") from None
            if not isinstance(cfg, dict):
                raise AdapterFormatError(f"{path.name}: header metadata {key!r} is a JSON {type(cfg).__name__}, not "
                                         "an object of settings; its scale cannot be read. Re-save the adapter")
            return _parse(cfg, f"header {key}", path.name)
    beside = path.parent / "adapter_config.json"
    if beside.is_file():
        others = [p for p in path.parent.glob("*.safetensors") if p.name != path.name]
        if path.name == "adapter_model.safetensors" or not others:
            try:
                cfg = json.loads(beside.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
                e = "nested too deeply" if isinstance(e, RecursionError) else e
                raise AdapterFormatError(f"{path.name}: {beside} cannot be read as JSON ({e}); fix or remove it") from None
            if not isinstance(cfg, dict):
                raise AdapterFormatError(f"{path.name}: {beside} holds a JSON {type(cfg).__name__}, not an object of "
                                         "settings; fix or remove it")
            return _parse(cfg, "adapter_config.json beside the file", path.name)
    return None


def pattern_value(stem: str, pattern: list, cfg: ScaleConfig | None = None):
    """The value of the first pattern entry matching a module path (PEFT's rule, bounded
    cost: the matches of one config share `cfg.budget`; beyond it, an error naming the key)."""
    try:
        return first_match(pattern, stem, cfg.budget if cfg is not None else None)
    except PatternError as e:
        where = cfg.file if cfg is not None else "adapter config"
        raise AdapterFormatError(f"{where}: pattern key {getattr(e, 'key', '?')!r}: {e}") from None


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
