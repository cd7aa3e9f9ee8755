"""Tiny models of ComfyUI's own classes (``comfy.supported_models``), with what it takes to sample them.

    TINY[kind]                  -> Tiny: the class's config at a tiny size, the sampling inputs
    build(kind, dtype)          -> (BaseModel, ModelPatcher) on the CPU, seeded weights (imports comfy:
                                   run it in ComfyUI's python)
    conditioning(kind)          -> (positive, negative) CONDITIONING lists
    latent(kind)                -> the empty LATENT samples (a NestedTensor for LTX-2: video + audio)

``kind`` is the ``comfy.supported_models`` class name. The configs give what
``comfy/model_detection.py`` reads off a checkpoint, at widths of 16-64 (Z-Image: 256, the width of
its timestep embedding; Mochi: an MLP ratio of 384, the 12288-wide MLP its block asserts), two blocks.

Weights: seeded N(0, 0.05^2) per parameter in module order; a weight of two or more dims whose
fan-in is over 64 gets 0.05 * sqrt(64 / fan-in), so every layer has the gain of a 64-wide one and the
bf16 rounding noise of a whole sampling stays 62.8-83.7 dB from the fp32 result (measured). ``text_path``
names the weights drawn at 0.7 / sqrt(fan-in) instead (LTX-2's caption projections and cross
attention), so that what the text connectors compute reaches the output.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch

SEED = 0
COND_SEED, EXTRA_SEED = 5, 6


@dataclass(frozen=True)
class Tiny:
    config: dict
    latent_shapes: tuple            # one shape, or several (a nested latent: LTX-2's video and audio)
    cond: tuple[int, int]           # (tokens, width) of the text conditioning
    extra: dict = field(default_factory=dict)     # conditioning entries drawn at random: name -> shape
    fixed: dict = field(default_factory=dict)     # conditioning entries given: name -> tensor factory
    text_path: Callable[[str], bool] | None = None


_HV = {"image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16, "patch_size": [1, 2, 2],
       "vec_in_dim": 12, "axes_dim": [4, 6, 6], "meanflow": False, "context_in_dim": 24, "hidden_size": 32,
       "mlp_ratio": 4.0, "num_heads": 2, "depth": 2, "depth_single_blocks": 2, "theta": 256, "qkv_bias": True,
       "byt5": False, "guidance_embed": True, "use_cond_type_embedding": False, "vision_in_dim": None,
       "meanflow_sum": False}

TINY: dict[str, Tiny] = {
    # LTX-2: the text connectors (video/audio_embeddings_connector) run in extra_conds, before sampling
    "LTXAV": Tiny({"image_model": "ltxav", "in_channels": 16, "audio_in_channels": 128, "cross_attention_dim": 32,
                   "audio_cross_attention_dim": 16, "attention_head_dim": 8, "audio_attention_head_dim": 8,
                   "num_attention_heads": 4, "audio_num_attention_heads": 2, "caption_channels": 24, "num_layers": 2,
                   "connector_attention_head_dim": 8, "connector_num_attention_heads": 3,
                   "connector_num_layers": 1},
                  ((1, 16, 2, 4, 4), (1, 8, 5, 16)), (7, 24),
                  text_path=lambda n: "caption_projection" in n or ".attn2." in n or ".audio_attn2." in n),
    "Lumina2": Tiny({"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 64, "cap_feat_dim": 32,
                     "n_layers": 2, "qk_norm": True, "n_heads": 4, "n_kv_heads": 2, "axes_dims": [4, 6, 6],
                     "axes_lens": [64, 64, 64], "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0, "multiple_of": 16},
                    ((1, 16, 8, 8),), (7, 32), fixed={"attention_mask": lambda: torch.ones(1, 7, dtype=torch.int64)}),
    "ZImage": Tiny({"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 256, "cap_feat_dim": 32,
                    "n_layers": 2, "qk_norm": True, "n_heads": 2, "n_kv_heads": 2, "axes_dims": [32, 48, 48],
                    "axes_lens": [64, 64, 64], "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0,
                    "z_image_modulation": True, "time_scale": 1000.0, "multiple_of": 16},
                   ((1, 16, 8, 8),), (7, 32)),
    "HunyuanImage21": Tiny({**_HV, "in_channels": 64, "out_channels": 64, "patch_size": [1, 1], "vec_in_dim": None,
                            "axes_dim": [8, 8], "guidance_embed": False},
                           ((1, 64, 4, 4),), (7, 24)),
    "HunyuanVideo": Tiny(_HV, ((1, 16, 1, 8, 8),), (7, 24), extra={"pooled_output": (12,)}),
    "HunyuanVideo15": Tiny({**_HV, "in_channels": 65, "out_channels": 32, "vec_in_dim": None,
                            "depth_single_blocks": 0, "byt5": True, "guidance_embed": False,
                            "use_cond_type_embedding": True, "vision_in_dim": 20},
                           ((1, 32, 1, 8, 8),), (7, 24),
                           # byT5 glyph tokens (its mapper is 1472 wide at any size) and vision features, so
                           # that byt5_in and vision_in run
                           extra={"pooled_output": (12,), "conditioning_byt5small": (3, 1472)},
                           fixed={"clip_vision_output": lambda: SimpleNamespace(
                               last_hidden_state=torch.randn(1, 4, 20, generator=torch.Generator().manual_seed(7)))}),
    "CosmosT2IPredict2": Tiny({"image_model": "cosmos_predict2", "max_img_h": 240, "max_img_w": 240,
                               "max_frames": 128, "in_channels": 16, "out_channels": 16, "patch_spatial": 2,
                               "patch_temporal": 1, "model_channels": 32, "concat_padding_mask": True,
                               "crossattn_emb_channels": 24, "pos_emb_cls": "rope3d", "pos_emb_learnable": True,
                               "pos_emb_interpolation": "crop", "min_fps": 1, "max_fps": 30, "use_adaln_lora": True,
                               "adaln_lora_dim": 8, "num_blocks": 2, "num_heads": 2,
                               "extra_per_block_abs_pos_emb": False, "rope_h_extrapolation_ratio": 4.0,
                               "rope_w_extrapolation_ratio": 4.0, "rope_t_extrapolation_ratio": 1.0,
                               "extra_h_extrapolation_ratio": 1.0, "extra_w_extrapolation_ratio": 1.0,
                               "extra_t_extrapolation_ratio": 1.0, "rope_enable_fps_modulation": False},
                              ((1, 16, 1, 8, 8),), (7, 24)),
    "Chroma": Tiny({"image_model": "chroma", "in_channels": 64, "out_channels": 64, "context_in_dim": 24,
                    "hidden_size": 32, "mlp_ratio": 4.0, "num_heads": 2, "depth": 2, "depth_single_blocks": 2,
                    "axes_dim": [4, 6, 6], "theta": 10000, "patch_size": 2, "qkv_bias": True, "in_dim": 64,
                    "out_dim": 32, "hidden_dim": 40, "n_layers": 2, "txt_ids_dims": [], "vec_in_dim": None},
                   ((1, 16, 8, 8),), (7, 24), extra={"pooled_output": (12,)}),   # 0.3.64 asks for one
    "Flux": Tiny({"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 12, "context_in_dim": 24,
                  "hidden_size": 32, "mlp_ratio": 4.0, "num_heads": 2, "depth": 2, "depth_single_blocks": 2,
                  "axes_dim": [4, 6, 6], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": True,
                  "txt_ids_dims": []},
                 ((1, 16, 8, 8),), (7, 24), extra={"pooled_output": (12,)}),
    "Flux2": Tiny({"image_model": "flux2", "in_channels": 128, "out_channels": 128, "vec_in_dim": None,
                   "context_in_dim": 24, "hidden_size": 32, "mlp_ratio": 3.0, "num_heads": 2, "depth": 2,
                   "depth_single_blocks": 2, "axes_dim": [4, 4, 4, 4], "theta": 2000, "patch_size": 1,
                   "qkv_bias": False, "guidance_embed": False, "global_modulation": True, "mlp_silu_act": True,
                   "ops_bias": False, "default_ref_method": "index", "ref_index_scale": 10.0, "txt_ids_dims": [3]},
                  ((1, 128, 4, 4),), (7, 24)),
    "QwenImage": Tiny({"image_model": "qwen_image", "patch_size": 2, "in_channels": 64, "out_channels": 16,
                       "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 24,
                       "axes_dims_rope": (4, 6, 6)},
                      ((1, 16, 1, 8, 8),), (7, 24)),
    "WAN21_T2V": Tiny({"image_model": "wan2.1", "dim": 32, "ffn_dim": 64, "num_heads": 2, "num_layers": 2,
                       "in_dim": 16, "out_dim": 16, "text_dim": 24, "freq_dim": 256, "patch_size": (1, 2, 2),
                       "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6,
                       "model_type": "t2v"},
                      ((1, 16, 1, 8, 8),), (7, 24)),
    "HiDream": Tiny({"image_model": "hidream", "patch_size": 2, "in_channels": 16, "out_channels": 16,
                     "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                     "caption_channels": [24, 20], "text_emb_dim": 12, "num_routed_experts": 2,
                     "num_activated_experts": 1, "axes_dims_rope": (8, 4, 4), "max_resolution": (16, 16),
                     "llama_layers": [0, 1]},
                    ((1, 16, 8, 8),), (7, 24), extra={"pooled_output": (12,), "conditioning_llama3": (2, 7, 20)}),
    "Kandinsky5": Tiny({"image_model": "kandinsky5", "in_visual_dim": 16, "out_visual_dim": 16, "in_text_dim": 24,
                        "in_text_dim2": 12, "time_dim": 16, "model_dim": 32, "ff_dim": 64, "visual_embed_dim": 132,
                        "patch_size": (1, 2, 2), "num_text_blocks": 1, "num_visual_blocks": 2, "axes_dims": (4, 6, 6)},
                       ((1, 16, 1, 8, 8),), (7, 24), extra={"pooled_output": (12,)}),
    "ErnieImage": Tiny({"image_model": "ernie", "hidden_size": 32, "num_attention_heads": 2, "num_layers": 2,
                        "ffn_hidden_size": 64, "in_channels": 128, "out_channels": 128, "patch_size": 1,
                        "text_in_dim": 24, "rope_axes_dim": (4, 6, 6)},
                       ((1, 128, 4, 4),), (7, 24)),
    "AuraFlow": Tiny({"in_channels": 4, "out_channels": 4, "patch_size": 2, "dim": 32, "n_layers": 2,
                      "n_double_layers": 1, "n_heads": 2, "global_conddim": 32, "cond_seq_dim": 24, "max_seq": 64},
                     ((1, 4, 8, 8),), (7, 24)),
    "GenmoMochi": Tiny({"image_model": "mochi_preview", "depth": 2, "patch_size": 2, "num_heads": 2,
                        "hidden_size_x": 32, "hidden_size_y": 16, "mlp_ratio_x": 384.0, "mlp_ratio_y": 4.0,
                        "learn_sigma": False, "in_channels": 12, "qk_norm": True, "qkv_bias": False, "out_bias": True,
                        "attn_drop": 0.0, "patch_embed_bias": True, "posenc_preserve_area": True,
                        "timestep_mlp_bias": True, "attend_to_padding": False, "timestep_scale": 1000.0,
                        "use_t5": True, "t5_feat_dim": 24, "t5_token_length": 7, "rope_theta": 10000.0},
                       ((1, 12, 1, 8, 8),), (7, 24),
                       fixed={"attention_mask": lambda: torch.ones(1, 7, dtype=torch.int64)}),
}


def _init_scale(name: str, p: torch.Tensor, text_path) -> float:
    fan_in = p[0].numel() if p.ndim >= 2 else 0
    if text_path is not None and p.ndim == 2 and text_path(name):
        return 0.7 / math.sqrt(fan_in)
    if fan_in > 64:
        return 0.05 * math.sqrt(64 / fan_in)
    return 0.05


def build(kind: str, dtype: torch.dtype):
    """ComfyUI's model for `kind` at its tiny config, weights in `dtype` (seeded, the same values for
    every dtype up to its rounding), wrapped in ComfyUI's ModelPatcher on the CPU. Config fields this
    ComfyUI's model class does not take are left out (``base.tiny_config_dropped``)."""
    import comfy.model_patcher
    import comfy.supported_models

    tiny = TINY[kind]
    cfg = dict(tiny.config)
    while True:   # an older ComfyUI's class lacks some of the newer config fields: left out, and named
        config = getattr(comfy.supported_models, kind)(cfg)
        config.set_inference_dtype(dtype, None)
        try:
            base = config.get_model({})
            break
        except TypeError as e:
            m = re.search(r"unexpected keyword argument '(\w+)'", str(e))
            if m is None or m.group(1) not in cfg:
                raise
            del cfg[m.group(1)]
    base.tiny_config_dropped = sorted(set(tiny.config) - set(cfg))
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in base.diffusion_model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * _init_scale(name, p, tiny.text_path))
    cpu = torch.device("cpu")
    return base, comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)


