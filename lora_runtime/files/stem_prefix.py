"""Stem prefixes: the outer prefixes a file writes before a model's module name.

`split_prefix(stem)` strips dotted prefixes (``base_model.model.``, ``diffusion_model.``,
``transformer.``, ...) or reads a kohya-style one (``lora_unet_``, ``lycoris_``, ...) that marks
a name whose dots are written as underscores.
"""
from __future__ import annotations

_DOTTED_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.", "unet.")
_UNDERSCORE_PREFIXES = ("lora_unet__", "lora_unet_", "lora_transformer_", "lycoris_", "lora_te_")
NATIVE_DOTTED = ("", "diffusion_model.", "model.diffusion_model.")
ANY_DOTTED = ("", "diffusion_model.", "model.diffusion_model.", "transformer.", "base_model.model.", "unet.", "model.")


def split_prefix(stem: str) -> tuple[str, str, bool]:
    """(outermost prefix kind, rest, rest uses '_' for '.')."""
    kind = None
    s = stem
    changed = True
    while changed:
        changed = False
        for p in _DOTTED_PREFIXES:
            if s.startswith(p):
                kind = p if kind is None else kind
                s = s[len(p):]
                changed = True
    for p in _UNDERSCORE_PREFIXES:
        if s.startswith(p):
            # VideoX-Fun writes lora_unet__blocks_0_...; kohya's SD scripts run on Flux wrote a
            # trailing '_' (lora_unet_single_transformer_blocks_0_attn_to_k_)
            return p, s[len(p):].strip("_"), True
    return (kind or ""), s, False

