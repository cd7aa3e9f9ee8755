"""Key dialects: where an adapter key's stem goes in a ComfyUI diffusion model.

Contract
--------
``resolve(stem, modules, *, prefer=None) -> Target | None``

- ``stem``: a file key with its part suffix removed (``key_formats.split_key``), e.g. ``transformer.transformer_blocks.0.attn.to_q``,
  ``lora_unet_double_blocks_0_img_attn_qkv``, ``double_blocks.0.processor.qkv_lora1``.
- ``modules``: ``dict(model.named_modules())`` of the diffusion model itself (what
  ComfyUI calls ``model.diffusion_model``: names like ``double_blocks.0.img_attn.qkv``).
- returns a `Target` naming the native module (or a bare parameter, ``param=True``),
  the slice of its weight's OUTPUT rows the adapter's delta covers (``rows``,
  ``[start, stop)``; ``None`` = the whole weight; a ``diff_b`` bias delta covers the
  same rows of the bias) and the dialect the stem is written in; ``None`` when the
  stem names nothing in this model (another family, a block index the model lacks, a
  typo) or names it ambiguously.
- ``swap_halves=True``: the adapter's output rows are the target rows in the other
  half order (diffusers' ``norm_out.linear`` is ``[scale, shift]``, BFL's
  ``final_layer.adaLN_modulation.1`` is ``[shift, scale]``). The caller applies the delta
  with its two row halves exchanged: ``up_native = torch.cat([up[n//2:], up[:n//2]])``
  (same for a ``diff``/``diff_b``). ``rows`` and ``swap_halves`` never come together.
- the module may be anything (Linear, Conv3d, LayerNorm, RMSNorm): the caller decides
  what it can apply. ``param=True``: ``module`` is the dotted name of an
  ``nn.Parameter`` (Wan ``blocks.0.modulation``), not of a module.
- ``prefer``: a naming (``"native"``, ``"diffusers"``) that wins where a name means
  different modules in two namings (Wan diffusers ``blocks.N.norm2`` is native
  ``norm3``). `resolve_all` decides it once per file; use it for whole files.

``resolve_all(stems, modules) -> dict[stem, Target | None]``: one file's stems, in
the naming the file as a whole uses. ``dialect_name(stems, modules=None) -> str``: the
dialect most of the stems are written in (from the same `DIALECTS` table that
`resolve` labels targets with); never ``"unknown"`` when a stem resolved.
``guess_family`` is re-exported from ``key_formats`` unchanged.

For the loader: split keys with `split_key` (``key_formats``; it also knows XLabs'
``*_lora1.down.weight`` and PEFT's ``.lora_B.bias``), group them by stem, call
`resolve_all` once per file, check ``up`` has ``rows[1] - rows[0]`` rows (the module's
out_features when ``rows`` is None) and ``down`` the module's in_features, refuse
what `overlaps` returns (two stems on the same rows), and report `dialect_name` as the
file's format. Pass the diffusion model's own modules (names without
``diffusion_model.``); a Target may name a non-Linear (container, norm, conv).

How a stem is read: outer prefixes (``base_model.model.``, ``model.diffusion_model.``,
``diffusion_model.``, ``transformer.``, ``unet.``; and a bare ``model.`` as a last
resort) are stripped, or a kohya-style prefix (``lora_unet_``, VideoX-Fun's
``lora_unet__``, ``lora_transformer_`` (OneTrainer), ``lycoris_`` (SimpleTuner),
``lora_te_``) marks a name whose dots are written as underscores. The rest is looked
up among (a) the model's own module / parameter names, (b) the names the same modules
have in other namings, generated from the family tables below for the modules this
model actually has (with their row slices computed from the module's weight shape).

Where the facts come from (facts only; no code is shared with these projects):

- Flux: ComfyUI ``comfy/utils.py`` ``flux_to_diffusers`` (diffusers names, qkv thirds,
  ``proj_mlp`` rows ``[3h, 3h+mlp)``, ``norm_out.linear`` with ``swap_scale_shift``,
  LyCORIS ``ff.linear_in``, Flux 2 ``to_qkv_mlp_proj``/``to_out``); Flux 2's other
  diffusers names (``time_guidance_embed.*``, the shared ``double_stream_modulation_img/txt``
  and ``single_stream_modulation`` ``.linear`` = native ``.lin``) from diffusers
  ``scripts/convert_flux2_to_diffusers.py`` and ``Flux2Transformer2DModel``; and
  ``comfy/lora.py`` ``model_lora_keys_unet`` (prefixes ``transformer.``,
  ``lycoris_``, ``lora_transformer_``, bare diffusers names (DiffSynth), native
  ``lora_unet_`` / ``diffusion_model.``, ``linear1_qkv`` = ``linear1`` rows ``[0, 3h)``);
  ``comfy/lora_convert.py`` ``convert_uso_lora`` (XLabs ``processor.qkv_lora1/2``,
  ``proj_lora1/2``, single-block ``qkv_lora`` -> ``linear1_qkv``, ``proj_lora`` ->
  ``linear2``, ``.down/.up.weight``); diffusers
  ``loaders/lora_conversion_utils.py`` ``_convert_kohya_flux_lora_to_diffusers``
  (kohya ``lora_unet_double_blocks_N_img_attn_qkv`` and friends, OneTrainer
  ``lora_transformer_*``), ``_convert_xlabs_flux_lora_to_diffusers``,
  ``_convert_bfl_flux_control_lora_to_diffusers`` (``.lora_B.bias``); native module
  names and shapes from ``comfy/ldm/flux/model.py`` and ``layers.py``.
- Qwen-Image: ``comfy/ldm/qwen_image/model.py`` (ComfyUI's model already uses
  diffusers' names: ``transformer_blocks.N.attn.to_q``, ``img_mod.1``,
  ``img_mlp.net.0.proj``, ``norm_out.linear`` in diffusers' [scale, shift] order);
  ``model_lora_keys_unet`` (bare, ``transformer.``, ``lycoris_`` keys).
- LTX-Video: ``comfy/ldm/lightricks/model.py`` (native names); diffusers
  ``scripts/convert_ltx_to_diffusers.py`` ``TRANSFORMER_KEYS_RENAME_DICT``
  (``patchify_proj`` -> ``proj_in``, ``adaln_single`` -> ``time_embed``, ``q_norm``
  -> ``norm_q``, ``k_norm`` -> ``norm_k``).
- Wan: diffusers ``scripts/convert_wan_to_diffusers.py``
  ``TRANSFORMER_KEYS_RENAME_DICT`` (``modulation`` -> ``scale_shift_table``,
  ``head.modulation`` -> ``scale_shift_table``, native ``norm3`` <-> diffusers
  ``norm2``, ``img_emb.proj.N`` -> ``condition_embedder.image_embedder.*``);
  ``comfy/lora_convert.py`` ``convert_lora_wan_fun`` (``lora_unet__``).
- Z-Image (ComfyUI's ``Lumina2`` class, ``NextDiT``): ``comfy/utils.py``
  ``z_image_to_diffusers`` (``attention.to_q/to_k/to_v`` = rows ``[0, h)``, ``[h, 2h)``,
  ``[2h, 3h)`` of ``attention.qkv`` with h = the model's dim, ``to_out.0`` = ``out``,
  ``norm_q/norm_k`` = ``q_norm/k_norm``, ``all_x_embedder.2-1`` = ``x_embedder``,
  ``all_final_layer.2-1.*`` = ``final_layer.*``) and ``model_lora_keys_unet`` (those names
  under ``diffusion_model.``, ``transformer.``, ``lycoris_`` and bare); native names from
  ``comfy/ldm/lumina/model.py``.
- HunyuanVideo (1.0 and 1.5; ComfyUI builds it from Flux's blocks, so its native names are
  Flux's): ``model_lora_keys_unet`` (diffusion-pipe / the original release's names:
  ``_mod.lin`` -> ``_mod.linear``, ``_attn.qkv`` -> ``_attn_qkv``, ``_attn.proj`` ->
  ``_attn_proj``, ``mlp.0/2`` -> ``mlp.fc1/fc2``, ``modulation.lin`` -> ``modulation.linear``,
  under ``transformer.`` and ``diffusion_model.``); ``comfy/ldm/hunyuan_video/model.py``.
- Chroma (a Flux without per-block modulation): diffusers ``ChromaApproximator``
  (``distilled_guidance_layer.layers.N.linear_1/linear_2`` = ComfyUI's ``MLPEmbedder``
  ``in_layer/out_layer``; ``in_proj``/``out_proj`` the same in both); ComfyUI's key map has
  no name for these, so inside ComfyUI they are placed by this table alone.

Inside ComfyUI these tables come second: `lora_runtime.files.host_keys` reads ComfyUI's own
key map (``model_lora_keys_unet`` of the model at hand, at run time) and its targets win;
the tables place what that map does not know, and tell the family when the host gives none.

Refused (resolve returns None; see DIALECTS.md): adapters that target a FUSED
projection the model holds split (Qwen-Image ``attn.to_qkv`` / ``to_added_qkv``): the
adapter's rows would have to be split over several modules, which a `Target` cannot
say; BFL "control" LoRAs that widen ``img_in`` (``reshape_weight``).
"""
from __future__ import annotations