def conditioning(kind: str):
    """(positive, negative): a seeded text conditioning (and seeded extras such as a pooled output);
    the negative is zeros of the same shapes."""
    tiny = TINY[kind]
    cond = torch.randn(1, *tiny.cond, generator=torch.Generator().manual_seed(COND_SEED))
    g = torch.Generator().manual_seed(EXTRA_SEED)
    extra = {k: torch.randn(1, *shape, generator=g) for k, shape in tiny.extra.items()}
    fixed = {k: make() for k, make in tiny.fixed.items()}
    positive = [[cond, {**extra, **fixed}]]
    negative = [[torch.zeros_like(cond), {**{k: torch.zeros_like(v) for k, v in extra.items()}, **fixed}]]
    return positive, negative


def latent(kind: str):
    """The empty latent's samples: one tensor, or ComfyUI's NestedTensor of several (LTX-2)."""
    shapes = TINY[kind].latent_shapes
    if len(shapes) == 1:
        return torch.zeros(shapes[0])
    import comfy.nested_tensor

    return comfy.nested_tensor.NestedTensor([torch.zeros(s) for s in shapes])


def flat(samples) -> torch.Tensor:
    """A sampled latent as one flat tensor (a nested latent's parts one after the other)."""
    if getattr(samples, "is_nested", False):
        return torch.cat([t.flatten() for t in samples.unbind()])
    return samples.flatten()
