"""Reading a base weight as its layer computes with it.

Every read of a base weight (merge, restore, rounding loss, overflow checks, DoRA norms,
fusion guards) goes through this module, so a quantized or packed weight is never read
as if its storage were the weight.

Contract
- `float_view(t)`: when the bytes of `t` are float values of its real shape, a plain
  ``torch.Tensor`` view of the same storage in that dtype and shape (writes reach the
  layer); else None. Plain float tensors and Parameters; GGUF-style tensors (a
  ``tensor_type`` with a ``name`` and a ``tensor_shape``, as ComfyUI-GGUF's GGMLTensor)
  of type F32, F16 and BF16 (BF16 is stored as raw bytes: viewed as bfloat16).
- `packed_reason(t)`: '' when `float_view` gives the weight; else what it is
  ("GGUF Q8_0 (quantized/packed)", "quantized (TensorCoreFP8Layout)", an fp8 dtype, ...), for
  reports and refusals.
- `quant_layout(t)`: the layout name of a host-quantized tensor (comfy-kitchen's
  ``QuantizedTensor``, which ComfyUI 0.33+ loads quantized checkpoints into), else None.
- `adapter_kind(module)`: (kind, why): 'linear' for every layer the host computes as x W^T
  (``nn.Linear`` and its subclasses, and any cast Linear with ``in_features`` /
  ``out_features`` and a weight of that logical shape, such as ComfyUI's mixed-precision
  Linear), 'conv' for convolutions, 'norm' for 1-D weights/biases, else '' and the reason
  naming the class.
- `wrapped(layer)`: the layer an adapted layer wraps (`get_base_layer()`), or the layer itself.
- `float_weight_reason(layer)`: '' when the weight is plain float values of its real shape the
  layer uses as stored (no packing, weight-function patches or scale/quantization attributes
  ``QUANT_ATTRS``); else why not. `fused_read_reason(layer)`: the same question for a fused GEMM
  that reads a Linear's weight and bias itself (also no GGUF tensor, on-the-fly cast, sharding
  attributes ``SHARD_ATTRS``, or bias of another dtype).
- `weight_identity(t)`: equal only while nothing replaced `t` or wrote into it through torch.
- `base_weight(layer)`: the weight the layer multiplies with, as a `BaseWeight`: the
  float view (``writable``: a merge may write into it) or, for a packed / scaled /
  patched weight, the host's own dequantization in fp32 (``writable`` False): a
  ``QuantizedTensor``'s ``dequantize()`` at fp32, a GGUF layer's ``get_weight(weight, dtype)``,
  an fp8 cast times its ``scale_weight`` (ComfyUI 0.3.x's scaled fp8 ops, through
  ``convert_weight``), then the host's per-cast patches in the host's order: its
  ``weight_lowvram_function`` (ComfyUI dynamic VRAM's LoRA patch), then its ``weight_function``
  list. A dequantized copy carries ``key``: the identity of the
  stored weight (storage, in-place version, patches), so caches of values derived from
  it (DoRA norms) hold across calls instead of following each fresh copy.
- `staged_reason(layer)`: '' unless the host stages the weight itself between the stored tensor
  and the layer's computation (ComfyUI dynamic VRAM: a virtual-VRAM range ``_v`` or a
  ``weight_lowvram_function``): then ``STREAMED``, why a merge into the stored weight is refused.
- `instance_list(layer, attr)`: the layer's own ``weight_function`` / ``bias_function`` list to
  append to (a list shared through the class is copied onto the layer first), or None.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_GGUF_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
KEY_ATTR = "_lora_weight_key"


def gguf_type(t) -> str | None:
    """The GGUF tensor type's name ("Q8_0", "F16", ...) of a GGUF-style tensor, else None."""
    tt = getattr(t, "tensor_type", None)
    if tt is None or not hasattr(t, "tensor_shape"):
        return None
    return getattr(tt, "name", str(tt))


def quant_layout(t) -> str | None:
    """The layout name of a host-quantized tensor (a ``QuantizedTensor``), else None."""
    layout = getattr(t, "_layout_cls", None)
    if layout is None or not isinstance(t, torch.Tensor) or not callable(getattr(t, "dequantize", None)):
        return None
    return layout if isinstance(layout, str) else getattr(layout, "__name__", str(layout))


def stored_tensors(t) -> list[torch.Tensor]:
    """A host-quantized tensor's stored data and scales (its inner tensors)."""
    return [t._qdata] + [v for v in vars(getattr(t, "_params", object())).values() if isinstance(v, torch.Tensor)]