import re
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch
from torch import nn

from .key_formats import guess_family, split_key  # noqa: F401  (re-exported for the loader)

__all__ = ["Target", "Dialect", "DIALECTS", "resolve", "resolve_all", "dialect_name", "split_key",
           "model_family", "guess_family", "overlaps"]


@dataclass(frozen=True)
class Target:
    module: str                          # ComfyUI native module (or parameter) name
    rows: tuple[int, int] | None         # output-row slice [start, stop) of its weight; None = whole
    dialect: str                         # DIALECTS name, e.g. "Flux diffusers"
    param: bool = False                  # module names an nn.Parameter, not a module
    swap_halves: bool = False            # adapter rows are the target's halves exchanged


@dataclass(frozen=True)
class Dialect:
    name: str
    family: str | None                   # None: any model (names used literally)
    naming: str                          # "native", "diffusers", "xlabs"
    prefixes: tuple[str, ...]            # prefix kinds this dialect writes ("" = none)
    example: str                         # one stem, as written in a file
    how: str                             # what resolve does with it (for DIALECTS.md)


# --- stems: prefixes -------------------------------------------------------------

_DOTTED_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.", "unet.")
_UNDERSCORE_PREFIXES = ("lora_unet__", "lora_unet_", "lora_transformer_", "lycoris_", "lora_te_")
_NATIVE_DOTTED = ("", "diffusion_model.", "model.diffusion_model.")
_ANY_DOTTED = ("", "diffusion_model.", "model.diffusion_model.", "transformer.", "base_model.model.", "unet.", "model.")


def _split_prefix(stem: str) -> tuple[str, str, bool]:
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


# --- family tables -----------------------------------------------------------------
# A row: native module name (regex, fullmatch; groups are block indices) -> its names in
# other namings: (naming, template with {0},{1}.. for the groups, rows rule).
# rows rules take the native weight's shape [out, in, ...] and give (start, stop) or None
# (whole), or "swap" (whole, halves exchanged); a rule that does not fit the shape
# yields no name at all.

RowsRule = Callable[[tuple[int, ...]], object]


def _whole(shape):
    return None


def _swap(shape):
    return "swap" if shape[0] % 2 == 0 else False


