"""ComfyUI 0.33's quantized checkpoint formats for the bundled host: the format table, comfy-kitchen
(imported lazily), and a quantized weight to and from its checkpoint entries.

Checkpoint keys of a quantized layer ``P``: ``P.weight`` (the quantized data in the format's
storage dtype), ``P.weight_scale`` (fp8 / int8: the float32 per-tensor scale; mxfp8: the
float8_e8m0fnu block scales; nvfp4: the float8_e4m3fn block scales), ``P.weight_scale_2``
(nvfp4: the float32 per-tensor scale); convrot_w4a4: ``P.weight_scale`` (float32 per row of
the rotated int4 weight); asym_w4a8_int8: ``P.weight_s_rel`` (float8_e4m3fn per group of
columns), ``P.weight_s_channel`` (float32 per row), ``P.weight_codebook`` (16 levels);
``P.comfy_quant`` (a uint8 tensor holding the bytes of a JSON object such as
``{"format": "float8_e4m3fn"}``, with ``convrot_groupsize`` / ``group_size`` /
``linear_dtype`` for the 4-bit rotated formats), optional ``P.input_scale`` /
``P.pre_quant_scale``, and ``P.bias`` (plain). `FORMATS` lists the formats and the layout
each loads as. Older files carry a ``scaled_fp8`` marker key and per-layer ``scale_weight``
/ ``scale_input`` instead (see `quant_checkpoints.convert_old_quants`), or the per-layer JSON
in the file's ``_quantization_metadata`` metadata entry.

comfy-kitchen is optional: this module imports without it, and everything that needs it
imports it on first use (`require_comfy_kitchen`).
"""
from __future__ import annotations

import json
import sys
from typing import Any, Callable

import torch

COMFY_QUANT = "comfy_quant"
INT8_LAYOUT = "TensorWiseINT8Layout"

# checkpoint format -> (layout it loads as in ComfyUI 0.33, storage dtype of `weight`)
FORMATS: dict[str, tuple[str, torch.dtype]] = {
    "float8_e4m3fn": ("TensorCoreFP8E4M3Layout", torch.float8_e4m3fn),
    "float8_e5m2": ("TensorCoreFP8E5M2Layout", torch.float8_e5m2),
    "int8_tensorwise": (INT8_LAYOUT, torch.int8),
    "mxfp8": ("TensorCoreMXFP8Layout", torch.float8_e4m3fn),
    "nvfp4": ("TensorCoreNVFP4Layout", torch.uint8),
    "convrot_w4a4": ("TensorCoreConvRotW4A4Layout", torch.int8),
    "asym_w4a8_int8": ("AsymW4A8Int8Layout", torch.int8),
}

# layout name -> checkpoint format it saves as
LAYOUT_FORMATS: dict[str, str] = {
    "TensorCoreFP8Layout": "float8_e4m3fn",
    "TensorCoreFP8E4M3Layout": "float8_e4m3fn",
    "TensorCoreFP8E5M2Layout": "float8_e5m2",
    INT8_LAYOUT: "int8_tensorwise",
    "TensorCoreMXFP8Layout": "mxfp8",
    "TensorCoreNVFP4Layout": "nvfp4",
    "TensorCoreConvRotW4A4Layout": "convrot_w4a4",
    "AsymW4A8Int8Layout": "asym_w4a8_int8",
}

# per-layer keys a quantized layer may carry besides its bias
QUANT_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "weight_s_rel", "weight_s_channel", "weight_codebook",
                   COMFY_QUANT, "input_scale", "pre_quant_scale")
# formats whose stored weight packs two 4-bit values per byte along the input columns
PACKED_COLUMNS = ("nvfp4", "convrot_w4a4", "asym_w4a8_int8")
# comfy_quant entries that are the weight's layout params (read into them, written from them)
PARAM_CONF = ("convrot", "convrot_groupsize", "group_size", "linear_dtype", "params")
EXTRA_PARAMS = ("input_scale", "pre_quant_scale")


class ComfyKitchenMissingError(ImportError):
    """A quantized checkpoint or layer needs comfy-kitchen, which is not installed."""


