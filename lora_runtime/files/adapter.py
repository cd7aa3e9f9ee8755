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

import copy
import math
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import AdapterFormatError, AdapterMatchError, LoraRuntimeError
from . import dialects
from .key_formats import guess_family, split_key
from ..updates.param_delta import ParamDelta
from ..layer.base_weight import adapter_kind, real_shape
from . import conv_tucker, host_keys, param_names, scale_sources, text_encoder_keys
from .. import updates
from .safetensors_file import load_safetensors, read_header

log = logging.getLogger(__name__)


_LOWRANK_PARTS = ("down", "up")
_NO_SUCH_LAYER = "no such layer in the model"
_PARAM_ONLY = frozenset({"diff", "diff_b", "diff_m", "w_norm", "b_norm"})


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
        if not names or not names <= _PARAM_ONLY:
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
        """Parts for `updates.detect`, conv (LoCon) factors flattened to matrices."""
        out, kernel = conv_tucker.fold(self.parts, self.stem)   # Tucker cores -> matrix factors
        if kernel:
            self.kernel = kernel
        down, up, diff = out.get("down"), out.get("up"), out.get("diff")
        if down is not None and down.dim() > 2:
            self.kernel = tuple(int(k) for k in down.shape[2:])
            out["down"] = down.reshape(down.shape[0], -1)
            if up is not None and up.dim() > 2:
                if any(k != 1 for k in up.shape[2:]):
                    raise AdapterFormatError(f"{self.stem}: the up factor has a {tuple(up.shape[2:])} kernel; only "
                                             "LoCon with a 1x1 up convolution is supported")
                out["up"] = up.reshape(up.shape[0], up.shape[1])
        elif up is not None and up.dim() > 2 and all(k == 1 for k in up.shape[2:]):
            out["up"] = up.reshape(up.shape[0], up.shape[1])
        if diff is not None and diff.dim() > 2:
            self.kernel = tuple(int(k) for k in diff.shape[2:])
            out["diff"] = diff.reshape(diff.shape[0], -1)
        for k in [k for k in out if k.startswith("hada_") or k.startswith("lokr_")]:
            t = out[k]
            if t.dim() > 2 and all(d == 1 for d in t.shape[2:]):
                out[k] = t.reshape(t.shape[0], t.shape[1])
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


@dataclass
class CoverageReport:
    adapter: str
    format: str
    matched: list[str]                  # model targets (module or parameter names)
    unmatched: dict[str, str]           # file stem or key -> reason
    model_linears: int
    file_layers: int
    scale_source: str = ""
    notes: list[str] = field(default_factory=list)
    applied_layers: int = -1            # file stems applied (several stems may share one fused target)
    keys_total: int = 0                 # tensors in the file
    keys_applied: int = 0               # tensors whose update is applied
    kinds: dict[str, int] = field(default_factory=dict)   # update kind -> targets
    unmatched_tensors: int = 0          # tensors of the unmatched layers and keys
    text_encoder_layers: int = 0        # text-encoder layers of the file (a model-only loader leaves them)
    text_encoder_tensors: int = 0

    def __post_init__(self):
        if self.applied_layers < 0:
            self.applied_layers = len(self.matched)

    @property
    def partial(self) -> bool:
        return bool(self.unmatched)

    def examples(self, n: int = 5) -> list[str]:
        return [f"{k} ({v})" for k, v in list(self.unmatched.items())[:n]]

    def summary(self) -> str:
        s = f"{self.adapter}: {self.applied_layers}/{self.file_layers} adapter layers matched ({self.format})"
        if self.keys_total:
            s += f", {self.keys_applied}/{self.keys_total} keys applied"
        if self.unmatched:
            s += f"; {self.unmatched_text()} not loaded, e.g. " + ", ".join(self.examples(3))
        if self.text_encoder_layers:
            s += (f"; {self.text_encoder_layers} text-encoder layers ({self.text_encoder_tensors} tensors) not "
                  "applied: this node patches the model only")
        return s

    def unmatched_text(self) -> str:
        """'N layers or keys (M tensors)': layers and tensors counted separately."""
        return f"{len(self.unmatched)} layers or keys ({self.unmatched_tensors} tensors)"

    def to_dict(self) -> dict:
        return {
            "adapter": self.adapter,
            "format": self.format,
            "matched": self.applied_layers,
            "file_layers": self.file_layers,
            "model_linears": self.model_linears,
            "targets": len(self.matched),
            "keys_applied": self.keys_applied,
            "keys_total": self.keys_total,
            "kinds": dict(self.kinds),
            "unmatched": len(self.unmatched),
            "unmatched_tensors": self.unmatched_tensors,
            "unmatched_examples": self.examples(20),
            "text_encoder_layers": self.text_encoder_layers,
            "text_encoder_tensors": self.text_encoder_tensors,
            "scale_source": self.scale_source,
            "notes": list(self.notes),
        }