def _third(i: int) -> RowsRule:
    def rule(shape):
        out = shape[0]
        if out % 3:
            return False
        return (i * out // 3, (i + 1) * out // 3)
    return rule


def _linear1(i: int) -> RowsRule:
    """Flux single block linear1 = [q | k | v | mlp], q/k/v hidden rows each; hidden =
    in_features (flux_to_diffusers: (0, 0, h), (0, h, h), (0, 2h, h), (0, 3h, 4h))."""
    def rule(shape):
        out, h = shape[0], shape[1]
        if out <= 3 * h:
            return False
        return (i * h, (i + 1) * h) if i < 3 else (3 * h, out)
    return rule


def _qkv_part(i: int) -> RowsRule:
    """Z-Image ``attention.qkv`` = [q | k | v], each ``dim`` rows (dim = in_features), as
    z_image_to_diffusers slices it; a grouped-query qkv (out != 3 * dim) has no such thirds."""
    def rule(shape):
        out, h = shape[0], shape[1]
        if out != 3 * h:
            return False
        return (i * h, (i + 1) * h)
    return rule


def _linear1_qkv(shape):
    out, h = shape[0], shape[1]
    return (0, 3 * h) if out > 3 * h else False


D, X, N = "diffusers", "xlabs", "native"
P = "diffusion-pipe"   # HunyuanVideo's original-release names (diffusion-pipe, musubi-tuner)
A = "ai-toolkit"   # names only ai-toolkit's old LoKr files have (native and diffusers mixed)
_B = r"(\d+)"

FLUX_TABLE: list[tuple[str, list[tuple[str, str, RowsRule]]]] = [
    (rf"double_blocks\.{_B}\.img_attn\.qkv", [
        (D, "transformer_blocks.{0}.attn.to_q", _third(0)),
        (D, "transformer_blocks.{0}.attn.to_k", _third(1)),
        (D, "transformer_blocks.{0}.attn.to_v", _third(2)),
        (X, "double_blocks.{0}.processor.qkv_lora1", _whole)]),
    (rf"double_blocks\.{_B}\.txt_attn\.qkv", [
        (D, "transformer_blocks.{0}.attn.add_q_proj", _third(0)),
        (D, "transformer_blocks.{0}.attn.add_k_proj", _third(1)),
        (D, "transformer_blocks.{0}.attn.add_v_proj", _third(2)),
        (X, "double_blocks.{0}.processor.qkv_lora2", _whole)]),
    (rf"double_blocks\.{_B}\.img_attn\.proj", [
        (D, "transformer_blocks.{0}.attn.to_out.0", _whole),
        (X, "double_blocks.{0}.processor.proj_lora1", _whole)]),
    (rf"double_blocks\.{_B}\.txt_attn\.proj", [
        (D, "transformer_blocks.{0}.attn.to_add_out", _whole),
        (X, "double_blocks.{0}.processor.proj_lora2", _whole)]),
    (rf"double_blocks\.{_B}\.img_mod\.lin", [(D, "transformer_blocks.{0}.norm1.linear", _whole)]),
    (rf"double_blocks\.{_B}\.txt_mod\.lin", [(D, "transformer_blocks.{0}.norm1_context.linear", _whole)]),
    (rf"double_blocks\.{_B}\.img_mlp\.0", [(D, "transformer_blocks.{0}.ff.net.0.proj", _whole),
                                           (D, "transformer_blocks.{0}.ff.linear_in", _whole)]),
    (rf"double_blocks\.{_B}\.img_mlp\.2", [(D, "transformer_blocks.{0}.ff.net.2", _whole),
                                           (D, "transformer_blocks.{0}.ff.linear_out", _whole)]),
    (rf"double_blocks\.{_B}\.txt_mlp\.0", [(D, "transformer_blocks.{0}.ff_context.net.0.proj", _whole),
                                           (D, "transformer_blocks.{0}.ff_context.linear_in", _whole)]),
    (rf"double_blocks\.{_B}\.txt_mlp\.2", [(D, "transformer_blocks.{0}.ff_context.net.2", _whole),
                                           (D, "transformer_blocks.{0}.ff_context.linear_out", _whole)]),
    (rf"double_blocks\.{_B}\.img_attn\.norm\.query_norm", [(D, "transformer_blocks.{0}.attn.norm_q", _whole)]),
    (rf"double_blocks\.{_B}\.img_attn\.norm\.key_norm", [(D, "transformer_blocks.{0}.attn.norm_k", _whole)]),
    (rf"double_blocks\.{_B}\.txt_attn\.norm\.query_norm", [(D, "transformer_blocks.{0}.attn.norm_added_q", _whole)]),
    (rf"double_blocks\.{_B}\.txt_attn\.norm\.key_norm", [(D, "transformer_blocks.{0}.attn.norm_added_k", _whole)]),
    (rf"single_blocks\.{_B}\.linear1", [
        (D, "single_transformer_blocks.{0}.attn.to_q", _linear1(0)),
        (D, "single_transformer_blocks.{0}.attn.to_k", _linear1(1)),
        (D, "single_transformer_blocks.{0}.attn.to_v", _linear1(2)),
        (D, "single_transformer_blocks.{0}.proj_mlp", _linear1(3)),
        (D, "single_transformer_blocks.{0}.attn.to_qkv_mlp_proj", _whole),   # Flux 2
        (N, "single_blocks.{0}.linear1_qkv", _linear1_qkv),                  # ComfyUI's own key
        (X, "single_blocks.{0}.processor.qkv_lora", _linear1_qkv)]),
    (rf"single_blocks\.{_B}\.linear2", [
        (D, "single_transformer_blocks.{0}.proj_out", _whole),
        (D, "single_transformer_blocks.{0}.attn.to_out", _whole),            # Flux 2
        (X, "single_blocks.{0}.processor.proj_lora", _whole)]),
    (rf"single_blocks\.{_B}\.modulation\.lin", [(D, "single_transformer_blocks.{0}.norm.linear", _whole)]),
    (rf"single_blocks\.{_B}\.norm\.query_norm", [(D, "single_transformer_blocks.{0}.attn.norm_q", _whole)]),
    (rf"single_blocks\.{_B}\.norm\.key_norm", [(D, "single_transformer_blocks.{0}.attn.norm_k", _whole)]),
    (r"img_in", [(D, "x_embedder", _whole)]),
    (r"txt_in", [(D, "context_embedder", _whole)]),
    (r"time_in\.in_layer", [(D, "time_text_embed.timestep_embedder.linear_1", _whole),
                             (D, "time_guidance_embed.timestep_embedder.linear_1", _whole)]),  # Flux 2
    (r"time_in\.out_layer", [(D, "time_text_embed.timestep_embedder.linear_2", _whole),
                              (D, "time_guidance_embed.timestep_embedder.linear_2", _whole)]),
    (r"vector_in\.in_layer", [(D, "time_text_embed.text_embedder.linear_1", _whole)]),
    (r"vector_in\.out_layer", [(D, "time_text_embed.text_embedder.linear_2", _whole)]),
    (r"guidance_in\.in_layer", [(D, "time_text_embed.guidance_embedder.linear_1", _whole),
                                 (D, "time_guidance_embed.guidance_embedder.linear_1", _whole)]),
    (r"guidance_in\.out_layer", [(D, "time_text_embed.guidance_embedder.linear_2", _whole),
                                  (D, "time_guidance_embed.guidance_embedder.linear_2", _whole)]),
    # Flux 2: one modulation per stream for all blocks (same [shift, scale, gate] row order in both namings)
    (r"double_stream_modulation_img\.lin", [(D, "double_stream_modulation_img.linear", _whole)]),
    (r"double_stream_modulation_txt\.lin", [(D, "double_stream_modulation_txt.linear", _whole)]),
    (r"single_stream_modulation\.lin", [(D, "single_stream_modulation.linear", _whole)]),
    (r"final_layer\.linear", [(D, "proj_out", _whole)]),
    (r"final_layer\.adaLN_modulation\.1", [(D, "norm_out.linear", _swap)]),
    # Chroma's approximator: diffusers' PixArtAlphaTextProjection layers = ComfyUI's MLPEmbedder
    (rf"distilled_guidance_layer\.layers\.{_B}\.in_layer", [(D, "distilled_guidance_layer.layers.{0}.linear_1", _whole)]),
    (rf"distilled_guidance_layer\.layers\.{_B}\.out_layer", [(D, "distilled_guidance_layer.layers.{0}.linear_2", _whole)]),
    (r"distilled_guidance_layer\.(?:in_proj|out_proj)", []),
]

# ComfyUI's Qwen-Image already uses diffusers' names: no renames, only these natives.
QWEN_TABLE: list[tuple[str, list]] = [
    (rf"transformer_blocks\.{_B}\.attn\.(?:to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|to_out\.0|to_add_out"
     r"|norm_q|norm_k|norm_added_q|norm_added_k)", []),
    (rf"transformer_blocks\.{_B}\.(?:img|txt)_mod\.1", []),
    (rf"transformer_blocks\.{_B}\.(?:img|txt)_mlp\.net\.(?:0\.proj|2)", []),
    (r"img_in|txt_in|txt_norm|proj_out|norm_out\.linear|time_text_embed\.timestep_embedder\.linear_[12]", []),
]

LTX_TABLE: list[tuple[str, list]] = [
    (r"patchify_proj", [(D, "proj_in", _whole)]),
    (r"adaln_single\.linear", [(D, "time_embed.linear", _whole)]),
    (r"adaln_single\.emb\.timestep_embedder\.linear_1", [(D, "time_embed.emb.timestep_embedder.linear_1", _whole)]),
    (r"adaln_single\.emb\.timestep_embedder\.linear_2", [(D, "time_embed.emb.timestep_embedder.linear_2", _whole)]),
    (rf"transformer_blocks\.{_B}\.(attn[12])\.q_norm", [(D, "transformer_blocks.{0}.{1}.norm_q", _whole)]),
    (rf"transformer_blocks\.{_B}\.(attn[12])\.k_norm", [(D, "transformer_blocks.{0}.{1}.norm_k", _whole)]),
    # same name in both namings
    (rf"transformer_blocks\.{_B}\.attn[12]\.(?:to_q|to_k|to_v|to_out\.0)", []),
    (rf"transformer_blocks\.{_B}\.ff\.net\.(?:0\.proj|2)", []),
    (rf"transformer_blocks\.{_B}\.scale_shift_table", []),
    (r"caption_projection\.linear_[12]|proj_out|norm_out|scale_shift_table", []),
]

WAN_TABLE: list[tuple[str, list]] = [
    (rf"blocks\.{_B}\.self_attn\.q", [(D, "blocks.{0}.attn1.to_q", _whole)]),
    (rf"blocks\.{_B}\.self_attn\.k", [(D, "blocks.{0}.attn1.to_k", _whole)]),
    (rf"blocks\.{_B}\.self_attn\.v", [(D, "blocks.{0}.attn1.to_v", _whole)]),
    (rf"blocks\.{_B}\.self_attn\.o", [(D, "blocks.{0}.attn1.to_out.0", _whole),
                                        (A, "blocks.{0}.self_attn.to_out.0", _whole)]),
    (rf"blocks\.{_B}\.self_attn\.norm_q", [(D, "blocks.{0}.attn1.norm_q", _whole)]),
    (rf"blocks\.{_B}\.self_attn\.norm_k", [(D, "blocks.{0}.attn1.norm_k", _whole)]),
    (rf"blocks\.{_B}\.cross_attn\.q", [(D, "blocks.{0}.attn2.to_q", _whole)]),
    (rf"blocks\.{_B}\.cross_attn\.k", [(D, "blocks.{0}.attn2.to_k", _whole)]),
    (rf"blocks\.{_B}\.cross_attn\.v", [(D, "blocks.{0}.attn2.to_v", _whole)]),
    (rf"blocks\.{_B}\.cross_attn\.o", [(D, "blocks.{0}.attn2.to_out.0", _whole),
                                         (A, "blocks.{0}.cross_attn.to_out.0", _whole)]),
    (rf"blocks\.{_B}\.cross_attn\.norm_q", [(D, "blocks.{0}.attn2.norm_q", _whole)]),
    (rf"blocks\.{_B}\.cross_attn\.norm_k", [(D, "blocks.{0}.attn2.norm_k", _whole)]),
    (rf"blocks\.{_B}\.cross_attn\.k_img", [(D, "blocks.{0}.attn2.add_k_proj", _whole)]),
    (rf"blocks\.{_B}\.cross_attn\.v_img", [(D, "blocks.{0}.attn2.add_v_proj", _whole)]),
    (rf"blocks\.{_B}\.cross_attn\.norm_k_img", [(D, "blocks.{0}.attn2.norm_added_k", _whole)]),
    (rf"blocks\.{_B}\.ffn\.0", [(D, "blocks.{0}.ffn.net.0.proj", _whole)]),
    (rf"blocks\.{_B}\.ffn\.2", [(D, "blocks.{0}.ffn.net.2", _whole)]),
    (rf"blocks\.{_B}\.norm3", [(D, "blocks.{0}.norm2", _whole)]),     # diffusers swaps norm2/norm3
    (rf"blocks\.{_B}\.norm2", [(D, "blocks.{0}.norm3", _whole)]),
    (rf"blocks\.{_B}\.modulation", [(D, "blocks.{0}.scale_shift_table", _whole)]),
    (r"head\.modulation", [(D, "scale_shift_table", _whole)]),
    (r"head\.head", [(D, "proj_out", _whole)]),
    (r"time_embedding\.0", [(D, "condition_embedder.time_embedder.linear_1", _whole)]),
    (r"time_embedding\.2", [(D, "condition_embedder.time_embedder.linear_2", _whole)]),
    (r"time_projection\.1", [(D, "condition_embedder.time_proj", _whole)]),
    (r"text_embedding\.0", [(D, "condition_embedder.text_embedder.linear_1", _whole)]),
    (r"text_embedding\.2", [(D, "condition_embedder.text_embedder.linear_2", _whole)]),
    (r"img_emb\.proj\.0", [(D, "condition_embedder.image_embedder.norm1", _whole)]),
    (r"img_emb\.proj\.1", [(D, "condition_embedder.image_embedder.ff.net.0.proj", _whole)]),
    (r"img_emb\.proj\.3", [(D, "condition_embedder.image_embedder.ff.net.2", _whole)]),
    (r"img_emb\.proj\.4", [(D, "condition_embedder.image_embedder.norm2", _whole)]),
    (r"patch_embedding", []),
]

_ZB = r"(layers|noise_refiner|context_refiner)\.(\d+)"   # Z-Image's three block lists

ZIMAGE_TABLE: list[tuple[str, list]] = [
    (rf"{_ZB}\.attention\.qkv", [
        (D, "{0}.{1}.attention.to_q", _qkv_part(0)),
        (D, "{0}.{1}.attention.to_k", _qkv_part(1)),
        (D, "{0}.{1}.attention.to_v", _qkv_part(2))]),
    (rf"{_ZB}\.attention\.out", [(D, "{0}.{1}.attention.to_out.0", _whole)]),
    (rf"{_ZB}\.attention\.q_norm", [(D, "{0}.{1}.attention.norm_q", _whole)]),
    (rf"{_ZB}\.attention\.k_norm", [(D, "{0}.{1}.attention.norm_k", _whole)]),
    (r"x_embedder", [(D, "all_x_embedder.2-1", _whole)]),
    (r"final_layer\.linear", [(D, "all_final_layer.2-1.linear", _whole)]),
    (r"final_layer\.adaLN_modulation\.1", [(D, "all_final_layer.2-1.adaLN_modulation.1", _whole)]),
    # same name in both namings
    (rf"{_ZB}\.(?:feed_forward\.w[123]|adaLN_modulation\.0|attention_norm[12]|ffn_norm[12])", []),
    (r"cap_embedder\.[01]|t_embedder\.mlp\.[02]", []),
]

_HB = r"double_blocks\.(\d+)\.(img|txt)"
_TR = r"txt_in\.individual_token_refiner\.blocks\.(\d+)"

HUNYUAN_VIDEO_TABLE: list[tuple[str, list]] = [
    (rf"{_HB}_mod\.lin", [(P, "double_blocks.{0}.{1}_mod.linear", _whole)]),
    (rf"{_HB}_attn\.qkv", [(P, "double_blocks.{0}.{1}_attn_qkv", _whole)]),
    (rf"{_HB}_attn\.proj", [(P, "double_blocks.{0}.{1}_attn_proj", _whole)]),
    (rf"{_HB}_mlp\.0", [(P, "double_blocks.{0}.{1}_mlp.fc1", _whole)]),
    (rf"{_HB}_mlp\.2", [(P, "double_blocks.{0}.{1}_mlp.fc2", _whole)]),
    (rf"single_blocks\.{_B}\.modulation\.lin", [(P, "single_blocks.{0}.modulation.linear", _whole)]),
    (rf"{_TR}\.self_attn\.qkv", [(P, "txt_in.individual_token_refiner.blocks.{0}.self_attn_qkv", _whole)]),
    (rf"{_TR}\.self_attn\.proj", [(P, "txt_in.individual_token_refiner.blocks.{0}.self_attn_proj", _whole)]),
    (rf"{_TR}\.mlp\.0", [(P, "txt_in.individual_token_refiner.blocks.{0}.mlp.fc1", _whole)]),
    (rf"{_TR}\.mlp\.2", [(P, "txt_in.individual_token_refiner.blocks.{0}.mlp.fc2", _whole)]),
    # same name in both namings (listed so a file of them is read as HunyuanVideo's, not Flux's)
    (rf"{_HB}_attn\.norm\.(?:query|key)_norm", []),
    (rf"single_blocks\.{_B}\.(?:linear1|linear2|norm\.(?:query|key)_norm)", []),
    (r"(?:time_in|vector_in|guidance_in|time_r_in)\.(?:in|out)_layer|final_layer\.(?:linear|adaLN_modulation\.1)", []),
    (rf"{_TR}\.adaLN_modulation\.1", []),
    (r"txt_in\.(?:input_embedder|[tc]_embedder\.(?:in|out)_layer)", []),
    (r"img_in\.proj|byt5_in\.fc[123]|vision_in\.proj\.[13]", []),
]

FAMILY_TABLES: dict[str, list[tuple[str, list]]] = {
    "Flux": FLUX_TABLE, "HunyuanVideo": HUNYUAN_VIDEO_TABLE, "Z-Image": ZIMAGE_TABLE, "Qwen-Image": QWEN_TABLE,
    "LTX-Video": LTX_TABLE, "Wan": WAN_TABLE}

# module names that mark a model's family (checked in this order)
_FAMILY_MARKS: list[tuple[str, re.Pattern]] = [
    # before Flux: ComfyUI builds HunyuanVideo from Flux's double/single blocks
    ("HunyuanVideo", re.compile(r"txt_in\.individual_token_refiner\.blocks\.\d+\.self_attn\.qkv$")),
    ("Flux", re.compile(r"(double_blocks\.\d+\.img_attn\.qkv|single_blocks\.\d+\.linear1)$")),
    ("Qwen-Image", re.compile(r"transformer_blocks\.\d+\.img_mod\.1$")),
    ("LTX-Video", re.compile(r"(transformer_blocks\.\d+\.attn1\.to_q|adaln_single\.linear|patchify_proj)$")),
    ("Wan", re.compile(r"blocks\.\d+\.(self_attn|cross_attn)\.q$")),
    ("Z-Image", re.compile(r"(layers|noise_refiner)\.\d+\.attention\.qkv$")),
]

# For families whose two namings share most names, a literal name is read in the naming
# its prefix says (diffusers writes "transformer."); a bare name in the default one.
# family -> (naming of a bare name, {prefix: naming other than native})
_SHARED_NAMES: dict[str, tuple[str, dict[str, str]]] = {
    "Flux": (N, {"transformer.": D, "lora_transformer_": D, "lycoris_": D}),   # e.g. Chroma's in_proj
    "Qwen-Image": (D, {"transformer.": D, "base_model.model.": D}),
    "LTX-Video": (N, {"transformer.": D, "base_model.model.": D}),
    "Z-Image": (N, {"transformer.": D, "base_model.model.": D, "lycoris_": D}),
    "HunyuanVideo": (N, {"transformer.": P}),
}


def _shared_naming(family: str, prefix: str, prefer: str | None) -> str:
    """The naming a name both namings of `family` share is read in: the file's (``prefer``),
    else the one its prefix says (``transformer.`` = diffusers, ...; a bare name: the family's
    default; any other prefix: native)."""
    bare, by_prefix = _SHARED_NAMES[family]
    naming = prefer or (by_prefix.get(prefix, N) if prefix else bare)
    if naming != N and not any(d.family == family and d.naming == naming for d in DIALECTS):
        naming = N
    return naming

# --- the dialect table: drives the labels, DIALECTS.md and the tests ---------------

DIALECTS: list[Dialect] = [
    Dialect("Flux BFL native", "Flux", N, _NATIVE_DOTTED + ("transformer.", "base_model.model."),
            "diffusion_model.double_blocks.0.img_attn.qkv", "native name; whole module"),
    Dialect("Flux kohya", "Flux", N, ("lora_unet_",),
            "lora_unet_double_blocks_0_img_attn_qkv", "native name, '_' for '.'; whole module"),
    Dialect("Flux diffusers", "Flux", D, ("transformer.", "", "base_model.model.", "diffusion_model."),
            "transformer.transformer_blocks.0.attn.to_q",
            "diffusers/ai-toolkit/fal/DiffSynth: to_q/to_k/to_v = thirds of img_attn.qkv, add_*_proj = thirds of "
            "txt_attn.qkv, single to_q/to_k/to_v/proj_mlp = rows of linear1, norm_out.linear = "
            "final_layer.adaLN_modulation.1 with halves swapped; Chroma: distilled_guidance_layer.layers.N."
            "linear_1/linear_2 = in_layer/out_layer (ComfyUI's key map has no name for them)"),
    Dialect("Flux kohya-diffusers (OneTrainer)", "Flux", D, ("lora_transformer_", "lora_unet_"),
            "lora_transformer_single_transformer_blocks_0_proj_mlp",
            "as Flux diffusers; also kohya's SD scripts run on Flux (lora_unet_ + diffusers names, a trailing '_' "
            "ignored)"),
    Dialect("Flux LyCORIS (SimpleTuner)", "Flux", D, ("lycoris_",),
            "lycoris_transformer_blocks_0_attn_to_q", "as Flux diffusers"),
    Dialect("Flux XLabs", "Flux", X, ("", "diffusion_model."),
            "double_blocks.0.processor.qkv_lora1",
            "qkv_lora1/qkv_lora2 = whole img_attn.qkv / txt_attn.qkv, proj_lora1/2 = img/txt_attn.proj; single "
            "qkv_lora = linear1 rows [0, 3h), proj_lora = linear2"),
    Dialect("Qwen-Image diffusers", "Qwen-Image", D, ("transformer.", "", "base_model.model."),
            "transformer.transformer_blocks.0.attn.to_q", "same names as ComfyUI's model; whole module"),
    Dialect("Qwen-Image native", "Qwen-Image", N, ("diffusion_model.", "model.diffusion_model."),
            "diffusion_model.transformer_blocks.0.img_mod.1", "whole module"),
    Dialect("Qwen-Image kohya", "Qwen-Image", N, ("lora_unet_", "lora_transformer_"),
            "lora_unet_transformer_blocks_0_attn_to_q", "whole module"),
    Dialect("Qwen-Image LyCORIS (SimpleTuner)", "Qwen-Image", N, ("lycoris_",),
            "lycoris_transformer_blocks_0_img_mlp_net_0_proj", "whole module"),
    Dialect("LTX-Video native", "LTX-Video", N, _NATIVE_DOTTED,
            "diffusion_model.transformer_blocks.0.attn1.to_q", "whole module"),
    Dialect("LTX-Video diffusers", "LTX-Video", D, ("transformer.", "base_model.model.", "", "diffusion_model."),
            "transformer.transformer_blocks.0.attn1.to_q",
            "proj_in = patchify_proj, time_embed.* = adaln_single.*, norm_q/norm_k = q_norm/k_norm; whole module"),
    Dialect("LTX-Video kohya", "LTX-Video", N, ("lora_unet_",),
            "lora_unet_transformer_blocks_0_attn1_to_q", "whole module"),
    Dialect("Wan native", "Wan", N, _NATIVE_DOTTED + ("transformer.",),
            "diffusion_model.blocks.0.self_attn.q", "whole module; blocks.N.modulation is a parameter"),
    Dialect("Wan kohya", "Wan", N, ("lora_unet_", "lora_transformer_", "lycoris_"),
            "lora_unet_blocks_0_self_attn_q", "musubi-tuner; whole module"),
    Dialect("Wan VideoX-Fun", "Wan", N, ("lora_unet__",), "lora_unet__blocks_0_self_attn_q", "whole module"),
    Dialect("Wan PEFT", "Wan", N, ("base_model.model.",), "base_model.model.blocks.0.self_attn.q", "whole module"),
    Dialect("Wan ai-toolkit LoKr (old)", "Wan", A, ("lycoris_",), "lycoris_blocks_0_self_attn_to_out_0",
            "ai-toolkit's LoKr files before its new LoKr format: diffusers names written as lycoris_<name with "
            "'_'>, then its diffusers-to-native renames, which look for dotted names: attn1/attn2 -> "
            "self_attn/cross_attn and to_q/to_k/to_v/add_k_proj/add_v_proj -> q/k/v/k_img/v_img apply, "
            "to_out_0 and ffn_net_0_proj/ffn_net_2 stay; self_attn_to_out_0 = self_attn.o, cross_attn_to_out_0 = "
            "cross_attn.o; whole module. A file with these names is labelled so"),
    Dialect("Wan diffusers", "Wan", D, _ANY_DOTTED + ("lora_unet_", "lora_transformer_", "lycoris_"),
            "transformer.blocks.0.attn1.to_q",
            "attn1/attn2 -> self_attn/cross_attn, ffn.net.0.proj -> ffn.0, norm2 <-> norm3, scale_shift_table -> "
            "modulation; whole module"),
    Dialect("Z-Image native", "Z-Image", N, _NATIVE_DOTTED,
            "diffusion_model.layers.0.attention.qkv", "ComfyUI's names (Lumina2 NextDiT); whole module"),
    Dialect("Z-Image kohya", "Z-Image", N, ("lora_unet_",), "lora_unet_layers_0_attention_qkv",
            "native name, '_' for '.'; whole module"),
    Dialect("Z-Image diffusers", "Z-Image", D, ("transformer.", "diffusion_model.", "", "base_model.model."),
            "transformer.layers.0.attention.to_q",
            "diffusers/ai-toolkit/musubi-tuner: attention.to_q/to_k/to_v = rows [0, h), [h, 2h), [2h, 3h) of "
            "attention.qkv (h = dim), attention.to_out.0 = attention.out, norm_q/norm_k = q_norm/k_norm, "
            "all_x_embedder.2-1 = x_embedder, all_final_layer.2-1.* = final_layer.*; in layers, noise_refiner and "
            "context_refiner"),
    Dialect("Z-Image LyCORIS", "Z-Image", D, ("lycoris_",), "lycoris_layers_0_attention_to_q",
            "as Z-Image diffusers, '_' for '.'"),
    Dialect("HunyuanVideo native", "HunyuanVideo", N, _NATIVE_DOTTED,
            "diffusion_model.double_blocks.0.img_attn.qkv",
            "ComfyUI's names (Flux's blocks, 1.0 and 1.5); whole module"),
    Dialect("HunyuanVideo kohya", "HunyuanVideo", N, ("lora_unet_",), "lora_unet_double_blocks_0_img_attn_qkv",
            "native name, '_' for '.'; whole module"),
    Dialect("HunyuanVideo diffusion-pipe", "HunyuanVideo", P, ("transformer.", "diffusion_model."),
            "transformer.double_blocks.0.img_attn_qkv",
            "the original release's names: img/txt_mod.linear = _mod.lin, img/txt_attn_qkv = _attn.qkv, "
            "img/txt_attn_proj = _attn.proj, img/txt_mlp.fc1/fc2 = _mlp.0/2, single modulation.linear = "
            "modulation.lin, token refiner self_attn_qkv/self_attn_proj/mlp.fc1/fc2; whole module"),
    Dialect("HunyuanVideo musubi-tuner", "HunyuanVideo", P, ("lora_unet_",), "lora_unet_double_blocks_0_img_mod_linear",
            "the original release's names, '_' for '.' (ComfyUI's key map has no place for img_mod_linear, "
            "img_mlp_fc1, ...: the pack's table places them)"),
    # any model: the model's own names
    Dialect("kohya", None, N, ("lora_unet_", "lora_unet__", "lora_transformer_", "lycoris_", "lora_te_"),
            "lora_unet_<module_path>", "the model's module name, '_' for '.'"),
    Dialect("PEFT", None, N, ("base_model.model.",), "base_model.model.<module_path>", "the model's module name"),
    Dialect("native", None, N, _ANY_DOTTED, "diffusion_model.<module_path>", "the model's module name"),
]


def _label(family: str | None, naming: str, prefix: str) -> str:
    for d in DIALECTS:
        if d.family == family and d.naming == naming and prefix in d.prefixes:
            return d.name
    for d in DIALECTS:
        if d.family == family and d.naming == naming:
            return d.name
    if family is not None:
        return f"{family} {naming}"
    return "kohya" if prefix.endswith("_") else "PEFT" if prefix == "base_model.model." else "native"


# --- the per-model index -------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    native: str
    rows: object          # None, (start, stop) or "swap"
    naming: str
    param: bool


def _weight_shape(mod: nn.Module) -> tuple[int, ...] | None:
    """[out, in, ...] of the module's weight; a Linear's own in/out_features first (a
    quantized weight's storage shape need not be its logical shape)."""
    o, i = getattr(mod, "out_features", None), getattr(mod, "in_features", None)
    if isinstance(o, int) and isinstance(i, int):
        return (o, i)
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor):
        base = getattr(mod, "base_layer", None)
        w = getattr(base, "weight", None) if base is not None else None
    return tuple(w.shape) if isinstance(w, torch.Tensor) and w.dim() >= 2 else None


