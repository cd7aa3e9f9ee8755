"""Whole quantized models and their checkpoint files for the bundled host: quantize / dequantize a
model, ComfyUI 0.33's older quantized forms rewritten as ``comfy_quant`` keys, a quantized state dict
loaded into a model, and ``.safetensors`` read / written in ComfyUI's layout."""
from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch
from torch import nn

from .quant_formats import (COMFY_QUANT, PACKED_COLUMNS, QUANT_SUFFIXES, conf_from_tensor, conf_tensor, is_quantized,
                            quantized_weight_entries, require_comfy_kitchen)
from .quant_ops import QuantLinear

log = logging.getLogger(__name__)


def _swap(model: nn.Module, make) -> nn.Module:
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            new = make(f"{parent_name}.{name}" if parent_name else name, child)
            if new is not None:
                setattr(parent, name, new)
    return model


def quantize_model(model: nn.Module, layout: str, *, min_numel: int = 1024, **quantize_kwargs) -> nn.Module:
    """A deep copy of `model` with every plain ``nn.Linear`` of at least `min_numel` weights
    replaced by a `QuantLinear` holding ``QuantizedTensor.from_float(weight, layout,
    **quantize_kwargs)`` (the weight in the model's dtype; the bias stays a plain Parameter). A
    layer whose shape the layout refuses (comfy-kitchen's ValueError) stays plain. Note: the
    layouts ComfyUI registers under "TensorCoreFP8E4M3Layout" / "TensorCoreFP8E5M2Layout" take
    ``scale=None`` as 1.0; pass ``scale="recalculate"`` for an amax scale."""
    require_comfy_kitchen(f"quantize_model({layout})")
    from comfy_kitchen.tensor import get_layout_class
    get_layout_class(layout)   # KeyError for an unknown layout, before copying anything
    model = copy.deepcopy(model)

    def make(name, m):
        if type(m) is not nn.Linear or m.weight.numel() < min_numel:
            return None
        try:
            return QuantLinear.from_linear(m, layout, **quantize_kwargs)
        except ValueError as e:
            log.info("quantize_model: %s %s stays plain (%s)", name, tuple(m.weight.shape), e)
            return None

    return _swap(model, make)


def dequantized_model(model: nn.Module) -> nn.Module:
    """A deep copy of `model` with every `QuantLinear` replaced by a plain ``nn.Linear`` holding
    its dequantized weight (in the layer's dtype) and its bias: the same numbers as plain
    weights - the ideal float base of a quantized model. A ``pre_quant_scale`` is folded into
    the weight's columns (equal in exact arithmetic, not bit for bit)."""
    model = copy.deepcopy(model)

    def make(name, m):
        if not isinstance(m, QuantLinear):
            return None
        w = m.convert_weight().detach()
        pre = getattr(m, "pre_quant_scale", None)
        if pre is not None:
            w = w * pre.to(w.dtype).reshape(1, -1)
        with torch.device("meta"):
            lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        lin.weight = nn.Parameter(w.clone().contiguous(), requires_grad=False)
        if m.bias is not None:
            lin.bias = nn.Parameter(m.bias.detach().clone(), requires_grad=False)
        return lin

    return _swap(model, make)