_HEADER_CHECKS: dict[tuple, str] = {}


def check_adapter_file(path: str | os.PathLike, *, text_encoder_only_ok: bool = False) -> str:
    """The checks that need only the header, cheap enough for ComfyUI's validation of a
    prompt (before anything runs): not safetensors (pickle, zip, HTML, GGUF: never
    opened), truncated or corrupt header, no tensor that looks like a LoRA key, a
    non-finite or non-numeric alpha in the header's metadata. '' when it passes, else the
    message (naming the file, the key and the fix). Cached by (path, size, mtime).
    ``text_encoder_only_ok``: a file of text-encoder layers only passes (a model + CLIP loader).
    What needs the tensors or the model (NaN inside a tensor, shapes, layers matched)
    is checked when the node runs."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        return f"adapter file {p.name} cannot be read ({e.strerror or e})"
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns, text_encoder_only_ok)
    if key not in _HEADER_CHECKS:
        _HEADER_CHECKS[key] = _check_header(p, text_encoder_only_ok)
    return _HEADER_CHECKS[key]


def _check_header(p: Path, text_encoder_only_ok: bool = False) -> str:
    try:
        header, _ = read_header(p)
    except LoraRuntimeError as e:
        return str(e)
    names = [k for k in header if k != "__metadata__"]
    if not names:
        return f"{p.name} holds no tensors; it is not a LoRA adapter"
    stems = [parts[0] for parts in map(split_key, names) if parts is not None]
    if not stems:
        return (f"{p.name} has no LoRA weights this loader understands (e.g. {names[:3]}); "
                f"supported: {_SUPPORTED}")
    if not text_encoder_only_ok and all(text_encoder_keys.is_text_encoder(s) for s in stems):
        te = {}
        for k in names:
            parts = split_key(k)
            if parts is not None:
                te.setdefault(parts[0], _Keys()).keys.append(k)
        return text_encoder_keys.only_text_encoder_message(p.name, te)
    meta = {str(k): str(v) for k, v in (header.get("__metadata__") or {}).items()}
    try:
        scale_sources.find_config(p, meta)
    except LoraRuntimeError as e:
        return str(e)
    return ""


class _Keys:  # the keys of one stem, for counting before the tensors are read
    def __init__(self):
        self.keys: list[str] = []


_SUPPORTED = ("lora_down/lora_up, lora_A/lora_B, LoHa (hada_*), LoKr (lokr_*), DoRA (dora_scale / "
              "lora_magnitude_vector), diff, diff_b, diff_m, w_norm/b_norm")


def load_adapter(path: str | os.PathLike, name: str | None = None) -> LoraAdapter:
    """Read and validate an adapter file. Errors name the file and the key."""
    p = Path(path)
    name = name or p.name
    tensors, meta, digest = load_safetensors(p)
    if not tensors:
        raise AdapterFormatError(f"{p.name} holds no tensors; it is not a LoRA adapter")
    groups: dict[str, dict[str, torch.Tensor]] = {}
    keys: dict[str, list[str]] = {}
    ignored: dict[str, str] = {}
    notes: list[str] = []
    fp8_noted = False
    inf_alpha: dict[str, str] = {}   # stem -> its alpha key holding +inf (fine where alpha is unused)
    slots: set[str] = set()
    formats: set[str] = set()
    for key, t in tensors.items():
        parts = split_key(key)
        if parts is None:
            ignored[key] = "not an adapter key"
            continue
        stem, part, slot = parts
        if slot:
            slots.add(slot)
        formats.add(_format_of(key, part))
        if part == "alpha" and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            t = t.to(torch.float64)  # an integer alpha (some trainers write int64), read as ComfyUI's .item() does
        if t.numel() == 0:
            raise AdapterFormatError(f"{p.name}: tensor {key!r} is empty (shape {tuple(t.shape)}): a rank-0 layer "
                                     "holds no update. Re-export the adapter without it")
        if not t.is_floating_point():
            raise AdapterFormatError(f"{p.name}: tensor {key!r} has dtype {t.dtype}; LoRA tensors must be floating point")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            # fp8 and other narrow floats: torch has no matmul for them on every device; upcast once
            if not fp8_noted:
                notes.append(f"factors stored as {t.dtype} were upcast to float32 at load")
                fp8_noted = True
            t = t.to(torch.float32)
        if not torch.isfinite(t).all():
            if part == "alpha" and t.numel() == 1 and bool(torch.isposinf(t).all()):
                inf_alpha[stem] = key   # an overflowed alpha: judged once the layer's type is known
            else:
                raise AdapterFormatError(f"{p.name}: tensor {key!r} contains NaN or Inf; the file is damaged — "
                                         "re-export the adapter")
        if part == "alpha" and t.numel() != 1:
            raise AdapterFormatError(f"{p.name}: {key!r} should be a scalar alpha, got shape {tuple(t.shape)}")
        g = groups.setdefault(stem, {})
        if part in g:
            raise AdapterFormatError(f"{p.name}: two keys give the {part!r} tensor of {stem!r} "
                                     f"({[k for k in keys[stem] if split_key(k)[1] == part][0]!r} and {key!r})")
        g[part] = t
        keys.setdefault(stem, []).append(key)
    if len(slots) > 1:
        raise AdapterFormatError(
            f"{p.name} holds several PEFT adapter slots ({', '.join(sorted(slots))}); save one adapter per file"
        )
    cfg = scale_sources.find_config(p, meta)
    counts: dict[str, int] = {}
    layers: dict[str, LayerAdapter] = {}
    for stem, parts in groups.items():
        names = set(parts) - {"alpha"}
        if not names or names == {"dora"}:
            for k in keys[stem]:
                ignored[k] = "alpha/DoRA scale without adapter weights"
            continue
        if stem in inf_alpha:
            parts = {k: v for k, v in parts.items() if k != "alpha"}
        alpha, source, rslora = _layer_alpha(stem, parts, cfg, notes)
        try:
            la = LayerAdapter(stem, alpha=alpha, keys=keys[stem], rslora=rslora, alpha_source=source,
                              parts={k: v for k, v in parts.items() if k != "alpha"})
        except NotImplementedError as e:
            raise AdapterFormatError(f"{p.name}: {e}. Re-export the adapter as LoRA/LoHa/LoKr, or use a loader "
                                     "that supports this type") from None
        except AdapterFormatError as e:
            raise AdapterFormatError(f"{p.name}: {e}") from None
        if stem in inf_alpha:
            if not _alpha_unused(la.update):
                raise AdapterFormatError(f"{p.name}: tensor {inf_alpha[stem]!r} contains NaN or Inf; the file is "
                                         "damaged — re-export the adapter")
            source = la.alpha_source = "per-layer .alpha tensors"
        if (la.update is not None and la.update.has_weight_delta and not isinstance(la.update, updates.Full)
                and not text_encoder_keys.is_text_encoder(stem)):  # the scale source line counts model layers
            counts[source] = counts.get(source, 0) + 1
        layers[stem] = la
    if inf_alpha:
        notes.append(f"{len(inf_alpha)} LoKr layers store alpha = inf (ai-toolkit's 'full rank' LoKr alpha "
                     "9999999999 saved as float16): both Kronecker factors are full, so alpha is not used "
                     "(scale 1.0), as in ComfyUI and LyCORIS")
    te_layers = text_encoder_keys.split(layers)
    if any(isinstance(la.update, updates.DoRA) and la.update.axis == "out" for la in layers.values()):
        notes.append("DoRA with a per-row magnitude: normalised by ||W + s·ΔW|| as PEFT and LyCORIS train it; "
                     "ComfyUI's LoraLoader divides by ||W|| instead, so its images differ from these")
    if not layers and not te_layers:
        raise AdapterFormatError(
            f"{p.name} has no adapter weights this loader understands (e.g. {list(tensors)[:3]}); "
            f"supported: {_SUPPORTED}"
        )
    fmt = "+".join(sorted(formats - {"other"})) or "unknown"
    source, more = scale_sources.describe(counts, cfg, meta)
    return LoraAdapter(name, str(p), layers, fmt, digest, meta, ignored, source, notes[:5] + more,
                       text_encoder=te_layers,
                       text_encoder_tensors={k: tensors[k] for la in te_layers.values() for k in la.keys})


def _alpha_unused(update) -> bool:
    """Whether the update's scale ignores alpha (a LoKr whose two factors are both full)."""
    u = update.inner if isinstance(update, updates.DoRA) else update
    return isinstance(u, updates.LoKr) and u.dim is None