def dequantized(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A host-quantized tensor's values as a plain tensor of `dtype`, through its own
    ``dequantize`` at that dtype (the grid point itself, no rounding to the stored dtype)."""
    return _plain(t.to(dtype).dequantize()).to(dtype)


_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def adapter_kind(module) -> tuple[str, str]:
    """(kind, why) of a layer an adapter targets (see module doc); `why` is set when kind is ''."""
    if module is None:
        return "", "no such layer"
    if getattr(module, "is_lora_wrapper", False) or isinstance(module, nn.Linear):
        return "linear", ""
    if isinstance(module, _CONV):
        return "conv", ""
    w, b = getattr(module, "weight", None), getattr(module, "bias", None)
    name = type(module).__name__
    if isinstance(w, torch.Tensor) and not w.is_meta and len(real_shape(w)) == 2:
        out_f, in_f = getattr(module, "out_features", None), getattr(module, "in_features", None)
        if isinstance(out_f, int) and isinstance(in_f, int) and real_shape(w) == (out_f, in_f):
            return "linear", ""
        return "", (f"{name} has a 2-D weight {list(real_shape(w))} but no matching in_features/out_features, "
                    "so it is not known to compute x W^T")
    if (isinstance(w, torch.Tensor) and w.dim() == 1) or (w is None and isinstance(b, torch.Tensor) and b.dim() == 1):
        return "norm", ""
    if w is None and b is None:
        return "", f"{name} has no weight or bias"
    return "", f"{name} is neither a Linear, a convolution nor a norm layer"


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t if type(t) in (torch.Tensor, nn.Parameter) else t.as_subclass(torch.Tensor)


def float_view(t) -> torch.Tensor | None:
    """A plain float view of `t` in its real shape (same storage), or None (see module doc)."""
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return None
    kind = gguf_type(t)
    if kind is None:
        if type(t) not in (torch.Tensor, nn.Parameter) or t.dtype not in FLOAT_DTYPES:
            return None
        return t
    dtype = _GGUF_FLOATS.get(kind)
    if dtype is None:
        return None
    raw = _plain(t)
    shape = tuple(t.tensor_shape)
    if raw.dtype != dtype:
        if raw.dtype != torch.uint8 or not raw.is_contiguous():
            return None
        raw = raw.view(torch.uint8).reshape(-1).view(dtype)
    if raw.numel() != _numel(shape):
        return None
    return raw.reshape(shape)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def packed_reason(t) -> str:
    """'' when `t` reads as a float weight through `float_view`; else what it is."""
    if t is None:
        return "no weight"
    if getattr(t, "is_meta", False):
        return "weight is on the meta device (offloaded)"
    if float_view(t) is not None:
        return ""
    kind = gguf_type(t)
    if kind is not None:
        return f"weight is GGUF {kind} (quantized/packed)"
    layout = quant_layout(t)
    if layout is not None:
        return f"weight is quantized ({layout})"
    if isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, nn.Parameter):
        return f"weight dtype {t.dtype} has no defined merge rounding (fp8/int)"
    return f"weight is a {type(t).__name__} (quantized/packed)"


def real_shape(t) -> tuple[int, ...]:
    """The weight's logical shape (GGUF-style tensors report theirs in ``tensor_shape``)."""
    s = getattr(t, "tensor_shape", None)
    return tuple(int(v) for v in (s if s is not None else t.shape))


@dataclass
class BaseWeight:
    tensor: torch.Tensor     # [out, in, ...] in the real shape
    writable: bool           # a view of the layer's storage: a merge writes here
    reason: str = ""         # when not writable: why (packed_reason)


def weight_identity(t: torch.Tensor) -> tuple:
    """Equal only while nothing replaced `t` or wrote into it through torch (storage, write count,
    dtype, device, shape, strides; a quantized tensor: those of its stored bytes and scales). An
    inference tensor keeps no write count."""
    if quant_layout(t) is not None:  # the stored bytes and scales live in the inner tensors
        return ("quantized", quant_layout(t), *(weight_identity(v) for v in stored_tensors(t)))
    try:
        version = t._version
    except RuntimeError:
        version = "inference"
    return (t.data_ptr(), version, str(t.dtype), str(t.device), real_shape(t), tuple(t.stride()))


def wrapped(layer: nn.Module) -> nn.Module:
    """The layer an adapted layer wraps (`get_base_layer()`), else `layer` itself."""
    return layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer


#: Why a weight the host stages itself (ComfyUI dynamic VRAM) takes no merge; the text before the
#: first ': ' is the report's short label.
STREAMED = ("streamed (dynamic VRAM): ComfyUI casts this weight from its host copy at every call or keeps a "
            "patched copy of it in VRAM that it may evict and copy again, so a merge into the stored weight would "
            "not reach what the layer computes with and could not be put back into ComfyUI's staged copies; the "
            "adapter runs dynamic on top of ComfyUI's cast")


def staged_reason(layer: nn.Module) -> str:
    """'' unless the host stages this (wrapped) layer's weight itself (see module doc)."""
    base = wrapped(layer)
    if hasattr(base, "_v") or getattr(base, "weight_lowvram_function", None) is not None:
        return STREAMED
    return ""


def instance_list(layer: nn.Module, attr: str) -> list | None:
    """The layer's own `attr` list (``weight_function`` / ``bias_function``) to append to, or None
    when it has none. ComfyUI's cast ops declare empty lists on the class, and its dynamic VRAM
    loader gives a layer its own list only when it stages the weight: appending to the class's
    list would patch every layer of that class, so a shared list is copied onto the layer first."""
    lst = getattr(layer, attr, None)
    if not isinstance(lst, list):
        return None
    if attr not in layer.__dict__:
        lst = list(lst)
        setattr(layer, attr, lst)
    return lst


#: Attributes of a layer whose weight is rescaled or dequantized per call (not used as stored).
QUANT_ATTRS = ("scale_weight", "weight_scale", "quant_state", "qweight")
#: Attributes of a tensor-parallel Linear: a fused GEMM would see one shard.
SHARD_ATTRS = ("gather_output", "skip_bias_add")
_FUSED_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def float_weight_reason(layer: nn.Module) -> str:
    """'' when the (wrapped) layer's weight is plain float values it uses as stored; else why not."""
    base = wrapped(layer)
    why = packed_reason(base.weight)
    if why:
        return why
    if getattr(base, "weight_function", None):
        return "weight has weight-function patches"
    staged = staged_reason(base)
    if staged:
        return staged
    for attr in QUANT_ATTRS:
        if getattr(base, attr, None) is not None:
            return f"weight is scaled/quantized ({attr})"
    return ""


def fused_read_reason(layer: nn.Module) -> str:
    """'' when a fused GEMM may read this (wrapped) Linear's weight and bias as they are; else why
    not. A GGUF weight of any type is read per call by its layer (get_weight): never handed over."""
    base = wrapped(layer)
    w = getattr(base, "weight", None)
    if gguf_type(w) is not None:
        return (packed_reason(w) or f"weight is GGUF {gguf_type(w)}") + ": its layer reads it per call (get_weight)"
    if not isinstance(base, nn.Linear):
        return f"first linear is a {type(base).__name__}"
    if type(w) not in (torch.Tensor, nn.Parameter):
        return f"weight is a {type(w).__name__} (quantized/packed)"
    if w.dtype not in _FUSED_FLOATS:
        return f"weight dtype {w.dtype}"
    if getattr(base, "weight_function", None) or getattr(base, "bias_function", None):
        return "weight/bias-function patches (computed at call time)"
    if staged_reason(base):
        return "weight is streamed (dynamic VRAM): cast by the host at call time"
    if getattr(base, "comfy_cast_weights", False):
        return "weights are cast/offloaded at call time"
    for attr in QUANT_ATTRS + SHARD_ATTRS:
        if getattr(base, attr, None) not in (None, False):
            return f"layer has {attr}"
    if base.bias is not None and base.bias.dtype != w.dtype:
        return "bias dtype differs from weight dtype"
    return ""


@torch.no_grad()
def base_weight(layer: nn.Module) -> BaseWeight:
    """The weight `layer` multiplies with (see module doc). A wrapper is judged by the layer
    it wraps (`get_base_layer`)."""
    base = wrapped(layer)
    w = base.weight
    if w is None:
        raise ValueError(f"{type(base).__name__} has no weight")
    lowvram = getattr(base, "weight_lowvram_function", None)
    functions = ([lowvram] if lowvram is not None else []) + list(getattr(base, "weight_function", None) or ())
    scale = getattr(base, "scale_weight", None)
    view = float_view(w)
    if view is not None and not functions and scale is None:
        return BaseWeight(view, True)
    get_weight = getattr(base, "get_weight", None)
    if quant_layout(w) is not None:
        d = dequantized(w)                 # the host's own dequantization, at fp32
    elif callable(get_weight) and gguf_type(w) is not None:
        d = get_weight(w, torch.float32)   # the layer's own dequantization (and its own patches)
    else:
        d = (view if view is not None else _plain(w)).to(torch.float32, copy=True)
        if scale is not None:
            convert = getattr(base, "convert_weight", None)
            d = convert(d) if callable(convert) else d * scale.to(device=d.device, dtype=d.dtype)
    for f in functions:
        d = f(d)
    d = _plain(d).to(torch.float32)
    if tuple(d.shape) != real_shape(w):
        d = d.reshape(real_shape(w))
    patches = getattr(w, "patches", None) or ()
    key = ("dequantized", weight_identity(w), tuple(id(p) for p in patches), tuple(id(f) for f in functions),
           None if scale is None else weight_identity(scale))
    setattr(d, KEY_ATTR, key)
    why = packed_reason(w) or staged_reason(base) or ("weight has weight-function patches" if functions
                                                      else "weight is scaled (scale_weight)")
    return BaseWeight(d, False, why)


def own_storage(t) -> None:
    """Before the first in-place write into a GGUF-style tensor on the CPU, give it a private
    copy of its bytes (same dtype, shape and values). ComfyUI-GGUF keeps CPU weights as views of
    a read-only memory map of the file, where a write kills the process; it releases the map
    the same way when it offloads. Plain tensors, device tensors and tensors already copied are
    left as they are."""
    if gguf_type(t) is None or t.device.type != "cpu" or getattr(t, "_lora_owned_storage", False):
        return
    with torch.no_grad():
        t.data = t.as_subclass(torch.Tensor).clone()
    t._lora_owned_storage = True