def model_family(modules: Mapping[str, nn.Module]) -> str | None:
    for family, mark in _FAMILY_MARKS:
        if any(mark.search(n) for n in modules):
            return family
    return None


class _Index:
    def __init__(self, modules: Mapping[str, nn.Module], family: str | None = None):
        # the host's word (ComfyUI's model class) first; the module names only without one
        self.family = (family or None) if family is not None else model_family(modules)
        self.names: dict[str, list[_Entry]] = {}
        self.shared: set[str] = set()   # native names no other naming of the family renames
        natives: dict[str, tuple[nn.Module | None, bool]] = {}
        for name, mod in modules.items():
            if not name or name.endswith(".base_layer"):
                continue
            natives[name] = (mod, False)
        for name, mod in modules.items():
            if name.endswith(".base_layer") or ".base_layer." in name:
                continue
            for pname, p in getattr(mod, "_parameters", {}).items():
                if p is None or pname in ("weight", "bias"):
                    continue
                full = f"{name}.{pname}" if name else pname
                natives.setdefault(full, (None, True))
        for name, (mod, is_param) in natives.items():
            self.names.setdefault(name, []).append(_Entry(name, None, N, is_param))
        table = FAMILY_TABLES.get(self.family, [])
        compiled = [(re.compile(pat), alts) for pat, alts in table]
        for name, (mod, is_param) in natives.items():
            self.shared.add(name)
            for rx, alts in compiled:
                m = rx.fullmatch(name)
                if not m:
                    continue
                shape = _weight_shape(mod) if mod is not None else None
                for naming, template, rule in alts:
                    if rule is _whole:
                        rows = None
                    elif shape is None:
                        continue
                    else:
                        rows = rule(shape)
                        if rows is False:
                            continue
                    alias = template.format(*m.groups())
                    self.names.setdefault(alias, []).append(_Entry(name, rows, naming, is_param))
                    self.shared.discard(name)
                break
        self.flat: dict[str, list[str]] = {}
        for name in self.names:
            self.flat.setdefault(name.replace(".", "_"), []).append(name)

    def entries(self, body: str, underscore: bool) -> list[_Entry]:
        if underscore:
            out: list[_Entry] = []
            for name in self.flat.get(body, []):
                out += self.names[name]
            return out
        return list(self.names.get(body, []))


