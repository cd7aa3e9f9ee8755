"""Key normalisation for the LoRA dialects people actually have.

A file key is split into a *stem* (the module it targets, in the file's naming) and
a *part* (down, up, alpha, dora, diff, diff_b). Stems are then resolved against the
model's module names by `candidate_names`:

- kohya / ComfyUI: ``lora_unet_<path_with_underscores>.lora_down.weight`` /
  ``.lora_up.weight`` / ``.alpha`` and ``diffusion_model.<path>.lora_down.weight``;
  musubi-tuner writes this form for Wan;
- PEFT / diffusers: ``.lora_A.weight`` / ``.lora_B.weight``, named slots
  (``.lora_A.default.weight``), prefixes ``base_model.model.``, ``transformer.``,
  ``diffusion_model.`` (diffusion-pipe), ``lora_magnitude_vector`` (DoRA);
- diffusers-named Wan (ai-toolkit, diffusers trainers): ``blocks.N.attn1.to_q`` ->
  ``blocks.N.self_attn.q``, ``ffn.net.0.proj`` -> ``ffn.0`` and the rest of
  `WAN_DIFFUSERS_TO_NATIVE`;
- full deltas ``.diff`` (a weight delta) and ``.diff_b`` (an output offset or a bias
  delta), ``.diff_m`` (a delta of a bare parameter, e.g. Wan's ``modulation``),
  ``.w_norm`` / ``.b_norm`` (norm weight / bias deltas), DoRA ``.dora_scale``;
- LyCORIS LoHa (``hada_w1_a`` ... ``hada_t2``) and LoKr (``lokr_w1`` ... ``lokr_t2``);
- VideoX-Fun's kohya variant with a doubled underscore (``lora_unet__blocks_0_...``).

`guess_family` names the model family a set of stems looks like, for the error when
an adapter for another model is put on this one.
"""
from __future__ import annotations

import re

# (suffix, part); longest first. A "{slot}" group captures PEFT's adapter name.
_SUFFIXES: list[tuple[re.Pattern, str]] = [
    (re.compile(r"\.lora_down\.weight$"), "down"),
    (re.compile(r"\.lora_up\.weight$"), "up"),
    (re.compile(r"\.lora\.down\.weight$"), "down"),
    (re.compile(r"\.lora\.up\.weight$"), "up"),
    (re.compile(r"\.lora_linear_layer\.down\.weight$"), "down"),
    (re.compile(r"\.lora_linear_layer\.up\.weight$"), "up"),
    (re.compile(r"\.lora_A(?:\.(?P<slot>[A-Za-z0-9_\-]+))?\.weight$"), "down"),
    (re.compile(r"\.lora_B(?:\.(?P<slot>[A-Za-z0-9_\-]+))?\.weight$"), "up"),
    (re.compile(r"\.lora_magnitude_vector(?:\.(?P<slot>[A-Za-z0-9_\-]+))?(?:\.weight)?$"), "dora"),
    (re.compile(r"\.dora_scale$"), "dora"),
    (re.compile(r"\.alpha$"), "alpha"),
    (re.compile(r"\.diff_b$"), "diff_b"),
    (re.compile(r"\.diff_m$"), "diff_m"),
    (re.compile(r"\.diff$"), "diff"),
    (re.compile(r"\.w_norm$"), "w_norm"),
    (re.compile(r"\.b_norm$"), "b_norm"),
    # LyCORIS LoHa / LoKr factors: the part is the key's own name (see variants.detect)
    (re.compile(r"\.(?P<name>hada_w[12]_[ab]|hada_t[12]|lokr_w[12](?:_[ab])?|lokr_t2)$"), "{name}"),
    # recognised so the error names them (variants.detect refuses them with the reason)
    (re.compile(r"\.(?P<name>lora_mid\.weight|oft_blocks|oft_diag|rescale|set_weight|reshape_weight)$"), "{name}"),
]

