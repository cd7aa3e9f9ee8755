"""Key parts: how a file key splits into the module it targets and the tensor's role.

A key is a *stem* (the module it targets, in the file's naming; `dialects` resolves it
against the model) and a *part*:

- LoRA down/up: kohya/ComfyUI ``.lora_down.weight`` / ``.lora_up.weight``, PEFT /
  diffusers ``.lora_A.weight`` / ``.lora_B.weight`` (named slots ``.lora_A.default.weight``),
  ``.lora.down.weight``, ``.lora_linear_layer.down.weight``, XLabs ``*_lora1.down.weight``;
- ``.alpha``; DoRA ``.dora_scale`` / ``.lora_magnitude_vector``;
- full deltas ``.diff`` (a weight delta) and ``.diff_b`` (an output offset or a bias
  delta; also PEFT's ``.lora_B.bias``), ``.diff_m`` (a delta of a bare parameter, e.g.
  Wan's ``modulation``), ``.w_norm`` / ``.b_norm`` (norm weight / bias deltas);
- LyCORIS LoHa (``hada_w1_a`` ... ``hada_t2``) and LoKr (``lokr_w1`` ... ``lokr_t2``);
- ``lora_mid`` (LoCon Tucker core; `LoRA.to_matrices` folds it into the down factor at load);
- recognised only to be refused by name: OFT, ``set_weight``, ``reshape_weight``.

The endings come from the registered update types (`updates.registry.file_keys`: each type's
``FILE_KEYS``, then the parts every layer may carry, parameter deltas and refused parts).

`guess_family` names the model family a set of stems looks like, for the error when
an adapter for another model is put on this one.
"""
from __future__ import annotations

from ..updates.registry import file_keys


def split_key(key: str) -> tuple[str, str, str | None] | None:
    """Split a file key into (stem, part, slot) or None when no known part suffix fits."""
    for pattern, part in file_keys():
        m = pattern.search(key)
        if m:
            groups = m.groupdict()
            if part == "{name}":
                part = groups["name"]
            return key[: m.start()], part, groups.get("slot")
    return None


# (family, patterns any of which marks it); checked in this order
_FAMILIES: list[tuple[str, tuple[str, ...]]] = [
    # before Flux: HunyuanVideo's original names (diffusion-pipe, musubi-tuner), its token refiner
    # (dotted img_attn_qkv only: kohya's Flux names write img_attn.qkv as _img_attn_qkv)
    ("HunyuanVideo", (".img_attn_qkv", ".txt_attn_qkv", ".img_attn_proj", ".txt_attn_proj", "img_mod.linear",
                      "img_mod_linear", "txt_mod.linear", "txt_mod_linear", "img_mlp.fc", "img_mlp_fc",
                      "txt_mlp.fc", "txt_mlp_fc", "individual_token_refiner")),
    ("Flux", ("double_blocks", "single_blocks", "single_transformer_blocks", "img_attn", "txt_attn")),
    # before Wan ("ffn" is in ffn_norm1): Z-Image / Lumina2 (NextDiT) names, native and diffusers
    ("Z-Image", ("noise_refiner", "context_refiner", "feed_forward", "attention.qkv", "attention_qkv",
                 "attention.to_", "attention_to_", "all_x_embedder", "all_final_layer", "cap_embedder")),
    ("Qwen-Image", ("img_mlp", "txt_mlp", "img_mod", "txt_mod")),
    ("LTX-Video", ("scale_shift_table", "adaln_single", "caption_projection")),
    ("Wan", ("self_attn", "cross_attn", "attn1", "attn2", "ffn")),
    ("a UNet (SD/SDXL)", ("input_blocks", "output_blocks", "down_blocks", "up_blocks", "mid_block")),
    ("a text encoder", ("lora_te", "text_model", "text_encoder", "encoder_layers")),
]


def guess_family(stems) -> str | None:
    """The model family most of these adapter stems name, or None."""
    votes: dict[str, int] = {}
    for stem in stems:
        low = stem.lower()
        for family, marks in _FAMILIES:
            if any(m in low for m in marks):
                votes[family] = votes.get(family, 0) + 1
                break
    return max(votes, key=votes.get) if votes else None
