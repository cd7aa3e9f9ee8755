"""Quantized Linear layers for the bundled host: the shape ComfyUI 0.33 gives a model loaded
from a quantized checkpoint (fp8 / int8 / mxfp8 / nvfp4 / convrot_w4a4 / asym_w4a8_int8 layers,
comfy-kitchen ``QuantizedTensor`` weights), so the pack's tests can run on such bases without ComfyUI installed.

What ComfyUI 0.33 does, and what this module reproduces (in its own code):

- A quantized layer is a plain ``nn.Module`` (not an ``nn.Linear``): ``in_features``,
  ``out_features``, ``weight`` (an ``nn.Parameter`` wrapping a ``QuantizedTensor``, whose
  ``.shape`` / ``.dtype`` are the logical shape and the compute dtype), ``bias`` (a plain float
  Parameter or None), ``layout_type`` (the layout's registered name), ``quant_format`` (the
  checkpoint's format string), ``comfy_cast_weights = True`` and the patch hooks
  ``weight_function`` / ``bias_function`` (each ``f(tensor) -> tensor``, applied at cast time;
  ComfyUI's dynamic LoRA and low-VRAM patches ride there).
- The cast (`cast_bias_weight`): the bias goes to the compute dtype, then through each
  bias_function; the weight stays the QuantizedTensor itself unless a weight_function is set or
  its dtype differs from the compute dtype, in which case it is dequantized (in the compute
  dtype) and passed through each weight_function.
- `linear_input_act(linear, x, act)`: an MLP's ``linear(act(x))``. For a
  ``TensorWiseINT8Layout`` weight (not transposed) whose cast stays quantized, the activation is
  folded into comfy-kitchen's ``int8_linear`` kernel and **the layer's forward is not called**;
  when the cast dequantizes (a weight_function, or another dtype), it computes
  ``F.linear(act(x), weight, bias)`` with the cast weight, again without the forward. Any other
  weight: ``linear(act(x))``.
- Checkpoint keys of a quantized layer ``P``: ``P.weight`` (the quantized data in the format's
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
  / ``scale_input`` instead (see `convert_old_quants`), or the per-layer JSON in the file's
  ``_quantization_metadata`` metadata entry.

Where the bundled host differs from ComfyUI on purpose: `QuantLinear.forward` computes weight-only
(``F.linear(x, dequantized weight, bias)``); ComfyUI's fp8 / mxfp8 / nvfp4 layers and the
convrot_w4a4 (int4) / asym_w4a8_int8 (int8) kernels also quantize the activations. comfy-kitchen is optional: this module imports without it, and everything that
needs it imports it on first use (`require_comfy_kitchen`).
"""
from __future__ import annotations

import copy
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

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
_QUANT_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "weight_s_rel", "weight_s_channel", "weight_codebook",
                   COMFY_QUANT, "input_scale", "pre_quant_scale")
# formats whose stored weight packs two 4-bit values per byte along the input columns
_PACKED_COLUMNS = ("nvfp4", "convrot_w4a4", "asym_w4a8_int8")
# comfy_quant entries that are the weight's layout params (read into them, written from them)
_PARAM_CONF = ("convrot", "convrot_groupsize", "group_size", "linear_dtype", "params")
_EXTRA_PARAMS = ("input_scale", "pre_quant_scale")


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


INPUT_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "swiglu": _swiglu,
}


# --------------------------------------------------------------------------
# comfy-kitchen, imported lazily
# --------------------------------------------------------------------------

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


