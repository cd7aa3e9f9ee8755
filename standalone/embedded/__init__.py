"""The embedded default model: a tiny Wan 2.1 text-to-image model of coloured digits.

Everything needed to run a real diffusion model on a fresh CPU machine without
downloads, trained from scratch by ``tools/train_embedded.py`` and committed under
``standalone/models/`` (see ``standalone/models/MODEL_CARD.md``):

- ``standalone/models/diffusion_models/tiny_wan_glyphs.safetensors``: Wan 2.1 T2V layout
  (dim 128, 4 blocks), loadable by ComfyUI's UNETLoader and ``load_wan_checkpoint``;
- ``standalone/models/loras/glyph_outline_style.safetensors`` (kohya), ``glyph_distilled_cfg``
  (PEFT, sub-ulp), ``glyph_outline_style_diffusers`` (diffusers-named Wan);
- ``standalone/models/embedded/``: the codec (``TinyCodec``, the VAE's role), the text encoder
  (``TinyTextEncoder``) and the judge (``GlyphJudge``).

``generate(...)`` in ``standalone.embedded.pipeline`` runs prompt -> KSampler -> decode.
"""
from __future__ import annotations

from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = PACK_ROOT / "standalone" / "models"
BASE_MODEL = MODELS_DIR / "diffusion_models" / "tiny_wan_glyphs.safetensors"
LORAS_DIR = MODELS_DIR / "loras"
STYLE_LORA = LORAS_DIR / "glyph_outline_style.safetensors"
DISTILLED_LORA = LORAS_DIR / "glyph_distilled_cfg.safetensors"
STYLE_LORA_DIFFUSERS = LORAS_DIR / "glyph_outline_style_diffusers.safetensors"
EMBEDDED_DIR = MODELS_DIR / "embedded"
CODEC = EMBEDDED_DIR / "tiny_codec.safetensors"
TEXT_ENCODER = EMBEDDED_DIR / "tiny_text_encoder.safetensors"
JUDGE = EMBEDDED_DIR / "glyph_judge.safetensors"

COMMITTED = (BASE_MODEL, STYLE_LORA, DISTILLED_LORA, STYLE_LORA_DIFFUSERS, CODEC, TEXT_ENCODER, JUDGE)


def require_committed_weights() -> None:
    """Raise FileNotFoundError naming the committed weight files this checkout lacks (they are
    part of the repository: a checkout without them is broken, not a smaller configuration)."""
    missing = [str(p.relative_to(PACK_ROOT)) for p in COMMITTED if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"the embedded model's committed files are missing: {', '.join(missing)}; "
                                "restore them from the repository (git checkout -- standalone/models)")


# Sampler settings the embedded model is checked with (tests, model card).
DEFAULT_STEPS = 20
DEFAULT_CFG = 5.0
DEFAULT_SAMPLER = "euler"
DEFAULT_SCHEDULER = "simple"
DEFAULT_SHIFT = 8.0
