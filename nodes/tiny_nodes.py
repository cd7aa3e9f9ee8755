"""Nodes for the embedded default model: its text encoder and its codec (the VAE's role).

They load their weights from the pack's own ``models/embedded/`` folder, so the main
job and the tests run on a fresh machine with no downloads. Weights are loaded once
per process and shared (read-only).
"""
from __future__ import annotations

import functools
import torch

CATEGORY = "lora runtime/embedded model"


@functools.lru_cache(maxsize=None)
def _text_encoder():
    from ..embedded import TEXT_ENCODER
    from ..embedded.text_encoder import TinyTextEncoder
    return TinyTextEncoder.load(TEXT_ENCODER)


@functools.lru_cache(maxsize=None)
def _codec():
    from ..embedded import CODEC
    from ..embedded.codec import TinyCodec
    return TinyCodec.load(CODEC)


class TinyTextEncode:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"text": ("STRING", {"multiline": True, "default": "red 7", "tooltip":
                                                 "A colour and a digit, e.g. 'red 7'. Empty: the "
                                                 "unconditional prompt (use it as the negative)."})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"
    CATEGORY = CATEGORY
    DESCRIPTION = "Text encoder of the embedded tiny Wan model: prompt -> Wan-shaped conditioning [1, L, 4096]."

    @classmethod
    def VALIDATE_INPUTS(cls, text):
        try:
            _text_encoder().encode(text)
        except ValueError as e:
            return str(e)
        return True

    def encode(self, text):
        return ([[_text_encoder().encode(text), {}]],)


class TinyDecode:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT", {"tooltip": "A 64x64 latent [B,16,1,8,8] of the embedded model."})}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "decode"
    CATEGORY = CATEGORY
    DESCRIPTION = "Decoder of the embedded model's codec: LATENT -> 64x64 IMAGE."

    def decode(self, samples):
        with torch.no_grad():
            return (_codec().decode(samples["samples"]),)


class TinyEncode:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"pixels": ("IMAGE", {"tooltip": "64x64 RGB images."})}}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "encode"
    CATEGORY = CATEGORY
    DESCRIPTION = "Encoder of the embedded model's codec: 64x64 IMAGE -> LATENT."

    def encode(self, pixels):
        with torch.no_grad():
            return ({"samples": _codec().encode(pixels)},)


NODE_CLASS_MAPPINGS = {
    "LoraRuntimeTinyTextEncode": TinyTextEncode,
    "LoraRuntimeTinyDecode": TinyDecode,
    "LoraRuntimeTinyEncode": TinyEncode,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "LoraRuntimeTinyTextEncode": "Tiny Text Encode (embedded model)",
    "LoraRuntimeTinyDecode": "Tiny Decode (embedded model)",
    "LoraRuntimeTinyEncode": "Tiny Encode (embedded model)",
}
