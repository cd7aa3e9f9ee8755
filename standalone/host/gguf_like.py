"""GGUF-style packed weights for the bundled host: the shape ComfyUI-GGUF gives a model.

A quantized model loaded by ComfyUI-GGUF keeps each weight as a tensor subclass holding the
file's bytes, with the real shape in ``tensor_shape`` (which ``.shape`` reports) and the
GGML type in ``tensor_type``; its layers dequantize per call through ``get_weight(tensor,
dtype)``. This module builds the same thing from a plain model, so the pack's tests can run
every mode on packed weights without ComfyUI or ComfyUI-GGUF installed.

Formats (GGML's, from its published layout):
- ``Q8_0``: the values in row-major order, in blocks of 32; each block is a float16 scale
  ``d`` (2 bytes, little-endian) then 32 int8 quants ``q``; the value is ``d * q``.
  Quantizing a block: ``d = max|x| / 127``, ``q = round(x / d)`` (half away from zero).
  Stored as uint8 [rows, 34 * cols / 32] (the last dim must be a multiple of 32).
- ``BF16``: the bfloat16 bytes as uint8 [rows, 2 * cols] (ComfyUI-GGUF reads BF16 so).
- ``F16`` / ``F32``: a float16 / float32 tensor of the real shape.
"""
from __future__ import annotations

import copy
import enum

import torch
import torch.nn.functional as F
from torch import nn

QK8_0 = 32
Q8_0_BLOCK_BYTES = 2 + QK8_0


class QuantType(enum.IntEnum):
    """GGML tensor type ids (the subset the bundled host writes)."""
    F32 = 0
    F16 = 1
    Q8_0 = 8
    BF16 = 30


class PackedTensor(torch.Tensor):
    """A weight's stored bytes (any dtype and storage shape) with its real shape and GGML type.
    Ops return plain tensors of the storage; `to`, `detach` and `clone` keep the wrapping."""

    _KEEP = {"to", "detach", "clone", "cpu", "cuda", "requires_grad_"}

    @staticmethod
    def __new__(cls, data: torch.Tensor, tensor_type: QuantType, tensor_shape):
        t = data.as_subclass(cls)
        t.tensor_type = QuantType(tensor_type)
        t.tensor_shape = torch.Size(tensor_shape)
        return t

    @property
    def shape(self):  # the real shape, as ComfyUI-GGUF's GGMLTensor reports it
        return self.tensor_shape

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        src = args[0] if args else None
        if name in cls._KEEP and isinstance(src, PackedTensor) and isinstance(out, torch.Tensor) \
                and type(out) is not PackedTensor and out.numel() == torch.Tensor.numel(src):
            return PackedTensor(out, src.tensor_type, src.tensor_shape)
        return out

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        new = PackedTensor(self.as_subclass(torch.Tensor).clone(), self.tensor_type, self.tensor_shape)
        if getattr(self, "_is_param", False):
            new = nn.Parameter(new, requires_grad=False)
        memo[id(self)] = new
        return new

    def __repr__(self) -> str:
        return f"PackedTensor({self.tensor_type.name}, shape={tuple(self.tensor_shape)})"


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """Q8_0 bytes of `x` (last dim a multiple of 32): uint8 [rows, 34 * cols / 32]."""
    x = x.detach().to(torch.float32)
    if x.shape[-1] % QK8_0:
        raise ValueError(f"Q8_0 needs a last dim that is a multiple of {QK8_0}, got {tuple(x.shape)}")
    rows = x.reshape(-1, x.shape[-1])
    blocks = rows.reshape(-1, QK8_0)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    v = blocks * inv
    q = (v.sign() * (v.abs() + 0.5).floor()).clamp_(-127, 127).to(torch.int8)   # half away from zero
    scale = d.to(torch.float16).view(torch.uint8).reshape(-1, 2)                 # little-endian on every torch host
    packed = torch.cat([scale, q.view(torch.uint8)], dim=1)
    return packed.reshape(rows.shape[0], -1).contiguous()