def _layer_alpha(stem: str, parts: dict, cfg, notes: list[str]) -> tuple[float | None, str, bool]:
    """(alpha, where it came from, rsLoRA) for one layer, in `scale_sources`' precedence."""
    if "alpha" in parts:
        return float(parts["alpha"].float().item()), "per-layer .alpha tensors", False
    lowrank = "down" in parts
    if not lowrank and not any(k.startswith(("hada_", "lokr_")) for k in parts):
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


def _format_of(key: str, part: str) -> str:
    if ".lora_A" in key or ".lora_B" in key or "lora_magnitude_vector" in key:
        return "peft"
    if part.startswith("hada_"):
        return "lycoris-loha"
    if part.startswith("lokr_"):
        return "lycoris-lokr"
    if "lora_down" in key or "lora_up" in key or key.endswith(".alpha") or "dora_scale" in key:
        return "kohya"
    if part in ("diff", "diff_b", "diff_m", "w_norm", "b_norm"):
        return "diff"
    return "other"


# --- matching against a model ------------------------------------------------------


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


def match_adapter(adapter: LoraAdapter, model: nn.Module, *, lenient: bool = False, log_coverage: bool = True
                  ) -> tuple[dict, CoverageReport]:
    """Map the adapter's layers onto the model.

    Returns ``(targets, report)``: ``targets`` maps a module name to its `LayerAdapter`
    (Linear and Conv weights; several file layers on row slices of one fused weight
    become one `updates.Sliced`), and a parameter name to a `ParamDelta` (norm weights
    and biases, bare parameters such as Wan's ``modulation``).

    Every key of the file is applied or the load fails, naming the keys (``lenient``:
    the rest is applied and the skipped keys are listed on the report). A file of which
    fewer than half the layers match, or none, is an adapter for another model: always
    an error, naming the family its keys look like."""
    if not adapter.layers and adapter.text_encoder:
        raise AdapterMatchError(text_encoder_keys.only_text_encoder_message(adapter.name, adapter.text_encoder))
    all_modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    linears = linear_modules(model)
    hmap = host_keys.key_map_for(model)   # inside ComfyUI: its own key map for this model
    family = hmap.family if hmap is not None else None
    resolved = dialects.resolve_all(list(adapter.layers), all_modules, family=family)
    host_why: dict[str, str] = {}
    host_notes: list[str] = []
    if hmap is not None:
        host_why, host_notes = _place_as_host(adapter, hmap, resolved, all_modules, params)
    param_names.redirect_modulation(adapter.layers, resolved, all_modules)  # LightX2V blocks.N.diff_m
    targets: dict = {}
    slices: dict[str, list] = {}
    unmatched: dict[str, str] = dict(adapter.ignored_keys)
    applied_stems: list[str] = []
    for stem, la in adapter.layers.items():
        la = copy.copy(la)  # the adapter is cached and shared by every match: never change its layers
        t = resolved.get(stem)
        if t is None:
            unmatched[stem] = host_why.get(stem) or _why_unresolved(stem, all_modules, family)
            continue
        target = t.module
        module = None if t.param else all_modules.get(target)
        kind = target_kind(module) if module is not None else ("param" if target in params else "")
        why = None
        if t.rows is not None:
            la.rows = t.rows
        if t.swap_halves and kind in ("linear", "conv") and la.update is not None:
            why = _swap_halves(adapter, la)
        rows = la.rows
        if why is not None:
            pass
        elif kind in ("linear", "conv"):
            if la.update is None:
                if la.param_like and kind == "conv" and set(la.parts) <= {"diff", "diff_b"}:
                    _build(adapter, la)
                else:
                    why = f"a parameter delta ({', '.join(sorted(la.parts))}) on {type(module).__name__} {target!r}"
            if why is None:
                _check_shapes(adapter, stem, la, module, target, kind)
                if rows is not None:
                    slices.setdefault(target, []).append(la)
                elif target in targets or target in slices:
                    why = f"second entry for {target!r}"
                else:
                    targets[target] = la
        elif kind in ("norm", "param"):
            deltas = param_deltas(adapter.name, la, target, module, params)
            if isinstance(deltas, str):
                why = deltas
            else:
                for d in deltas:
                    if d.target in targets:
                        why = f"second entry for {d.target!r}"
                        break
                else:
                    targets.update((d.target, d) for d in deltas)
        else:
            why = f"targets {type(module).__name__} {target!r}, which takes no adapter: {adapter_kind(module)[1]}"
        if why is not None:
            unmatched[stem] = why
        else:
            applied_stems.append(stem)
    for target, parts in slices.items():
        if target in targets:
            for la in parts:
                unmatched[la.stem] = f"slice of {target!r}, which another key targets whole"
                applied_stems.remove(la.stem)
            continue
        shape = real_shape(all_modules[target].weight)  # a packed weight's storage is not its shape
        sliced = updates.Sliced([(la.rows[0], la.rows[1], la.update) for la in parts], shape[0], stem=target)
        sliced.check_module(shape[0], math.prod(shape[1:]))
        targets[target] = LayerAdapter(target, update=sliced, keys=[k for la in parts for k in la.keys],
                                       alpha_source=parts[0].alpha_source)
    kinds: dict[str, int] = {}
    for t in targets.values():
        k = t.update.kind if isinstance(t, LayerAdapter) else "param"
        kinds[k] = kinds.get(k, 0) + 1
    te_layers, te_tensors = text_encoder_keys.counts(adapter.text_encoder)
    keys_total = sum(len(la.keys) for la in adapter.layers.values()) + len(adapter.ignored_keys) + te_tensors
    unmatched_tensors = sum(len(adapter.layers[k].keys) if k in adapter.layers else 1 for k in unmatched)
    keys_applied = sum(len(adapter.layers[s].keys) for s in applied_stems)
    fmt = dialects.dialect_name(list(adapter.layers), all_modules, family=family)
    if adapter.format not in ("", "unknown"):
        fmt = f"{fmt} ({adapter.format} keys)"
    report = CoverageReport(adapter.name, fmt, sorted(targets), unmatched, len(linears), len(adapter.layers),
                            adapter.scale_source, list(adapter.notes), applied_layers=len(applied_stems),
                            keys_total=keys_total, keys_applied=keys_applied, kinds=kinds,
                            unmatched_tensors=unmatched_tensors, text_encoder_layers=te_layers,
                            text_encoder_tensors=te_tensors)
    if te_layers:
        report.notes.append(text_encoder_keys.note(adapter.text_encoder))
    report.notes.extend(host_notes)
    looks_like = guess_family(adapter.layers)
    looks = f"; its keys look like an adapter for {looks_like}" if looks_like else ""
    if hmap is not None and looks:
        looks += f" (this model is {hmap.host}'s {hmap.model_class})"
    if not applied_stems:
        found = {k: v for k, v in unmatched.items() if k in adapter.layers and v != _NO_SUCH_LAYER}
        if found:   # layers of this model that cannot take their update: say why, not "another model"
            raise AdapterMatchError(
                f"{adapter.name}: none of its {len(adapter.layers)} adapter layers can be applied: "
                + ", ".join(f"{k} ({v})" for k, v in list(found.items())[:3])
                + ". Re-export the adapter for this model, or use a loader that supports this update")
        raise AdapterMatchError(
            f"{adapter.name} matches no layer of this model ({len(adapter.layers)} adapter layers, e.g. "
            f"{', '.join(list(adapter.layers)[:3])}){looks}. Pick the adapter made for this model.")
    if len(applied_stems) < 0.5 * len(adapter.layers):
        raise AdapterMatchError(
            f"{adapter.name}: only {len(applied_stems)} of its {len(adapter.layers)} layers match this model "
            f"(e.g. not loaded: {', '.join(report.examples(3))}){looks}. It is most likely an adapter for another "
            "model; pick the one made for this model.")
    if report.unmatched and not lenient:
        raise AdapterMatchError(
            f"{adapter.name}: {report.unmatched_text()} would not be applied: "
            f"{', '.join(report.examples(5))}. Nothing is dropped silently: use the matching adapter, or set "
            "'unmatched keys' to 'skip and report' on the Load LoRA Adapter node to apply the rest.")
    if log_coverage:  # the loader node checks first and says nothing; the run logs it once
        if report.partial:
            log.warning("LoRA only partly matches the model: %s", report.summary())
        else:
            log.info("LoRA %s", report.summary())
    return targets, report


