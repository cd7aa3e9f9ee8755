"""The dialect table: every key dialect's name, family, naming and prefixes; it labels the
targets `resolve` finds, and drives DIALECTS.md and the tests."""
from __future__ import annotations

from dataclasses import dataclass

from .family_tables import SHARED_NAMES, A, D, N, P, X
from .stem_prefix import ANY_DOTTED, NATIVE_DOTTED

@dataclass(frozen=True)
class Dialect:
    name: str
    family: str | None                   # None: any model (names used literally)
    naming: str                          # "native", "diffusers", "xlabs"
    prefixes: tuple[str, ...]            # prefix kinds this dialect writes ("" = none)
    example: str                         # one stem, as written in a file
    how: str                             # what resolve does with it (for DIALECTS.md)


DIALECTS: list[Dialect] = [
    Dialect("Flux BFL native", "Flux", N, NATIVE_DOTTED + ("transformer.", "base_model.model."),
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
    Dialect("LTX-Video native", "LTX-Video", N, NATIVE_DOTTED,
            "diffusion_model.transformer_blocks.0.attn1.to_q", "whole module"),
    Dialect("LTX-Video diffusers", "LTX-Video", D, ("transformer.", "base_model.model.", "", "diffusion_model."),
            "transformer.transformer_blocks.0.attn1.to_q",
            "proj_in = patchify_proj, time_embed.* = adaln_single.*, norm_q/norm_k = q_norm/k_norm; whole module"),
    Dialect("LTX-Video kohya", "LTX-Video", N, ("lora_unet_",),
            "lora_unet_transformer_blocks_0_attn1_to_q", "whole module"),
    Dialect("Wan native", "Wan", N, NATIVE_DOTTED + ("transformer.",),
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
    Dialect("Wan diffusers", "Wan", D, ANY_DOTTED + ("lora_unet_", "lora_transformer_", "lycoris_"),
            "transformer.blocks.0.attn1.to_q",
            "attn1/attn2 -> self_attn/cross_attn, ffn.net.0.proj -> ffn.0, norm2 <-> norm3, scale_shift_table -> "
            "modulation; whole module"),
    Dialect("Z-Image native", "Z-Image", N, NATIVE_DOTTED,
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
    Dialect("HunyuanVideo native", "HunyuanVideo", N, NATIVE_DOTTED,
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
    Dialect("native", None, N, ANY_DOTTED, "diffusion_model.<module_path>", "the model's module name"),
]


def label(family: str | None, naming: str, prefix: str) -> str:
    for d in DIALECTS:
        if d.family == family and d.naming == naming and prefix in d.prefixes:
            return d.name
    for d in DIALECTS:
        if d.family == family and d.naming == naming:
            return d.name
    if family is not None:
        return f"{family} {naming}"
    return "kohya" if prefix.endswith("_") else "PEFT" if prefix == "base_model.model." else "native"



def shared_naming(family: str, prefix: str, prefer: str | None) -> str:
    """The naming a name both namings of `family` share is read in: the file's (``prefer``),
    else the one its prefix says (``transformer.`` = diffusers, ...; a bare name: the family's
    default; any other prefix: native)."""
    bare, by_prefix = SHARED_NAMES[family]
    naming = prefer or (by_prefix.get(prefix, N) if prefix else bare)
    if naming != N and not any(d.family == family and d.naming == naming for d in DIALECTS):
        naming = N
    return naming