# A few recent indexes, keyed by the mapping's first and last module (weakly: a cached
# index never keeps a model alive) and its length; a fresh dict(model.named_modules())
# of the same model finds its index again.
_CACHE: list[tuple[weakref.ref, weakref.ref, int, str | None, _Index]] = []


def _index(modules: Mapping[str, nn.Module], family: str | None = None) -> _Index:
    """The index of these modules; ``family``: the host's family for the model ('' = none of the
    tables), None = read it from the module names (`model_family`)."""
    if not modules:
        return _Index(modules, family)
    values = list(modules.values()) if not isinstance(modules, dict) else None
    first = values[0] if values is not None else next(iter(modules.values()))
    last = values[-1] if values is not None else next(reversed(modules.values()))
    for a, b, n, fam, idx in _CACHE:
        if a() is first and b() is last and n == len(modules) and fam == family:
            return idx
    idx = _Index(modules, family)
    try:
        _CACHE.insert(0, (weakref.ref(first), weakref.ref(last), len(modules), family, idx))
        del _CACHE[4:]
    except TypeError:   # not weak-referenceable: no caching
        pass
    return idx


# --- resolving -----------------------------------------------------------------------


def _candidates(stem: str, idx: _Index) -> tuple[str, list[_Entry]]:
    prefix, body, underscore = _split_prefix(stem)
    found = idx.entries(body, underscore)
    if not found and not underscore and body.startswith("model."):   # a bare "model." prefix, tried last
        found = idx.entries(body[len("model."):], False)
        prefix = prefix or "model."
    if not found and not underscore and "." not in body:             # a dotted path written with '_'
        found = idx.entries(body, True)
    return prefix, found


