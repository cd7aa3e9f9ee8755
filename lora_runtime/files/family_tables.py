"""Family tables: each native module name of a model family and its names in other namings.

A row: native module name (regex, fullmatch; groups are block indices) -> its names in other
namings: (naming, template with {0},{1}.. for the groups, rows rule). A rows rule takes the
native weight's shape [out, in, ...] and gives (start, stop) or None (whole), or "swap" (whole,
halves exchanged); a rule that does not fit the shape yields no name at all. Where the names come
from: docs/engine.md (key dialects).
"""
from __future__ import annotations

import re
from typing import Callable

RowsRule = Callable[[tuple[int, ...]], object]


def whole(shape):
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
        (X, "double_blocks.{0}.processor.qkv_lora1", whole)]),
    (rf"double_blocks\.{_B}\.txt_attn\.qkv", [
        (D, "transformer_blocks.{0}.attn.add_q_proj", _third(0)),
        (D, "transformer_blocks.{0}.attn.add_k_proj", _third(1)),
        (D, "transformer_blocks.{0}.attn.add_v_proj", _third(2)),
        (X, "double_blocks.{0}.processor.qkv_lora2", whole)]),
    (rf"double_blocks\.{_B}\.img_attn\.proj", [
        (D, "transformer_blocks.{0}.attn.to_out.0", whole),
        (X, "double_blocks.{0}.processor.proj_lora1", whole)]),
    (rf"double_blocks\.{_B}\.txt_attn\.proj", [
        (D, "transformer_blocks.{0}.attn.to_add_out", whole),
        (X, "double_blocks.{0}.processor.proj_lora2", whole)]),
    (rf"double_blocks\.{_B}\.img_mod\.lin", [(D, "transformer_blocks.{0}.norm1.linear", whole)]),
    (rf"double_blocks\.{_B}\.txt_mod\.lin", [(D, "transformer_blocks.{0}.norm1_context.linear", whole)]),
    (rf"double_blocks\.{_B}\.img_mlp\.0", [(D, "transformer_blocks.{0}.ff.net.0.proj", whole),
                                           (D, "transformer_blocks.{0}.ff.linear_in", whole)]),
    (rf"double_blocks\.{_B}\.img_mlp\.2", [(D, "transformer_blocks.{0}.ff.net.2", whole),
                                           (D, "transformer_blocks.{0}.ff.linear_out", whole)]),
    (rf"double_blocks\.{_B}\.txt_mlp\.0", [(D, "transformer_blocks.{0}.ff_context.net.0.proj", whole),
                                           (D, "transformer_blocks.{0}.ff_context.linear_in", whole)]),
    (rf"double_blocks\.{_B}\.txt_mlp\.2", [(D, "transformer_blocks.{0}.ff_context.net.2", whole),
                                           (D, "transformer_blocks.{0}.ff_context.linear_out", whole)]),
    (rf"double_blocks\.{_B}\.img_attn\.norm\.query_norm", [(D, "transformer_blocks.{0}.attn.norm_q", whole)]),
    (rf"double_blocks\.{_B}\.img_attn\.norm\.key_norm", [(D, "transformer_blocks.{0}.attn.norm_k", whole)]),
    (rf"double_blocks\.{_B}\.txt_attn\.norm\.query_norm", [(D, "transformer_blocks.{0}.attn.norm_added_q", whole)]),
    (rf"double_blocks\.{_B}\.txt_attn\.norm\.key_norm", [(D, "transformer_blocks.{0}.attn.norm_added_k", whole)]),
    (rf"single_blocks\.{_B}\.linear1", [
        (D, "single_transformer_blocks.{0}.attn.to_q", _linear1(0)),
        (D, "single_transformer_blocks.{0}.attn.to_k", _linear1(1)),
        (D, "single_transformer_blocks.{0}.attn.to_v", _linear1(2)),
        (D, "single_transformer_blocks.{0}.proj_mlp", _linear1(3)),
        (D, "single_transformer_blocks.{0}.attn.to_qkv_mlp_proj", whole),   # Flux 2
        (N, "single_blocks.{0}.linear1_qkv", _linear1_qkv),                  # ComfyUI's own key
        (X, "single_blocks.{0}.processor.qkv_lora", _linear1_qkv)]),
    (rf"single_blocks\.{_B}\.linear2", [
        (D, "single_transformer_blocks.{0}.proj_out", whole),
        (D, "single_transformer_blocks.{0}.attn.to_out", whole),            # Flux 2
        (X, "single_blocks.{0}.processor.proj_lora", whole)]),
    (rf"single_blocks\.{_B}\.modulation\.lin", [(D, "single_transformer_blocks.{0}.norm.linear", whole)]),
    (rf"single_blocks\.{_B}\.norm\.query_norm", [(D, "single_transformer_blocks.{0}.attn.norm_q", whole)]),
    (rf"single_blocks\.{_B}\.norm\.key_norm", [(D, "single_transformer_blocks.{0}.attn.norm_k", whole)]),
    (r"img_in", [(D, "x_embedder", whole)]),
    (r"txt_in", [(D, "context_embedder", whole)]),
    (r"time_in\.in_layer", [(D, "time_text_embed.timestep_embedder.linear_1", whole),
                             (D, "time_guidance_embed.timestep_embedder.linear_1", whole)]),  # Flux 2
    (r"time_in\.out_layer", [(D, "time_text_embed.timestep_embedder.linear_2", whole),
                              (D, "time_guidance_embed.timestep_embedder.linear_2", whole)]),
    (r"vector_in\.in_layer", [(D, "time_text_embed.text_embedder.linear_1", whole)]),
    (r"vector_in\.out_layer", [(D, "time_text_embed.text_embedder.linear_2", whole)]),
    (r"guidance_in\.in_layer", [(D, "time_text_embed.guidance_embedder.linear_1", whole),
                                 (D, "time_guidance_embed.guidance_embedder.linear_1", whole)]),
    (r"guidance_in\.out_layer", [(D, "time_text_embed.guidance_embedder.linear_2", whole),
                                  (D, "time_guidance_embed.guidance_embedder.linear_2", whole)]),
    # Flux 2: one modulation per stream for all blocks (same [shift, scale, gate] row order in both namings)
    (r"double_stream_modulation_img\.lin", [(D, "double_stream_modulation_img.linear", whole)]),
    (r"double_stream_modulation_txt\.lin", [(D, "double_stream_modulation_txt.linear", whole)]),
    (r"single_stream_modulation\.lin", [(D, "single_stream_modulation.linear", whole)]),
    (r"final_layer\.linear", [(D, "proj_out", whole)]),
    (r"final_layer\.adaLN_modulation\.1", [(D, "norm_out.linear", _swap)]),
    # Chroma's approximator: diffusers' PixArtAlphaTextProjection layers = ComfyUI's MLPEmbedder
    (rf"distilled_guidance_layer\.layers\.{_B}\.in_layer", [(D, "distilled_guidance_layer.layers.{0}.linear_1", whole)]),
    (rf"distilled_guidance_layer\.layers\.{_B}\.out_layer", [(D, "distilled_guidance_layer.layers.{0}.linear_2", whole)]),
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
    (r"patchify_proj", [(D, "proj_in", whole)]),
    (r"adaln_single\.linear", [(D, "time_embed.linear", whole)]),
    (r"adaln_single\.emb\.timestep_embedder\.linear_1", [(D, "time_embed.emb.timestep_embedder.linear_1", whole)]),
    (r"adaln_single\.emb\.timestep_embedder\.linear_2", [(D, "time_embed.emb.timestep_embedder.linear_2", whole)]),
    (rf"transformer_blocks\.{_B}\.(attn[12])\.q_norm", [(D, "transformer_blocks.{0}.{1}.norm_q", whole)]),
    (rf"transformer_blocks\.{_B}\.(attn[12])\.k_norm", [(D, "transformer_blocks.{0}.{1}.norm_k", whole)]),
    # same name in both namings
    (rf"transformer_blocks\.{_B}\.attn[12]\.(?:to_q|to_k|to_v|to_out\.0)", []),
    (rf"transformer_blocks\.{_B}\.ff\.net\.(?:0\.proj|2)", []),
    (rf"transformer_blocks\.{_B}\.scale_shift_table", []),
    (r"caption_projection\.linear_[12]|proj_out|norm_out|scale_shift_table", []),
]