def dequantize_q8_0(packed: torch.Tensor, shape) -> torch.Tensor:
    """float32 values of Q8_0 bytes (`quantize_q8_0`), in `shape`."""
    b = packed.reshape(-1, Q8_0_BLOCK_BYTES)
    d = b[:, :2].contiguous().view(torch.float16).to(torch.float32)
    q = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return (d * q).reshape(tuple(shape))   # fp16 scale x int8: exact in fp32


def pack(w: torch.Tensor, qtype: QuantType | str) -> PackedTensor:
    """`w` stored as `qtype` (see the module doc)."""
    qtype = QuantType[qtype] if isinstance(qtype, str) else QuantType(qtype)
    shape = tuple(w.shape)
    w = w.detach()
    if qtype is QuantType.Q8_0:
        data = quantize_q8_0(w)
    elif qtype is QuantType.BF16:
        data = w.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(shape[0] if w.dim() > 1 else 1, -1)
        data = data.contiguous()
    elif qtype is QuantType.F16:
        data = w.to(torch.float16).contiguous()
    else:
        data = w.to(torch.float32).contiguous()
    return PackedTensor(data, qtype, shape)


def dequantize(t: PackedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The values of a packed tensor as a plain tensor in `dtype` (default float32)."""
    raw = t.as_subclass(torch.Tensor)
    if t.tensor_type is QuantType.Q8_0:
        out = dequantize_q8_0(raw, t.tensor_shape)
    elif t.tensor_type is QuantType.BF16:
        out = raw.contiguous().reshape(-1).view(torch.bfloat16).reshape(tuple(t.tensor_shape))
    else:
        out = raw.reshape(tuple(t.tensor_shape))
    return out.to(dtype or torch.float32)


class PackedLinear(nn.Linear):
    """A Linear whose weight and bias are `PackedTensor`s, dequantized on every call through
    `get_weight` (as ComfyUI-GGUF's layers do)."""

    comfy_cast_weights = True

    def __init__(self, weight: PackedTensor, bias: PackedTensor | None):
        nn.Module.__init__(self)
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def get_weight(self, tensor, dtype):
        if tensor is None:
            return None
        return dequantize(tensor, dtype) if isinstance(tensor, PackedTensor) else tensor.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.get_weight(self.weight, x.dtype), self.get_weight(self.bias, x.dtype))


def _swap(model: nn.Module, make) -> nn.Module:
    for name, m in list(model.named_modules()):
        for child_name, child in list(m.named_children()):
            new = make(child)
            if new is not None:
                setattr(m, child_name, new)
    return model


def pack_model(model: nn.Module, qtype: QuantType | str, *, min_numel: int = 1024) -> nn.Module:
    """A copy of `model` with every Linear of at least `min_numel` weights packed as `qtype`
    (biases F32, as GGUF files keep 1-D tensors); a Q8_0 weight whose last dim is no multiple of
    32 stays F16 (as GGUF converters do)."""
    model = copy.deepcopy(model)

    def make(m):
        if type(m) is not nn.Linear or m.weight.numel() < min_numel:
            return None
        q = QuantType[qtype] if isinstance(qtype, str) else QuantType(qtype)
        if q is QuantType.Q8_0 and m.weight.shape[-1] % QK8_0:
            q = QuantType.F16
        b = None if m.bias is None else pack(m.bias, QuantType.F32)
        return PackedLinear(pack(m.weight, q), b)

    return _swap(model, make)


def unpacked_model(model: nn.Module) -> nn.Module:
    """A copy of `model` with every PackedLinear replaced by a plain fp32 Linear holding its
    dequantized weight and bias: the same numbers as plain weights."""
    model = copy.deepcopy(model)

    def make(m):
        if not isinstance(m, PackedLinear):
            return None
        lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(m.get_weight(m.weight, torch.float32))
            if m.bias is not None:
                lin.bias.copy_(m.get_weight(m.bias, torch.float32))
        return lin

    return _swap(model, make)
