"""Nodes for the embedded default model: its text encoder and its codec (the VAE's role).

They load their weights from the pack's own ``standalone/models/embedded/`` folder, so the main
job and the tests run on a fresh machine with no downloads. Weights are loaded once
per process and shared (read-only).
"""
from __future__ import annotations

import functools
import torch

# A category of their own, marked demo, apart from the pack's LoRA nodes ("loaders/lora runtime"):
# these nodes work only with the embedded tiny model. They stay listed in the editor (its
# example workflows need them); ComfyUI's only way to leave a node out of its node list, the
# DEPRECATED flag, would also label them deprecated on the canvas, which they are not.
CATEGORY = "lora runtime demo (embedded tiny model only)"
DEMO_NOTE = "Demo node for the pack's embedded tiny model only (64x64 glyphs; not for other models). "


@functools.lru_cache(maxsize=None)
def _text_encoder():
    from ..standalone.embedded import TEXT_ENCODER
    from ..standalone.embedded.text_encoder import TinyTextEncoder
    return TinyTextEncoder.load(TEXT_ENCODER)


@functools.lru_cache(maxsize=None)
def _codec():
    from ..standalone.embedded import CODEC
    from ..standalone.embedded.codec import TinyCodec
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
    DESCRIPTION = DEMO_NOTE + "Its text encoder: prompt -> Wan-shaped conditioning [1, L, 4096]."

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
    DESCRIPTION = DEMO_NOTE + "Decoder of its codec: LATENT -> 64x64 IMAGE."

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
    DESCRIPTION = DEMO_NOTE + "Encoder of its codec: 64x64 IMAGE -> LATENT."

    def encode(self, pixels):
        with torch.no_grad():
            return ({"samples": _codec().encode(pixels)},)


NODE_CLASS_MAPPINGS = {
    "LoraRuntimeTinyTextEncode": TinyTextEncode,
    "LoraRuntimeTinyDecode": TinyDecode,
    "LoraRuntimeTinyEncode": TinyEncode,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "LoraRuntimeTinyTextEncode": "Demo: Tiny Text Encode (embedded model only)",
    "LoraRuntimeTinyDecode": "Demo: Tiny Decode (embedded model only)",
    "LoraRuntimeTinyEncode": "Demo: Tiny Encode (embedded model only)",
}