_EXPERT = re.compile(r"^(.*?)transformer_([12])[._](blocks[._].*)$")


def _place_as_host(adapter: LoraAdapter, hmap, resolved: dict, modules: dict, params: dict
                   ) -> tuple[dict[str, str], list[str]]:
    """Put the host's targets into ``resolved`` (in place): a stem the host's key map places goes
    where the host puts it, rows and swapped halves included; the family tables keep the stems
    the host's map does not know. Returns ({stem: why the host's entry is not used}, report notes)."""
    placed, why = host_keys.host_targets(adapter, hmap, modules, params)
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


def _why_unresolved(stem: str, modules: dict, family: str | None = None) -> str:
    """Why a stem names nothing in the model: one expert of a file holding both Wan 2.2 experts
    (``transformer_1.`` = high noise, ``transformer_2.`` = low noise, as ai-toolkit writes them
    together), or no such layer."""
    m = _EXPERT.match(stem)
    if m and dialects.resolve(m.group(1) + m.group(3), modules, family=family) is not None:
        which = "high-noise" if m.group(2) == "1" else "low-noise"
        return (f"names transformer_{m.group(2)}, the {which} expert of a file holding both Wan 2.2 experts; this "
                "model is one expert: load the file saved for it (ai-toolkit saves one per expert unless "
                "split_multistage_loras is off)")
    return _NO_SUCH_LAYER