def _pick(found: list[_Entry], prefer: str | None, prefix: str, family: str | None) -> _Entry | None:
    if not found:
        return None
    targets = {(e.native, e.rows) for e in found}
    if len(targets) == 1:
        e = found[0]
        if family in _SHARED_NAMES and all(x.naming == N for x in found):
            # a name both namings share: the prefix (or the file) says which it is
            return _Entry(e.native, e.rows, _shared_naming(family, prefix, prefer), e.param)
        if prefer:   # one target under several names (kohya's '_' for '.' of two namings): the file's
            e = next((x for x in found if x.naming == prefer), e)
        return e
    for naming in ((prefer,) if prefer else ()) + (N, D, X, P, A):
        hits = [e for e in found if e.naming == naming]
        if len({(e.native, e.rows) for e in hits}) == 1:
            return hits[0]
    return None   # ambiguous: refuse rather than guess


def resolve(stem: str, modules: Mapping[str, nn.Module], *, prefer: str | None = None,
            family: str | None = None) -> Target | None:
    """Where `stem` goes in the model whose ``named_modules()`` are `modules` (see the module doc).
    ``family``: the model's family as the host knows it (ComfyUI's model class), '' for none of
    the tables; None: read from the module names."""
    idx = _index(modules, family)
    prefix, found = _candidates(stem, idx)
    e = _pick(found, prefer, prefix, idx.family)
    if e is None:
        return None
    rows = e.rows if isinstance(e.rows, tuple) else None
    return Target(e.native, rows, _label(idx.family, e.naming, prefix), e.param, e.rows == "swap")


