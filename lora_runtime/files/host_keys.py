"""The host's own key map: inside ComfyUI, ComfyUI decides where an adapter key goes.

A host that has a key map of its own for the model at hand registers a provider with
`set_provider`; `match_adapter` asks `key_map_for(model)` and places every file stem the
host's map knows where the host places it, rows and swapped halves included. The family
tables of `dialects` come second: they place what the host's map does not know (dialects the
host has no names for) and run alone in the bundled host. So whatever the host's own loader
loads, the pack loads, onto the same targets.

    set_provider(fn)            # fn(model: nn.Module) -> HostKeyMap | None; None unregisters
    key_map_for(model)          # the registered provider's answer, or None (bundled host, errors)
    from_key_map(...)           # a ComfyUI-style key map -> HostKeyMap (used by nodes/host/comfy_host.py)
    host_targets(adapter, hmap, modules, params) -> {stem: Target}, {stem: why not}

A ComfyUI-style key map (``comfy.lora.model_lora_keys_unet``) maps a file stem to either a
state-dict key (``"diffusion_model.<module>.weight"``, or any other key such as a bare
parameter) or a tuple ``(key, offset)`` / ``(key, offset, function)``: ``offset`` =
``(dim, start, size)`` narrows the weight before the delta is added (dim 0: output rows
``[start, start + size)``), ``function`` is applied to the delta (ComfyUI's
``swap_scale_shift``: the delta's two row halves exchanged). An entry this pack cannot honour
(an offset on another dim, an unknown function, a key outside the diffusion model) is left
out with the reason, and the stem goes to the family tables like any other. The map is read
at run time from the host; nothing of it is copied here.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import torch
from torch import nn

from .resolve import Target
from .key_formats import split_key

log = logging.getLogger(__name__)

PREFIX = "diffusion_model."


@dataclass(frozen=True)
class HostTarget:
    """Where the host's map sends a stem: a module (weight) or a parameter, rows, swapped halves."""
    name: str                              # module name (a ".weight" key) or parameter name, no prefix
    rows: tuple[int, int] | None = None
    swap_halves: bool = False
    weight: bool = True                    # the key was "<name>.weight" (a module's weight)


@dataclass
class HostKeyMap:
    """One model's key map, as its host reads it.

    ``host``: who made it ("ComfyUI"); ``model_class``: the host's class for the model
    (ComfyUI's model config class, e.g. "ZImage"; ``base_class`` its BaseModel class,
    "Lumina2"); ``family``: the `dialects` family table that class uses ('' = none of them;
    it replaces reading the family from module names); ``entries``: stem -> HostTarget;
    ``skipped``: stem -> why an entry of the host's map is not used; ``convert``: the host's
    conversion of a file's keys before its map is read (ComfyUI's ``convert_lora``), or None."""
    host: str
    model_class: str
    base_class: str
    family: str
    entries: dict[str, HostTarget] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    convert: Callable[[dict], dict] | None = None
    source: str = ""                       # e.g. "comfy.lora.model_lora_keys_unet"

    @property
    def who(self) -> str:
        cls = self.model_class if self.model_class == self.base_class else f"{self.model_class} ({self.base_class})"
        return f"{self.host}'s key map for {cls}"


_PROVIDER: Callable[[nn.Module], HostKeyMap | None] | None = None


def set_provider(fn: Callable[[nn.Module], HostKeyMap | None] | None) -> None:
    """Register the host's provider (one per process; the last one wins; None removes it)."""
    global _PROVIDER
    _PROVIDER = fn


def key_map_for(model: nn.Module) -> HostKeyMap | None:
    """The host's key map for this diffusion model, or None (no provider, the host does not know
    the model, or the host's map could not be read: the family tables then place every key)."""
    if _PROVIDER is None:
        return None
    try:
        return _PROVIDER(model)
    except Exception as e:  # a host's failure must not stop a load the tables can do
        log.warning("LoRA runtime: the host's key map could not be read (%s: %s); the pack's own tables place "
                    "the keys", type(e).__name__, e)
        return None


def from_key_map(key_map: Mapping, *, host: str, model_class: str, base_class: str, family: str,
                 swap_functions: Iterable = (), convert: Callable[[dict], dict] | None = None,
                 source: str = "") -> HostKeyMap:
    """A HostKeyMap from a ComfyUI-style key map (see the module doc). ``swap_functions``: the
    host's functions that exchange the two row halves of a delta (identity compared)."""
    swaps = list(swap_functions)
    out = HostKeyMap(host, model_class, base_class, family, convert=convert, source=source)
    for stem, value in key_map.items():
        if not isinstance(stem, str):
            continue
        offset = function = None
        if isinstance(value, str):
            key = value
        elif isinstance(value, tuple) and value and isinstance(value[0], str):
            key = value[0]
            offset = value[1] if len(value) > 1 else None
            function = value[2] if len(value) > 2 else None
        else:
            out.skipped[stem] = f"{host}'s map gives {type(value).__name__} {value!r}, not a key"
            continue
        if not key.startswith(PREFIX):
            continue   # not the diffusion model (the host's map holds other parts' keys too)
        name = key[len(PREFIX):]
        weight = name.endswith(".weight")
        if weight:
            name = name[: -len(".weight")]
        rows = None
        if offset is not None:
            if (not isinstance(offset, (tuple, list)) or len(offset) != 3 or offset[0] != 0
                    or not all(isinstance(v, int) for v in offset)):
                out.skipped[stem] = (f"{host}'s map narrows {key} by {offset!r}; only output-row slices "
                                     "(dim 0) are supported")
                continue
            rows = (int(offset[1]), int(offset[1]) + int(offset[2]))
        swap = False
        if function is not None:
            if any(function is f for f in swaps) and rows is None:
                swap = True
            else:
                out.skipped[stem] = (f"{host}'s map applies {getattr(function, '__name__', function)!r} to the "
                                     f"delta of {key}, which this pack does not know")
                continue
        out.entries[stem] = HostTarget(name, rows, swap, weight)
    return out