def _conf_tensor(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def _conf_from_tensor(t: torch.Tensor) -> dict:
    return json.loads(t.detach().cpu().to(torch.uint8).numpy().tobytes())


# --------------------------------------------------------------------------
# the cast and the layer
# --------------------------------------------------------------------------

def cast_bias_weight(module: nn.Module, dtype: torch.dtype, bias_dtype: torch.dtype | None = None):
    """(weight, bias) of `module` as ComfyUI 0.33's cast hands them to a layer on the CPU
    (no offload stream, no dynamic VRAM): the bias in `bias_dtype` (default `dtype`) then
    through each ``bias_function``; the weight unchanged - a QuantizedTensor stays one - unless a
    ``weight_function`` is set or its dtype is not `dtype`: then in `dtype`, dequantized, then
    through each weight_function. A function never receives the module's own tensor."""
    bias_dtype = dtype if bias_dtype is None else bias_dtype
    weight = module.weight
    bias = getattr(module, "bias", None)
    weight_functions = getattr(module, "weight_function", None) or ()
    bias_functions = getattr(module, "bias_function", None) or ()
    if bias is not None:
        bias = bias.to(dtype=bias_dtype, copy=len(bias_functions) > 0)
        for f in bias_functions:
            bias = f(bias)
    if len(weight_functions) > 0 or weight.dtype != dtype:
        weight = weight.to(dtype=dtype, copy=not is_quantized(weight))
        if is_quantized(weight):
            weight = weight.dequantize()
        for f in weight_functions:
            weight = f(weight)
    return weight, bias


class QuantLinear(nn.Module):
    """ComfyUI 0.33's quantized Linear (``mixed_precision_ops(...).Linear``) for the bundled host.

    Not an ``nn.Linear``. ``weight``: an ``nn.Parameter`` wrapping a comfy-kitchen
    QuantizedTensor (or a plain tensor for a layer loaded without ``comfy_quant``); ``bias``: a
    plain Parameter or None. ``forward`` is weight-only: ``F.linear(x, dequantized weight, bias)``
    in x's dtype after the cast (`cast_bias_weight`), so ``weight_function`` /
    ``bias_function`` patches apply. ``state_dict()`` writes, and ``load_state_dict`` reads,
    ComfyUI's checkpoint keys (see the module doc); `compute_dtype` is the dtype a loaded weight
    reports (ComfyUI: the model's dtype)."""

    comfy_cast_weights = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, weight=None,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.compute_dtype = dtype
        self.weight_function: list = []
        self.bias_function: list = []
        self.layout_type: str | None = None
        self.quant_format: str | None = None
        self.quant_conf: dict = {}   # the comfy_quant JSON besides "format" (e.g. full_precision_matrix_mult)
        self.register_parameter("weight", None)
        if weight is not None:
            self._set_weight(weight)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, layout: str, **quantize_kwargs) -> "QuantLinear":
        """`linear` with its weight quantized as `layout` (``QuantizedTensor.from_float`` of the
        weight in its own dtype, `quantize_kwargs` passed on) and its bias kept plain. Raises
        comfy-kitchen's ValueError for a shape the layout refuses."""
        require_comfy_kitchen(f"QuantLinear({layout})")
        from comfy_kitchen.tensor import QuantizedTensor
        w = QuantizedTensor.from_float(linear.weight.detach(), layout, **quantize_kwargs)
        q = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, weight=w,
                dtype=linear.weight.dtype, device=linear.weight.device)
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return q

    def _set_weight(self, weight: torch.Tensor) -> None:
        self.weight = nn.Parameter(weight, requires_grad=False)
        if is_quantized(weight):
            self.layout_type = weight._layout_cls
            fmt = LAYOUT_FORMATS.get(self.layout_type, self.quant_format)
            if fmt is None:
                raise ValueError(f"layout {self.layout_type!r} has no ComfyUI checkpoint format; "
                                 f"supported: {', '.join(sorted(LAYOUT_FORMATS))}")
            self.quant_format = fmt
        else:
            self.layout_type = None
            self.quant_format = None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, layout_type={self.layout_type}")

    # ---- ComfyUI's layer API ----

    def cast_weight_bias(self, dtype: torch.dtype, bias_dtype: torch.dtype | None = None):
        """(weight, bias) as ComfyUI's cast gives them for compute dtype `dtype`; see
        `cast_bias_weight`."""
        return cast_bias_weight(self, dtype, bias_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = getattr(self, "pre_quant_scale", None)
        if pre is not None:   # ModelOpt AWQ smoothing, as ComfyUI applies it
            x = x * pre.to(device=x.device, dtype=x.dtype)
        weight, bias = self.cast_weight_bias(x.dtype)
        if is_quantized(weight):
            weight = weight.dequantize().to(x.dtype)
        return F.linear(x, weight, bias)

    def convert_weight(self, weight: torch.Tensor | None = None, inplace: bool = False, **kwargs) -> torch.Tensor:
        """ComfyUI's convert_weight: a QuantizedTensor (default: this layer's weight) dequantized,
        a plain tensor as is."""
        weight = self.weight if weight is None else weight
        return weight.dequantize() if is_quantized(weight) else weight

    def set_weight(self, weight: torch.Tensor, inplace_update: bool = False, seed: int | None = None,
                   return_weight: bool = False, **kwargs):
        """ComfyUI's set_weight: a new float weight re-quantized with this layer's own layout
        settings (``requantize_from_float(w, scale="recalculate", stochastic_rounding=seed,
        inplace_ops=True)``, then reported in the layer's dtype) replacing the Parameter; a
        plain layer just casts. `seed` None means round to nearest (ComfyUI's fp8 layouts fail on
        None; its model patcher always passes a seed). With `return_weight` the new weight is
        returned and the layer is left alone."""
        if self.layout_type is not None and is_quantized(self.weight):
            new = self.weight.requantize_from_float(weight, scale="recalculate", stochastic_rounding=seed or 0,
                                                    inplace_ops=True).to(self.weight.dtype)
        else:
            new = weight.to(self.weight.dtype)
        if return_weight:
            return new
        if inplace_update:
            raise NotImplementedError("QuantLinear.set_weight: inplace_update is not supported (nor in ComfyUI)")
        self._set_weight(new)
        return None

    # ---- ComfyUI's checkpoint keys ----

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        def out(t):
            return t if keep_vars else t.detach()

        if self.bias is not None:
            destination[prefix + "bias"] = out(self.bias)
        if self.weight is None:
            return
        if is_quantized(self.weight):
            destination.update(quantized_weight_entries(prefix, self.weight, self.quant_format, self.quant_conf))
        else:
            destination[prefix + "weight"] = out(self.weight)
        for name in _EXTRA_PARAMS:
            v = getattr(self, name, None)
            if v is not None:
                destination[prefix + name] = out(v)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        layer = prefix.rstrip(".") or "<root>"
        taken: list[str] = []

        def take(name):
            v = state_dict.pop(prefix + name, None)
            if v is not None:
                taken.append(prefix + name)
            return v

        conf_t = take(COMFY_QUANT)
        weight = take("weight")
        if weight is None:
            if conf_t is not None:
                error_msgs.append(f"{layer}: a comfy_quant entry but no weight")
        elif conf_t is None:
            self._set_weight(weight.to(self.compute_dtype))
        else:
            conf = _conf_from_tensor(conf_t)
            qt = build_quantized_weight(conf, weight, take, orig_dtype=self.compute_dtype,
                                        orig_shape=(self.out_features, self.in_features), layer=layer)
            self._set_weight(qt)
            self.quant_format = conf["format"]
            self.quant_conf = {k: v for k, v in conf.items() if k != "format" and k not in _PARAM_CONF}
            for name in _EXTRA_PARAMS:
                v = take(name)
                if v is not None:
                    setattr(self, name, nn.Parameter(v, requires_grad=False))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        for k in taken:
            while k in missing_keys:
                missing_keys.remove(k)

    # ---- torch plumbing a QuantizedTensor Parameter needs ----

    def _apply(self, fn, recurse=True):
        # .to() / .float() / .cpu(): a QuantizedTensor Parameter is re-wrapped instead of having
        # its .data swapped (which a wrapper subclass does not support)
        held = {k: p for k, p in self._parameters.items() if is_quantized(p)}
        for k in held:
            self._parameters[k] = None
        try:
            super()._apply(fn, recurse)
        finally:
            for k, p in held.items():
                self._parameters[k] = p
        for k, p in held.items():
            self._parameters[k] = nn.Parameter(fn(p), requires_grad=False)
        return self

    def __deepcopy__(self, memo):
        # copy.deepcopy of a QuantizedTensor fails (it has no real storage): clone it by parts
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k == "_parameters":
                params = {}
                for name, p in v.items():
                    if is_quantized(p):
                        params[name] = nn.Parameter(clone_quantized(p), requires_grad=False)
                        memo[id(p)] = params[name]
                    else:
                        params[name] = copy.deepcopy(p, memo)
                new.__dict__[k] = params
            else:
                new.__dict__[k] = copy.deepcopy(v, memo)
        return new


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
    entries[prefix + COMFY_QUANT] = _conf_tensor(conf)
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


# --------------------------------------------------------------------------
# the MLP activation fold
# --------------------------------------------------------------------------

def linear_input_act(linear: nn.Module, x: torch.Tensor, input_act: str) -> torch.Tensor:
    """``linear(act(x))`` as ComfyUI 0.33's ``comfy.ops.linear_input_act`` computes it (act:
    "gelu_tanh" or "swiglu"). For an int8 ``TensorWiseINT8Layout`` weight (not transposed) the
    layer's forward is bypassed: its cast (weight_function / bias_function included) is taken
    and either comfy-kitchen's ``int8_linear`` runs with the activation folded in, or - when the
    cast hands back a dequantized weight - ``F.linear(act(x), weight, bias)``. Anything else
    calls ``linear(act(x))``. (ComfyUI reads ``linear.weight`` unguarded; a module without one
    takes the eager path here.)"""
    try:
        act = INPUT_ACTS[input_act]
    except KeyError:
        raise ValueError(f"input_act {input_act!r}: expected one of {sorted(INPUT_ACTS)}") from None
    weight = getattr(linear, "weight", None)
    if (not is_quantized(weight) or weight._layout_cls != INT8_LAYOUT
            or getattr(weight._params, "transposed", False)):
        return linear(act(x))
    weight, bias = cast_bias_weight(linear, x.dtype)
    if not is_quantized(weight):
        return F.linear(act(x), weight, bias)
    ck = require_comfy_kitchen("linear_input_act")
    qdata, scale = weight._qdata, weight._params.scale
    return ck.int8_linear(x, qdata, scale, bias, x.dtype,
                          convrot=getattr(weight._params, "convrot", False),
                          convrot_groupsize=getattr(weight._params, "convrot_groupsize", 256),
                          input_act=input_act)


# --------------------------------------------------------------------------
# whole models
# --------------------------------------------------------------------------

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
        sd[f"{layer}.{COMFY_QUANT}"] = _conf_tensor(conf)
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
        if _conf_from_tensor(v).get("format") in _PACKED_COLUMNS:
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
        return layer in layers and suffix in _QUANT_SUFFIXES

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