WAN_TABLE: list[tuple[str, list]] = [
    (rf"blocks\.{_B}\.self_attn\.q", [(D, "blocks.{0}.attn1.to_q", whole)]),
    (rf"blocks\.{_B}\.self_attn\.k", [(D, "blocks.{0}.attn1.to_k", whole)]),
    (rf"blocks\.{_B}\.self_attn\.v", [(D, "blocks.{0}.attn1.to_v", whole)]),
    (rf"blocks\.{_B}\.self_attn\.o", [(D, "blocks.{0}.attn1.to_out.0", whole),
                                        (A, "blocks.{0}.self_attn.to_out.0", whole)]),
    (rf"blocks\.{_B}\.self_attn\.norm_q", [(D, "blocks.{0}.attn1.norm_q", whole)]),
    (rf"blocks\.{_B}\.self_attn\.norm_k", [(D, "blocks.{0}.attn1.norm_k", whole)]),
    (rf"blocks\.{_B}\.cross_attn\.q", [(D, "blocks.{0}.attn2.to_q", whole)]),
    (rf"blocks\.{_B}\.cross_attn\.k", [(D, "blocks.{0}.attn2.to_k", whole)]),
    (rf"blocks\.{_B}\.cross_attn\.v", [(D, "blocks.{0}.attn2.to_v", whole)]),
    (rf"blocks\.{_B}\.cross_attn\.o", [(D, "blocks.{0}.attn2.to_out.0", whole),
                                         (A, "blocks.{0}.cross_attn.to_out.0", whole)]),
    (rf"blocks\.{_B}\.cross_attn\.norm_q", [(D, "blocks.{0}.attn2.norm_q", whole)]),
    (rf"blocks\.{_B}\.cross_attn\.norm_k", [(D, "blocks.{0}.attn2.norm_k", whole)]),
    (rf"blocks\.{_B}\.cross_attn\.k_img", [(D, "blocks.{0}.attn2.add_k_proj", whole)]),
    (rf"blocks\.{_B}\.cross_attn\.v_img", [(D, "blocks.{0}.attn2.add_v_proj", whole)]),
    (rf"blocks\.{_B}\.cross_attn\.norm_k_img", [(D, "blocks.{0}.attn2.norm_added_k", whole)]),
    (rf"blocks\.{_B}\.ffn\.0", [(D, "blocks.{0}.ffn.net.0.proj", whole)]),
    (rf"blocks\.{_B}\.ffn\.2", [(D, "blocks.{0}.ffn.net.2", whole)]),
    (rf"blocks\.{_B}\.norm3", [(D, "blocks.{0}.norm2", whole)]),     # diffusers swaps norm2/norm3
    (rf"blocks\.{_B}\.norm2", [(D, "blocks.{0}.norm3", whole)]),
    (rf"blocks\.{_B}\.modulation", [(D, "blocks.{0}.scale_shift_table", whole)]),
    (r"head\.modulation", [(D, "scale_shift_table", whole)]),
    (r"head\.head", [(D, "proj_out", whole)]),
    (r"time_embedding\.0", [(D, "condition_embedder.time_embedder.linear_1", whole)]),
    (r"time_embedding\.2", [(D, "condition_embedder.time_embedder.linear_2", whole)]),
    (r"time_projection\.1", [(D, "condition_embedder.time_proj", whole)]),
    (r"text_embedding\.0", [(D, "condition_embedder.text_embedder.linear_1", whole)]),
    (r"text_embedding\.2", [(D, "condition_embedder.text_embedder.linear_2", whole)]),
    (r"img_emb\.proj\.0", [(D, "condition_embedder.image_embedder.norm1", whole)]),
    (r"img_emb\.proj\.1", [(D, "condition_embedder.image_embedder.ff.net.0.proj", whole)]),
    (r"img_emb\.proj\.3", [(D, "condition_embedder.image_embedder.ff.net.2", whole)]),
    (r"img_emb\.proj\.4", [(D, "condition_embedder.image_embedder.norm2", whole)]),
    (r"patch_embedding", []),
]

