"""Quantized Linear layers for the bundled host: the shape ComfyUI 0.33 gives a model loaded
from a quantized checkpoint (fp8 / int8 / mxfp8 / nvfp4 / convrot_w4a4 / asym_w4a8_int8 layers,
comfy-kitchen ``QuantizedTensor`` weights), so the pack's tests can run on such bases without ComfyUI
installed. Formats and checkpoint keys: `quant_formats`; whole models and files: `quant_checkpoints`.

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

Where the bundled host differs from ComfyUI on purpose: `QuantLinear.forward` computes weight-only
(``F.linear(x, dequantized weight, bias)``); ComfyUI's fp8 / mxfp8 / nvfp4 layers and the
convrot_w4a4 (int4) / asym_w4a8_int8 (int8) kernels also quantize the activations.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .quant_formats import (COMFY_QUANT, EXTRA_PARAMS, INT8_LAYOUT, LAYOUT_FORMATS, PARAM_CONF, build_quantized_weight,
                            clone_quantized, conf_from_tensor, is_quantized, quantized_weight_entries,
                            require_comfy_kitchen)


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


INPUT_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "swiglu": _swiglu,
}


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
        for name in EXTRA_PARAMS:
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
            conf = conf_from_tensor(conf_t)
            qt = build_quantized_weight(conf, weight, take, orig_dtype=self.compute_dtype,
                                        orig_shape=(self.out_features, self.in_features), layer=layer)
            self._set_weight(qt)
            self.quant_format = conf["format"]
            self.quant_conf = {k: v for k, v in conf.items() if k != "format" and k not in PARAM_CONF}
            for name in EXTRA_PARAMS:
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