# Prefixes trainers put in front of the module path; stripped repeatedly.
_PREFIXES = (
    "base_model.model.",
    "model.diffusion_model.",
    "diffusion_model.",
    "transformer.",
    "unet.",
)
# kohya-style prefixes: the rest of the stem uses '_' where the model uses '.'.
_UNDERSCORE_PREFIXES = ("lora_unet_", "lora_transformer_", "lycoris_", "lora_te_")

# diffusers' Wan module names -> Wan 2.1 (ComfyUI / original) module names.
WAN_DIFFUSERS_TO_NATIVE: list[tuple[re.Pattern, str]] = [
    (re.compile(r"\.attn1\.to_q$"), ".self_attn.q"),
    (re.compile(r"\.attn1\.to_k$"), ".self_attn.k"),
    (re.compile(r"\.attn1\.to_v$"), ".self_attn.v"),
    (re.compile(r"\.attn1\.to_out\.0$"), ".self_attn.o"),
    (re.compile(r"\.attn2\.to_q$"), ".cross_attn.q"),
    (re.compile(r"\.attn2\.to_k$"), ".cross_attn.k"),
    (re.compile(r"\.attn2\.to_v$"), ".cross_attn.v"),
    (re.compile(r"\.attn2\.to_out\.0$"), ".cross_attn.o"),
    (re.compile(r"\.attn2\.add_k_proj$"), ".cross_attn.k_img"),
    (re.compile(r"\.attn2\.add_v_proj$"), ".cross_attn.v_img"),
    (re.compile(r"\.ffn\.net\.0\.proj$"), ".ffn.0"),
    (re.compile(r"\.ffn\.net\.2$"), ".ffn.2"),
    (re.compile(r"^condition_embedder\.time_embedder\.linear_1$"), "time_embedding.0"),
    (re.compile(r"^condition_embedder\.time_embedder\.linear_2$"), "time_embedding.2"),
    (re.compile(r"^condition_embedder\.time_proj$"), "time_projection.1"),
    (re.compile(r"^condition_embedder\.text_embedder\.linear_1$"), "text_embedding.0"),
    (re.compile(r"^condition_embedder\.text_embedder\.linear_2$"), "text_embedding.2"),
    (re.compile(r"^proj_out$"), "head.head"),
]


def split_key(key: str) -> tuple[str, str, str | None] | None:
    """Split a file key into (stem, part, slot) or None when no known part suffix fits."""
    for pattern, part in _SUFFIXES:
        m = pattern.search(key)
        if m:
            groups = m.groupdict()
            if part == "{name}":
                part = groups["name"]
            return key[: m.start()], part, groups.get("slot")
    return None


def strip_prefixes(stem: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if stem.startswith(prefix):
                stem = stem[len(prefix):]
                changed = True
    return stem


def candidate_names(stem: str, by_underscore: dict[str, str]) -> list[str]:
    """Module names (in the model's naming) a stem may refer to, most literal first."""
    s = strip_prefixes(stem)
    for prefix in _UNDERSCORE_PREFIXES:
        if s.startswith(prefix):
            flat = s[len(prefix):].lstrip("_")  # VideoX-Fun writes lora_unet__blocks_0_...
            return [by_underscore[flat]] if flat in by_underscore else []
    out = [s]
    for pattern, repl in WAN_DIFFUSERS_TO_NATIVE:
        t = pattern.sub(repl, s)
        if t != s:
            out.append(t)
    if s.startswith("model."):  # a bare "model." prefix, tried last
        out.append(s[len("model."):])
    # a dotted path written with underscores but without a kohya prefix
    if "." not in s and s in by_underscore:
        out.append(by_underscore[s])
    return out


# (family, patterns any of which marks it); checked in this order
_FAMILIES: list[tuple[str, tuple[str, ...]]] = [
    ("Flux", ("double_blocks", "single_blocks", "single_transformer_blocks", "img_attn", "txt_attn")),
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