def quantized_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """name -> QuantLinear of every quantized layer in `model`."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


# --------------------------------------------------------------------------
# checkpoint files
# --------------------------------------------------------------------------

def has_quantized_layers(sd: dict[str, torch.Tensor], metadata: dict | None = None) -> bool:
    """True if a state dict (and its safetensors metadata) holds ComfyUI-quantized layers:
    ``*.comfy_quant`` keys, a ``scaled_fp8`` marker, or ``_quantization_metadata``."""
    if metadata and "_quantization_metadata" in metadata:
        return True
    return any(k.endswith("." + COMFY_QUANT) or k == "scaled_fp8" or k.endswith(".scaled_fp8") for k in sd)


def convert_old_quants(sd: dict[str, torch.Tensor], metadata: dict | None = None,
                       prefixes: tuple[str, ...] = ("",)) -> dict[str, torch.Tensor]:
    """ComfyUI 0.33's older quantized forms, rewritten as per-layer ``comfy_quant`` keys:

    - ``_quantization_metadata`` in the file's metadata: JSON ``{"layers": {name: conf}}``; each
      ``name.comfy_quant`` is added from it.
    - else a ``{prefix}scaled_fp8`` marker (legacy scaled fp8): the marker is dropped; each
      ``L.scale_weight`` becomes ``L.weight_scale`` and marks L as ``{"format": "float8_e4m3fn"}``
      (ComfyUI ignores the marker's dtype), with ``"full_precision_matrix_mult": true`` when the
      marker has 2 elements; each ``L.scale_input`` becomes ``L.input_scale`` unless it is 1.0.
    Anything else is returned as is. `sd` is not modified."""
    metadata = metadata or {}
    sd = dict(sd)
    if "_quantization_metadata" in metadata:
        layers = json.loads(metadata["_quantization_metadata"])["layers"]
    else:
        marker_key = next((p + "scaled_fp8" for p in prefixes if p + "scaled_fp8" in sd), None)
        if marker_key is None:
            return sd
        full_precision = sd[marker_key].numel() == 2
        layers = {}
        out: dict[str, torch.Tensor] = {}
        for k, v in sd.items():
            if k == marker_key:
                continue
            if k.endswith(".scale_weight"):
                layer = k[: -len(".scale_weight")]
                out[layer + ".weight_scale"] = v
                layers[layer] = {"format": "float8_e4m3fn"}
                if full_precision:
                    layers[layer]["full_precision_matrix_mult"] = True
            elif k.endswith(".scale_input"):
                if v.numel() == 1 and v.item() == 1.0:
                    continue
                out[k[: -len(".scale_input")] + ".input_scale"] = v
            else:
                out[k] = v
        sd = out
    for layer, conf in layers.items():
        sd[f"{layer}.{COMFY_QUANT}"] = conf_tensor(conf)
    return sd


def shape_view(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`sd` with each quantized layer's ``weight`` replaced by an empty meta tensor of its
    logical shape, for inferring a model config: rows from the bias when there is one (the
    stored rows may be padded), columns from the storage (x2 for the packed 4-bit pairs of nvfp4,
    convrot_w4a4 and asym_w4a8_int8; mxfp8 / nvfp4 columns may include padding to 32 / 16)."""
    out = dict(sd)
    for k, v in sd.items():
        if not k.endswith("." + COMFY_QUANT):
            continue
        layer = k[: -len("." + COMFY_QUANT)]
        w = sd.get(layer + ".weight")
        if w is None or w.dim() != 2:
            continue
        rows, cols = int(w.shape[0]), int(w.shape[1])
        if conf_from_tensor(v).get("format") in PACKED_COLUMNS:
            cols *= 2
        b = sd.get(layer + ".bias")
        if b is not None:
            rows = int(b.shape[0])
        out[layer + ".weight"] = torch.empty(rows, cols, device="meta")
    return out


def load_quantized_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                              source: str = "state dict") -> nn.Module:
    """Load a ComfyUI-format (``comfy_quant``) state dict into `model` (built on any device,
    e.g. meta): every ``nn.Linear`` with a ``comfy_quant`` entry becomes a `QuantLinear` whose
    weight reports `dtype`, every other tensor is cast to `dtype`. Missing or unexpected keys
    raise ValueError naming `source`. Returns `model` (changed in place)."""
    require_comfy_kitchen(str(source))
    layers = {k[: -len("." + COMFY_QUANT)] for k in sd if k.endswith("." + COMFY_QUANT)}
    modules = dict(model.named_modules())
    for name in sorted(layers):
        m = modules.get(name)
        if isinstance(m, QuantLinear):
            continue
        if m is None or type(m) is not nn.Linear:
            what = "is not a module of the model" if m is None else f"is a {type(m).__name__}, not a Linear"
            raise ValueError(f"{source}: quantized layer {name} {what}")
        parent_name, _, attr = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, attr,
                QuantLinear(m.in_features, m.out_features, bias=m.bias is not None, dtype=dtype, device="meta"))

    def keep_raw(k):
        layer, _, suffix = k.rpartition(".")
        return layer in layers and suffix in QUANT_SUFFIXES

    cast = {k: (v if keep_raw(k) else v.to(dtype=dtype)) for k, v in sd.items()}
    try:
        result = model.load_state_dict(cast, strict=False, assign=True)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None
    still_meta = sorted(n for n, p in model.named_parameters() if p.is_meta)
    missing = sorted(set(result.missing_keys) | set(still_meta))
    if missing or result.unexpected_keys:
        raise ValueError(f"{source}: state dict does not match the model; missing keys: {missing}; "
                         f"unexpected keys: {sorted(result.unexpected_keys)}")
    n = len(layers)
    formats = sorted({m.quant_format for m in quantized_layers(model).values() if m.quant_format})
    log.info("%s: %d quantized layers (%s)", source, n, ", ".join(formats))
    return model


def read_safetensors(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a ``.safetensors`` file."""
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(path), "pt", device="cpu") as f:
        metadata = dict(f.metadata() or {})
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    return tensors, metadata


def save_quantized(path, state: nn.Module | dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write a model (or its ``state_dict()``) as a ComfyUI 0.33 quantized ``.safetensors``
    file: each QuantLinear as ``weight`` / ``weight_scale`` [/ ``weight_scale_2``] /
    ``comfy_quant`` (+ ``bias``), everything else as is. A bare QuantizedTensor value under
    ``P.weight`` is expanded the same way. Returns the path."""
    from safetensors.torch import save_file

    sd = state.state_dict() if isinstance(state, nn.Module) else state
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if is_quantized(v):
            if not k.endswith("weight"):
                raise ValueError(f"{k}: a QuantizedTensor that is not a layer's weight")
            out.update(quantized_weight_entries(k[: -len("weight")], v))
        else:
            out[k] = v
    out = {k: v.detach().contiguous() for k, v in out.items()}
    save_file(out, str(Path(path)), metadata=metadata)
    return str(path)