def _file_keys(adapter) -> dict[str, torch.Tensor]:
    """The file's keys of the model layers, each with a tensor object of its own (the part it
    names, or a placeholder): enough for a conversion that renames keys."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for la in adapter.layers.values():
        for k in la.keys:
            parts = split_key(k)
            t = la.parts.get(parts[1]) if parts is not None else None
            if not isinstance(t, torch.Tensor) or id(t) in seen:
                t = torch.zeros(())
            seen.add(id(t))
            out[k] = t
    return out


def converted_stems(adapter, convert: Callable[[dict], dict] | None) -> dict[str, str]:
    """file stem -> the stem the host's conversion of the file's keys gives it (itself when the
    conversion leaves it, or there is none, or it fails)."""
    stems = {s: s for s in adapter.layers}
    if convert is None:
        return stems
    sd = _file_keys(adapter)
    try:
        new = convert(dict(sd))
    except Exception as e:  # the conversion reads a file it was not written for: read the names as they are
        log.debug("host key conversion failed (%s); names read as written", e)
        return stems
    if new is None or new is sd:
        return stems
    by_id = {id(v): k for k, v in new.items()}
    for s, la in adapter.layers.items():
        for k in la.keys:
            nk = by_id.get(id(sd[k]))
            parts = split_key(nk) if nk is not None else None
            if parts is not None and parts[1] == split_key(k)[1]:
                stems[s] = parts[0]
                break
    return stems


def host_targets(adapter, hmap: HostKeyMap, modules: Mapping[str, nn.Module], params: Mapping[str, nn.Parameter]
                 ) -> tuple[dict[str, Target], dict[str, str]]:
    """({file stem: Target} for the stems the host's map places on something this model has,
    {file stem: why the host's entry is not used}). A stem the host's map does not know is in
    neither: the family tables read it."""
    placed: dict[str, Target] = {}
    why: dict[str, str] = {}
    label = f"{hmap.who}"
    for stem, cstem in converted_stems(adapter, hmap.convert).items():
        key = cstem if cstem in hmap.entries or cstem in hmap.skipped else None
        if key is None and cstem.endswith("_lora"):   # "<x>_lora.up.weight": ComfyUI's stem is <x>
            key = cstem[: -len("_lora")] if cstem[: -len("_lora")] in hmap.entries else None
        if key is None:
            continue
        if key in hmap.skipped:
            why[stem] = hmap.skipped[key]
            continue
        e = hmap.entries[key]
        if e.weight and e.name in modules and e.name:
            placed[stem] = Target(e.name, e.rows, label, False, e.swap_halves)
        elif e.name in params and e.rows is None and not e.swap_halves:
            placed[stem] = Target(e.name, None, label, True, False)
        else:
            what = f"{e.name}.weight" if e.weight else e.name
            why[stem] = f"{hmap.who} sends it to {what}, which this model does not have"
    return placed, why


def place_as_host(adapter, hmap: "HostKeyMap", resolved: dict, modules: dict, params: dict
                  ) -> tuple[dict[str, str], list[str]]:
    """Put the host's targets into ``resolved`` (in place): a stem the host's key map places goes
    where the host puts it, rows and swapped halves included; the family tables keep the stems
    the host's map does not know. Returns ({stem: why the host's entry is not used}, report notes)."""
    placed, why = host_targets(adapter, hmap, modules, params)
    differ, ours_only = [], []
    for stem in adapter.layers:
        h, t = placed.get(stem), resolved.get(stem)
        if h is not None:
            if t is not None and (t.module, t.rows, t.param, t.swap_halves) == (h.module, h.rows, h.param,
                                                                                 h.swap_halves):
                continue   # the same place: keep the table's dialect label
            if t is not None:
                differ.append(f"{stem} -> {h.module} (tables: {t.module})")
            resolved[stem] = h
        elif t is not None:
            ours_only.append(stem)
    if differ:
        log.info("LoRA %s: %d keys go where %s puts them, not where the pack's tables would (e.g. %s)",
                 adapter.name, len(differ), hmap.who, "; ".join(differ[:3]))
    notes = [f"{len(placed)} of the file's {len(adapter.layers)} layers placed by {hmap.who} "
             f"({hmap.source or 'read at run time'})"]
    if ours_only:
        notes.append(f"{len(ours_only)} layers placed by the pack's own key tables, which {hmap.host}'s own "
                     f"loader does not load (e.g. {', '.join(ours_only[:3])})")
    return why, notes