def resolve_all(stems: Iterable[str], modules: Mapping[str, nn.Module], *,
                family: str | None = None) -> dict[str, Target | None]:
    """Resolve one file's stems in the naming the file as a whole uses: a name that two
    namings read differently (Wan diffusers ``norm2``) is read in the naming the file's
    unambiguous stems show. A name no other naming renames (Z-Image ``feed_forward.w1``)
    does not vote. ``family``: as in `resolve`."""
    stems = list(stems)
    idx = _index(modules, family)
    votes: Counter = Counter()
    for s in stems:
        _, found = _candidates(s, idx)
        namings = {e.naming for e in found}
        if len(namings) == 1 and not (namings == {N} and all(e.native in idx.shared for e in found)):
            votes[next(iter(namings))] += 1
    prefer = None
    others = {n: c for n, c in votes.items() if n != N}
    if others:
        best = max(others, key=others.get)
        if others[best] > votes.get(N, 0):
            prefer = best
    return {s: resolve(s, modules, prefer=prefer, family=family) for s in stems}


def overlaps(targets: Iterable[Target | None]) -> list[tuple[Target, Target]]:
    """Pairs of targets whose row ranges on one module intersect (whole-module targets
    overlap everything on that module)."""
    by_mod: dict[str, list[Target]] = {}
    for t in targets:
        if t is not None:
            by_mod.setdefault(t.module, []).append(t)
    out = []
    for ts in by_mod.values():
        for i, a in enumerate(ts):
            for b in ts[i + 1:]:
                if a.rows is None or b.rows is None or (a.rows[0] < b.rows[1] and b.rows[0] < a.rows[1]):
                    out.append((a, b))
    return out