_ZB = r"(layers|noise_refiner|context_refiner)\.(\d+)"   # Z-Image's three block lists

ZIMAGE_TABLE: list[tuple[str, list]] = [
    (rf"{_ZB}\.attention\.qkv", [
        (D, "{0}.{1}.attention.to_q", _qkv_part(0)),
        (D, "{0}.{1}.attention.to_k", _qkv_part(1)),
        (D, "{0}.{1}.attention.to_v", _qkv_part(2))]),
    (rf"{_ZB}\.attention\.out", [(D, "{0}.{1}.attention.to_out.0", whole)]),
    (rf"{_ZB}\.attention\.q_norm", [(D, "{0}.{1}.attention.norm_q", whole)]),
    (rf"{_ZB}\.attention\.k_norm", [(D, "{0}.{1}.attention.norm_k", whole)]),
    (r"x_embedder", [(D, "all_x_embedder.2-1", whole)]),
    (r"final_layer\.linear", [(D, "all_final_layer.2-1.linear", whole)]),
    (r"final_layer\.adaLN_modulation\.1", [(D, "all_final_layer.2-1.adaLN_modulation.1", whole)]),
    # same name in both namings
    (rf"{_ZB}\.(?:feed_forward\.w[123]|adaLN_modulation\.0|attention_norm[12]|ffn_norm[12])", []),
    (r"cap_embedder\.[01]|t_embedder\.mlp\.[02]", []),
]