def require_comfy_kitchen(what: str = "quantized layers"):
    """The `comfy_kitchen` module (registering ComfyUI's fp8 layout names on first use), or
    `ComfyKitchenMissingError` naming `what` and the fix."""
    try:
        import comfy_kitchen
        from comfy_kitchen import tensor as ck_tensor
    except ImportError as e:
        raise ComfyKitchenMissingError(
            f"{what}: quantized (comfy_quant / scaled fp8) weights need the comfy-kitchen package, "
            f"which is not installed; pip install comfy-kitchen ({e})") from e
    _register_comfy_fp8_layouts(comfy_kitchen, ck_tensor)
    return comfy_kitchen


def _quantized_tensor_class():
    """comfy-kitchen's QuantizedTensor if comfy-kitchen has been imported, else None (no
    QuantizedTensor can exist before that, so this never imports it)."""
    mod = sys.modules.get("comfy_kitchen.tensor")
    return getattr(mod, "QuantizedTensor", None) if mod is not None else None


def is_quantized(t: Any) -> bool:
    """True for a comfy-kitchen QuantizedTensor (or a Parameter wrapping one)."""
    cls = _quantized_tensor_class()
    return cls is not None and isinstance(t, cls)


def _register_comfy_fp8_layouts(ck, ck_tensor) -> None:
    """Register "TensorCoreFP8E4M3Layout" / "TensorCoreFP8E5M2Layout", the names ComfyUI 0.33's
    loader gives fp8 layers, unless already registered (e.g. by ComfyUI itself). Their
    quantize follows ComfyUI's fp8 layouts: ``scale=None`` means a scale of 1.0, ``"recalculate"``
    means amax / fp8 max (kept representable for float16 input), ``stochastic_rounding=seed > 0``
    rounds stochastically with a generator seeded by `seed`. "TensorCoreFP8Layout" stays
    comfy-kitchen's own class (``scale=None`` -> amax, no stochastic rounding)."""
    base = ck_tensor.TensorCoreFP8Layout
    for name, fp8 in (("TensorCoreFP8E4M3Layout", torch.float8_e4m3fn),
                      ("TensorCoreFP8E5M2Layout", torch.float8_e5m2)):
        try:
            ck_tensor.get_layout_class(name)
            continue
        except KeyError:
            pass

        def quantize(cls, tensor, scale=None, stochastic_rounding=0, inplace_ops=False, **kwargs):
            fp8_dtype = cls.FP8_DTYPE
            if isinstance(scale, str) and scale == "recalculate":
                scale = tensor.abs().amax().to(torch.float32) / torch.finfo(fp8_dtype).max
                if tensor.dtype not in (torch.float32, torch.bfloat16):
                    lim = torch.finfo(tensor.dtype)
                    scale = 1.0 / torch.clamp(1.0 / scale, min=lim.min, max=lim.max)
            if scale is None:
                scale = torch.ones((), device=tensor.device, dtype=torch.float32)
            if not isinstance(scale, torch.Tensor):
                scale = torch.tensor(scale, device=tensor.device, dtype=torch.float32)
            scale = scale.to(device=tensor.device, dtype=torch.float32)
            if stochastic_rounding and stochastic_rounding > 0:
                scaled = tensor * (1.0 / scale).to(tensor.dtype)   # never in place on the caller's tensor
                gen = torch.Generator(device=tensor.device)
                gen.manual_seed(int(stochastic_rounding))
                rng = torch.randint(0, 256, scaled.shape, dtype=torch.uint8, device=tensor.device, generator=gen)
                qdata = ck.stochastic_rounding_fp8(scaled, rng, fp8_dtype)
            else:
                qdata = ck.quantize_per_tensor_fp8(tensor, scale, fp8_dtype)
            return qdata, cls.Params(scale=scale, orig_dtype=tensor.dtype, orig_shape=tuple(tensor.shape))

        cls = type(name, (base,), {"FP8_DTYPE": fp8, "quantize": classmethod(quantize),
                                   "__doc__": f"ComfyUI 0.33's {name} (per-tensor {fp8})."})
        ck_tensor.register_layout_class(name, cls)