# --- naming a file's dialect without a model ----------------------------------------


def _text_patterns() -> list[tuple[str, str, re.Pattern, re.Pattern]]:
    """(family, naming, dotted regex, underscore regex) for every name in the tables."""
    out = []
    for family, table in FAMILY_TABLES.items():
        for pat, alts in table:
            out.append((family, N, pat))
            for naming, template, _ in alts:
                rx = re.escape(template)
                for k in range(4):
                    rx = rx.replace(re.escape("{%d}" % k), r"(\d+|attn[12]|img|txt|layers|noise_refiner|context_refiner)")
                out.append((family, naming, rx))
    return [(f, n, re.compile(p), re.compile(p.replace(r"\.", "_"))) for f, n, p in out]


_TEXT = _text_patterns()


def _text_matches(stem: str) -> tuple[str, set[tuple[str, str]]]:
    prefix, body, underscore = _split_prefix(stem)
    hits = set()
    for family, naming, dotted, flat in _TEXT:
        if (flat if underscore else dotted).fullmatch(body):
            hits.add((family, naming))
    return prefix, hits


def dialect_name(stems: Iterable[str], modules: Mapping[str, nn.Module] | None = None, *,
                 family: str | None = None) -> str:
    """The dialect most of these stems are written in (a `DIALECTS` name).

    With the model's modules: the commonest label among the stems that resolve. Without
    (or when none resolves): read from the names alone, by the same family tables.
    ``family``: as in `resolve`."""
    stems = list(stems)
    if not stems:
        return "unknown"
    if modules is not None:
        labels = Counter(t.dialect for t in resolve_all(stems, modules, family=family).values()
                         if t is not None)
        marks = [d.name for d in DIALECTS if d.naming == A and d.name in labels]
        if marks:   # names only that naming has: they name the file (the rest is the usual names)
            return marks[0]
        if labels:
            return labels.most_common(1)[0][0]
    fam_votes: Counter = Counter()
    per_stem = []
    for s in stems:
        prefix, hits = _text_matches(s)
        per_stem.append((prefix, hits))
        for fam in {f for f, _ in hits}:
            fam_votes[fam] += 1
    prefixes = Counter(p for p, _ in per_stem)
    prefix = prefixes.most_common(1)[0][0]
    if not fam_votes:
        return _label(None, N, prefix)
    family = max(FAMILY_TABLES, key=lambda f: fam_votes[f])   # ties: the table order (Flux first)
    naming_votes: Counter = Counter()
    for p, hits in per_stem:
        namings = {n for f, n in hits if f == family}
        if len(namings) == 1:
            naming_votes[next(iter(namings))] += 1
    namings = [n for n in (D, X, P) if naming_votes[n]]
    naming = max(namings, key=lambda n: naming_votes[n]) if namings else N
    if naming_votes[A]:   # names only that naming has: they name the file
        naming = A
    if naming == N and family in _SHARED_NAMES and not namings:
        naming = _shared_naming(family, prefix, None)
    return _label(family, naming, prefix)