_HB = r"double_blocks\.(\d+)\.(img|txt)"
_TR = r"txt_in\.individual_token_refiner\.blocks\.(\d+)"

HUNYUAN_VIDEO_TABLE: list[tuple[str, list]] = [
    (rf"{_HB}_mod\.lin", [(P, "double_blocks.{0}.{1}_mod.linear", whole)]),
    (rf"{_HB}_attn\.qkv", [(P, "double_blocks.{0}.{1}_attn_qkv", whole)]),
    (rf"{_HB}_attn\.proj", [(P, "double_blocks.{0}.{1}_attn_proj", whole)]),
    (rf"{_HB}_mlp\.0", [(P, "double_blocks.{0}.{1}_mlp.fc1", whole)]),
    (rf"{_HB}_mlp\.2", [(P, "double_blocks.{0}.{1}_mlp.fc2", whole)]),
    (rf"single_blocks\.{_B}\.modulation\.lin", [(P, "single_blocks.{0}.modulation.linear", whole)]),
    (rf"{_TR}\.self_attn\.qkv", [(P, "txt_in.individual_token_refiner.blocks.{0}.self_attn_qkv", whole)]),
    (rf"{_TR}\.self_attn\.proj", [(P, "txt_in.individual_token_refiner.blocks.{0}.self_attn_proj", whole)]),
    (rf"{_TR}\.mlp\.0", [(P, "txt_in.individual_token_refiner.blocks.{0}.mlp.fc1", whole)]),
    (rf"{_TR}\.mlp\.2", [(P, "txt_in.individual_token_refiner.blocks.{0}.mlp.fc2", whole)]),
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
FAMILY_MARKS: list[tuple[str, re.Pattern]] = [
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
SHARED_NAMES: dict[str, tuple[str, dict[str, str]]] = {
    "Flux": (N, {"transformer.": D, "lora_transformer_": D, "lycoris_": D}),   # e.g. Chroma's in_proj
    "Qwen-Image": (D, {"transformer.": D, "base_model.model.": D}),
    "LTX-Video": (N, {"transformer.": D, "base_model.model.": D}),
    "Z-Image": (N, {"transformer.": D, "base_model.model.": D, "lycoris_": D}),
    "HunyuanVideo": (N, {"transformer.": P}),
}