def _swap_halves(adapter: LoraAdapter, la: LayerAdapter) -> str | None:
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
    elif isinstance(la.update, updates.DoRA) and kind == "conv":
        bad = "DoRA on a convolution is not supported"
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


def param_deltas(adapter_name: str, la: LayerAdapter, target: str, module: nn.Module | None,
                 params: dict) -> list[ParamDelta] | str:
    """The parameter deltas of a file layer that targets a norm module or a bare
    parameter, or the reason it cannot (a string)."""
    parts = {k: v for k, v in la.parts.items() if k != "alpha"}
    if not set(parts) <= _PARAM_ONLY:
        return (f"a {la.update.kind if la.update is not None else 'param'} update on {type(module).__name__ if module is not None else 'parameter'} "
                f"{target!r}, which has no matrix weight")
    out: list[ParamDelta] = []
    if module is None:  # a bare parameter: diff / diff_m
        extra = set(parts) - {"diff", "diff_m"}
        if extra or len(parts) != 1:
            return f"parameter {target!r} takes one diff/diff_m delta, the file has {sorted(parts)}"
        (part, t), = parts.items()
        wanted = [(target, part, t)]
    else:
        wanted = []
        for part, attr in (("diff", "weight"), ("w_norm", "weight"), ("diff_b", "bias"), ("b_norm", "bias")):
            if part in parts:
                wanted.append((f"{target}.{attr}" if target else attr, part, parts[part]))
        if "diff_m" in parts:
            return f"diff_m names a bare parameter, but {target!r} is a {type(module).__name__}"
    for name, part, t in wanted:
        p = params.get(name)
        if p is None:
            return f"{part} for {name!r}, which the model does not have"
        shape = real_shape(p)  # a packed parameter's storage is not its shape
        if t.numel() != math.prod(shape):
            raise AdapterFormatError(
                f"{adapter_name}: key {la.stem}.{part} has {tuple(t.shape)} values but {name!r} is "
                f"{shape}. The adapter was trained for a different model size; pick the matching adapter")
        out.append(ParamDelta(la.stem, part, name, t.reshape(shape)))
    return out