def conf_tensor(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def conf_from_tensor(t: torch.Tensor) -> dict:
    return json.loads(t.detach().cpu().to(torch.uint8).numpy().tobytes())


def clone_quantized(qt):
    """A QuantizedTensor with its own copies of the data and the scales."""
    from comfy_kitchen.tensor import QuantizedTensor
    return QuantizedTensor(qt._qdata.clone(), qt._layout_cls, qt._params.clone())


def quantized_weight_entries(prefix: str, qt, quant_format: str | None = None, extra_conf: dict | None = None
                             ) -> dict[str, torch.Tensor]:
    """ComfyUI's checkpoint entries for quantized weight `qt` of the layer at `prefix` (ending
    in "."): ``weight``, its scales and ``comfy_quant``."""
    fmt = quant_format or LAYOUT_FORMATS.get(qt._layout_cls)
    if fmt is None:
        raise ValueError(f"{prefix.rstrip('.')}: layout {qt._layout_cls!r} has no ComfyUI checkpoint format")
    entries = {k: v.detach() for k, v in qt.state_dict(prefix + "weight").items()}
    conf = {"format": fmt, **(extra_conf or {})}
    params = qt._params
    if fmt == "int8_tensorwise" and getattr(params, "convrot", False):
        conf["convrot"] = True
        conf["convrot_groupsize"] = int(getattr(params, "convrot_groupsize", 256))
    elif fmt == "convrot_w4a4":
        conf["convrot_groupsize"] = int(params.convrot_groupsize)
        if params.linear_dtype != "int4":
            conf["linear_dtype"] = params.linear_dtype
    elif fmt == "asym_w4a8_int8":
        conf["group_size"] = int(params.group_size)
        conf["convrot_groupsize"] = int(params.convrot_groupsize)
    entries[prefix + COMFY_QUANT] = conf_tensor(conf)
    return entries


def build_quantized_weight(conf: dict, weight: torch.Tensor, take: Callable[[str], torch.Tensor | None], *,
                           orig_dtype: torch.dtype, orig_shape: tuple[int, ...], layer: str):
    """The QuantizedTensor ComfyUI 0.33 builds for a layer from its ``comfy_quant`` JSON `conf`,
    stored `weight` and scales (``take(name)`` pops ``weight_scale`` etc.); it reports
    `orig_dtype` (the model's dtype) and `orig_shape` (the layer's [out, in])."""
    require_comfy_kitchen(f"quantized layer {layer}")
    from comfy_kitchen.tensor import QuantizedTensor, get_layout_class
    fmt = conf.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"{layer}: comfy_quant format {fmt!r} is not supported by the bundled host "
                         f"(supported: {', '.join(FORMATS)})")
    layout, storage = FORMATS[fmt]

    def need(name, view_as=None):
        v = take(name)
        if v is None:
            raise ValueError(f"{layer}: {fmt} layer without its {name}")
        return v.view(view_as) if view_as is not None else v

    params_conf = conf.get("params") if isinstance(conf.get("params"), dict) else {}

    def option(name, default):   # a layer option: top level first, then under "params"
        return conf.get(name, params_conf.get(name, default))

    if fmt in ("float8_e4m3fn", "float8_e5m2"):
        scales = {"scale": need("weight_scale")}
    elif fmt == "mxfp8":
        scales = {"scale": need("weight_scale", torch.float8_e8m0fnu)}
    elif fmt == "nvfp4":
        scales = {"scale": need("weight_scale_2"), "block_scale": need("weight_scale", torch.float8_e4m3fn)}
    elif fmt == "convrot_w4a4":   # per-row fp32 scales of the rotated int4 weight, in groups of 64 columns
        scales = {"scale": need("weight_scale"), "convrot_groupsize": int(option("convrot_groupsize", 256)),
                  "quant_group_size": 64, "linear_dtype": option("linear_dtype", "int4")}
    elif fmt == "asym_w4a8_int8":   # e4m3 group scales (stored as uint8 by some writers), fp32 row scales
        s_rel = need("weight_s_rel")
        scales = {"scale": s_rel.view(torch.float8_e4m3fn) if s_rel.dtype == torch.uint8 else s_rel,
                  "s_channel": take("weight_s_channel"), "codebook": take("weight_codebook"),
                  "group_size": int(option("group_size", 16)),
                  "convrot_groupsize": int(option("convrot_groupsize", 256))}
    else:  # int8_tensorwise
        scales = {"scale": need("weight_scale")}
        if option("convrot", False):
            scales["convrot"] = True
            scales["convrot_groupsize"] = int(option("convrot_groupsize", 256))
    params = get_layout_class(layout).Params(**scales, orig_dtype=orig_dtype, orig_shape=tuple(orig_shape))
    return QuantizedTensor(weight.to(dtype=storage), layout, params)
