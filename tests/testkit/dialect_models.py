"""Tiny skeletons with ComfyUI's native module names (Flux, Flux 2, Chroma, Qwen-Image, LTX-Video, Wan,
Z-Image, HunyuanVideo 1.0 and 1.5)
and adapter files in every key dialect, with the dense delta each native module
should receive — written out by hand here, independently of
``lora_runtime.files.dialects`` (nothing in this file calls the resolver).

    make_dialect_file(dialect, model, rank=4, seed=0) -> (tensors, expected)

``tensors``: the file's tensors (keys as that dialect writes them); ``expected``:
``{native module name: dense delta [out, in], float64}`` = sum over the file's layers
of ``alpha / rank * up @ down`` placed at the rows the layer covers (halves exchanged
for diffusers' ``norm_out.linear``). No pytest imports here.

Module names and shapes follow ComfyUI's ``comfy/ldm/flux/layers.py`` + ``model.py``,
``comfy/ldm/qwen_image/model.py``, ``comfy/ldm/lightricks/model.py``,
``comfy/ldm/wan/model.py`` (small dims; no forward). Flux 2 (``global_modulation``): no biases,
SwiGLU MLPs (``img_mlp.0`` and ``linear1``'s MLP part twice the hidden width), no per-block
modulation but ``double_stream_modulation_img/txt.lin`` and ``single_stream_modulation.lin``
at the top, no ``vector_in``; diffusers names from ``Flux2Transformer2DModel``.
Chroma (``comfy/ldm/chroma``): Flux's blocks without per-block modulation, no final adaLN, the
``distilled_guidance_layer`` approximator (diffusers ``ChromaApproximator``: ``layers.N.linear_1/2``
for ComfyUI's ``in_layer/out_layer``). Z-Image (``comfy/ldm/lumina/model.py``, ``z_image_modulation``):
``layers`` / ``noise_refiner`` / ``context_refiner`` blocks with a fused ``attention.qkv``; diffusers
names after ComfyUI's ``z_image_to_diffusers`` facts. HunyuanVideo (``comfy/ldm/hunyuan_video/model.py``:
Flux's double/single blocks, a token refiner; 1.5: byT5 and vision projections, no vector_in, no
single blocks here); diffusion-pipe names after ``model_lora_keys_unet``'s renames.
"""
from __future__ import annotations

import torch
from torch import nn

# --- skeletons ------------------------------------------------------------------------


def _seq(*mods):
    return nn.Sequential(*mods)


class _MLPEmbedder(nn.Module):
    def __init__(self, i, h, bias=True):
        super().__init__()
        self.in_layer, self.out_layer = nn.Linear(i, h, bias=bias), nn.Linear(h, h, bias=bias)


class _QKNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.query_norm, self.key_norm = nn.RMSNorm(d), nn.RMSNorm(d)


class _SelfAttention(nn.Module):
    def __init__(self, h, heads, bias=True):
        super().__init__()
        self.qkv = nn.Linear(h, 3 * h, bias=bias)
        self.norm = _QKNorm(h // heads)
        self.proj = nn.Linear(h, h, bias=bias)


class _Modulation(nn.Module):
    def __init__(self, h, n, bias=True):
        super().__init__()
        self.lin = nn.Linear(h, n * h, bias=bias)


class _DoubleBlock(nn.Module):
    def __init__(self, h, heads, mlp):
        super().__init__()
        for s in ("img", "txt"):
            setattr(self, f"{s}_mod", _Modulation(h, 6))
            setattr(self, f"{s}_norm1", nn.LayerNorm(h, elementwise_affine=False))
            setattr(self, f"{s}_attn", _SelfAttention(h, heads))
            setattr(self, f"{s}_norm2", nn.LayerNorm(h, elementwise_affine=False))
            setattr(self, f"{s}_mlp", _seq(nn.Linear(h, mlp), nn.GELU(approximate="tanh"), nn.Linear(mlp, h)))


class _SingleBlock(nn.Module):
    def __init__(self, h, heads, mlp):
        super().__init__()
        self.linear1 = nn.Linear(h, 3 * h + mlp)
        self.linear2 = nn.Linear(h + mlp, h)
        self.norm = _QKNorm(h // heads)
        self.pre_norm = nn.LayerNorm(h, elementwise_affine=False)
        self.modulation = _Modulation(h, 3)


class _LastLayer(nn.Module):
    def __init__(self, h, out, bias=True):
        super().__init__()
        self.norm_final = nn.LayerNorm(h, elementwise_affine=False)
        self.linear = nn.Linear(h, out, bias=bias)
        self.adaLN_modulation = _seq(nn.SiLU(), nn.Linear(h, 2 * h, bias=bias))


class TinyFlux(nn.Module):
    """Flux.1 (dev) names: hidden 32, 2 heads, mlp ratio 4, 2 double + 2 single blocks."""

    def __init__(self, hidden=32, heads=2, mlp_ratio=4, depth=2, depth_single=2, in_ch=16, ctx=24, vec=12,
                 t_dim=8):
        super().__init__()
        self.hidden_size, self.mlp_hidden = hidden, hidden * mlp_ratio
        h, mlp = hidden, hidden * mlp_ratio
        self.img_in = nn.Linear(in_ch, h)
        self.time_in = _MLPEmbedder(t_dim, h)
        self.vector_in = _MLPEmbedder(vec, h)
        self.guidance_in = _MLPEmbedder(t_dim, h)
        self.txt_in = nn.Linear(ctx, h)
        self.double_blocks = nn.ModuleList(_DoubleBlock(h, heads, mlp) for _ in range(depth))
        self.single_blocks = nn.ModuleList(_SingleBlock(h, heads, mlp) for _ in range(depth_single))
        self.final_layer = _LastLayer(h, in_ch)


class _Flux2DoubleBlock(nn.Module):
    def __init__(self, h, heads, mlp):
        super().__init__()
        for s in ("img", "txt"):
            setattr(self, f"{s}_norm1", nn.LayerNorm(h, elementwise_affine=False))
            setattr(self, f"{s}_attn", _SelfAttention(h, heads, bias=False))
            setattr(self, f"{s}_norm2", nn.LayerNorm(h, elementwise_affine=False))
            setattr(self, f"{s}_mlp", _seq(nn.Linear(h, 2 * mlp, bias=False), nn.SiLU(),
                                           nn.Linear(mlp, h, bias=False)))


class _Flux2SingleBlock(nn.Module):
    def __init__(self, h, heads, mlp):
        super().__init__()
        self.linear1 = nn.Linear(h, 3 * h + 2 * mlp, bias=False)
        self.linear2 = nn.Linear(h + mlp, h, bias=False)
        self.norm = _QKNorm(h // heads)
        self.pre_norm = nn.LayerNorm(h, elementwise_affine=False)


class TinyFlux2(nn.Module):
    """Flux 2 names (global modulation, bias-free): hidden 32, 2 heads, mlp ratio 3,
    2 double + 2 single blocks; `guidance=False` is the Klein layout (no guidance_in)."""

    def __init__(self, hidden=32, heads=2, mlp_ratio=3, depth=2, depth_single=2, in_ch=16, ctx=24, t_dim=8,
                 guidance=True):
        super().__init__()
        self.hidden_size, self.mlp_hidden = hidden, hidden * mlp_ratio
        h, mlp = hidden, hidden * mlp_ratio
        self.img_in = nn.Linear(in_ch, h, bias=False)
        self.time_in = _MLPEmbedder(t_dim, h, bias=False)
        if guidance:
            self.guidance_in = _MLPEmbedder(t_dim, h, bias=False)
        self.txt_in = nn.Linear(ctx, h, bias=False)
        self.double_stream_modulation_img = _Modulation(h, 6, bias=False)
        self.double_stream_modulation_txt = _Modulation(h, 6, bias=False)
        self.single_stream_modulation = _Modulation(h, 3, bias=False)
        self.double_blocks = nn.ModuleList(_Flux2DoubleBlock(h, heads, mlp) for _ in range(depth))
        self.single_blocks = nn.ModuleList(_Flux2SingleBlock(h, heads, mlp) for _ in range(depth_single))
        self.final_layer = _LastLayer(h, in_ch, bias=False)


class _QwenAttention(nn.Module):
    def __init__(self, d, head_dim):
        super().__init__()
        for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            setattr(self, n, nn.RMSNorm(head_dim))
        for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            setattr(self, n, nn.Linear(d, d))
        self.to_out = nn.ModuleList([nn.Linear(d, d), nn.Dropout(0.0)])
        self.to_add_out = nn.Linear(d, d)


class _GELUProj(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.proj = nn.Linear(i, o)


class _QwenFF(nn.Module):
    def __init__(self, d, inner):
        super().__init__()
        self.net = nn.ModuleList([_GELUProj(d, inner), nn.Dropout(0.0), nn.Linear(inner, d)])


class _QwenBlock(nn.Module):
    def __init__(self, d, head_dim):
        super().__init__()
        self.img_mod = _seq(nn.SiLU(), nn.Linear(d, 6 * d))
        self.img_norm1 = nn.LayerNorm(d, elementwise_affine=False)
        self.img_norm2 = nn.LayerNorm(d, elementwise_affine=False)
        self.img_mlp = _QwenFF(d, 4 * d)
        self.txt_mod = _seq(nn.SiLU(), nn.Linear(d, 6 * d))
        self.txt_norm1 = nn.LayerNorm(d, elementwise_affine=False)
        self.txt_norm2 = nn.LayerNorm(d, elementwise_affine=False)
        self.txt_mlp = _QwenFF(d, 4 * d)
        self.attn = _QwenAttention(d, head_dim)


class _TimestepEmbedding(nn.Module):
    def __init__(self, i, d):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(i, d), nn.Linear(d, d)


class TinyQwenImage(nn.Module):
    """QwenImageTransformer2DModel names (ComfyUI): dim 32 (2 heads x 16), 2 blocks."""

    def __init__(self, heads=2, head_dim=16, depth=2, in_ch=16, joint=24, t_dim=8, patch=2, out_ch=4):
        super().__init__()
        d = heads * head_dim
        self.time_text_embed = nn.Module()
        self.time_text_embed.timestep_embedder = _TimestepEmbedding(t_dim, d)
        self.txt_norm = nn.RMSNorm(joint)
        self.img_in = nn.Linear(in_ch, d)
        self.txt_in = nn.Linear(joint, d)
        self.transformer_blocks = nn.ModuleList(_QwenBlock(d, head_dim) for _ in range(depth))
        self.norm_out = nn.Module()
        self.norm_out.linear = nn.Linear(d, 2 * d)
        self.norm_out.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.proj_out = nn.Linear(d, patch * patch * out_ch)


class _LTXAttention(nn.Module):
    def __init__(self, d, ctx):
        super().__init__()
        self.q_norm, self.k_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(ctx, d), nn.Linear(ctx, d)
        self.to_out = _seq(nn.Linear(d, d), nn.Dropout(0.0))


class _LTXBlock(nn.Module):
    def __init__(self, d, ctx):
        super().__init__()
        self.attn1 = _LTXAttention(d, d)
        self.ff = nn.Module()
        self.ff.net = _seq(_GELUProj(d, 4 * d), nn.Dropout(0.0), nn.Linear(4 * d, d))
        self.attn2 = _LTXAttention(d, ctx)
        self.scale_shift_table = nn.Parameter(torch.zeros(6, d))


class TinyLTXVideo(nn.Module):
    """LTXVModel names (ComfyUI comfy/ldm/lightricks/model.py): inner 32, 2 blocks."""

    def __init__(self, d=32, depth=2, in_ch=16, caption=24, t_dim=8):
        super().__init__()
        self.patchify_proj = nn.Linear(in_ch, d)
        self.adaln_single = nn.Module()
        self.adaln_single.emb = nn.Module()
        self.adaln_single.emb.timestep_embedder = _TimestepEmbedding(t_dim, d)
        self.adaln_single.linear = nn.Linear(d, 6 * d)
        self.caption_projection = nn.Module()
        self.caption_projection.linear_1 = nn.Linear(caption, d)
        self.caption_projection.linear_2 = nn.Linear(d, d)
        self.transformer_blocks = nn.ModuleList(_LTXBlock(d, d) for _ in range(depth))
        self.scale_shift_table = nn.Parameter(torch.zeros(2, d))
        self.norm_out = nn.LayerNorm(d, elementwise_affine=False)
        self.proj_out = nn.Linear(d, in_ch)


class _WanAttn(nn.Module):
    def __init__(self, d, img=False):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.norm_q, self.norm_k = nn.RMSNorm(d), nn.RMSNorm(d)
        if img:
            self.k_img, self.v_img = nn.Linear(d, d), nn.Linear(d, d)
            self.norm_k_img = nn.RMSNorm(d)


class _WanBlock(nn.Module):
    def __init__(self, d, f, i2v):
        super().__init__()
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False)
        self.self_attn = _WanAttn(d)
        self.norm3 = nn.LayerNorm(d, elementwise_affine=True)
        self.cross_attn = _WanAttn(d, img=i2v)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False)
        self.ffn = _seq(nn.Linear(d, f), nn.GELU(approximate="tanh"), nn.Linear(f, d))
        self.modulation = nn.Parameter(torch.zeros(1, 6, d))


class TinyWan(nn.Module):
    """WanModel names (ComfyUI comfy/ldm/wan/model.py), I2V variant: dim 32, 2 blocks."""

    def __init__(self, d=32, f=64, depth=2, in_dim=4, text_dim=24, freq=8, out_dim=4, i2v=True, clip=20):
        super().__init__()
        self.patch_embedding = nn.Conv3d(in_dim, d, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        self.text_embedding = _seq(nn.Linear(text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
        self.time_embedding = _seq(nn.Linear(freq, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = _seq(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList(_WanBlock(d, f, i2v) for _ in range(depth))
        self.head = nn.Module()
        self.head.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.head.head = nn.Linear(d, out_dim * 4)
        self.head.modulation = nn.Parameter(torch.zeros(1, 2, d))
        if i2v:
            self.img_emb = nn.Module()
            self.img_emb.proj = _seq(nn.LayerNorm(clip), nn.Linear(clip, clip), nn.GELU(), nn.Linear(clip, d),
                                     nn.LayerNorm(d))


class _ChromaDoubleBlock(_DoubleBlock):
    def __init__(self, h, heads, mlp):
        super().__init__(h, heads, mlp)
        del self.img_mod, self.txt_mod


class _ChromaSingleBlock(_SingleBlock):
    def __init__(self, h, heads, mlp):
        super().__init__(h, heads, mlp)
        del self.modulation


class _Approximator(nn.Module):
    def __init__(self, i, h, out, n):
        super().__init__()
        self.in_proj = nn.Linear(i, h)
        self.layers = nn.ModuleList(_MLPEmbedder(h, h) for _ in range(n))
        self.norms = nn.ModuleList(nn.RMSNorm(h) for _ in range(n))
        self.out_proj = nn.Linear(h, out)


class TinyChroma(nn.Module):
    """Chroma names (ComfyUI comfy/ldm/chroma): hidden 32, 2 heads, 2 double + 2 single blocks, a
    2-layer approximator."""

    def __init__(self, hidden=32, heads=2, mlp_ratio=4, depth=2, depth_single=2, in_ch=16, ctx=24, approx_in=8,
                 approx_hidden=40, approx_layers=2):
        super().__init__()
        self.hidden_size, self.mlp_hidden = hidden, hidden * mlp_ratio
        h, mlp = hidden, hidden * mlp_ratio
        self.img_in = nn.Linear(in_ch, h)
        self.txt_in = nn.Linear(ctx, h)
        self.distilled_guidance_layer = _Approximator(approx_in, approx_hidden, h, approx_layers)
        self.double_blocks = nn.ModuleList(_ChromaDoubleBlock(h, heads, mlp) for _ in range(depth))
        self.single_blocks = nn.ModuleList(_ChromaSingleBlock(h, heads, mlp) for _ in range(depth_single))
        self.final_layer = _LastLayer(h, in_ch)
        del self.final_layer.adaLN_modulation


class _ZAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.q_norm, self.k_norm = nn.RMSNorm(d // heads), nn.RMSNorm(d // heads)


class _ZFeedForward(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False), nn.Linear(d, f, bias=False)


class _ZBlock(nn.Module):
    def __init__(self, d, heads, f, modulation, t_dim):
        super().__init__()
        self.attention = _ZAttention(d, heads)
        self.feed_forward = _ZFeedForward(d, f)
        for n in ("attention_norm1", "ffn_norm1", "attention_norm2", "ffn_norm2"):
            setattr(self, n, nn.RMSNorm(d))
        if modulation:
            self.adaLN_modulation = _seq(nn.Linear(t_dim, 4 * d))


class TinyZImage(nn.Module):
    """NextDiT with Z-Image's modulation (ComfyUI comfy/ldm/lumina/model.py): dim 32, 2 heads, 2 layers,
    2 noise-refiner and 2 context-refiner blocks, patch 2, 4 channels."""

    def __init__(self, d=32, heads=2, depth=2, refiners=2, f=64, in_ch=4, patch=2, cap=24, t_dim=32, freq=16):
        super().__init__()
        self.dim = d
        self.x_embedder = nn.Linear(patch * patch * in_ch, d)
        self.noise_refiner = nn.ModuleList(_ZBlock(d, heads, f, True, t_dim) for _ in range(refiners))
        self.context_refiner = nn.ModuleList(_ZBlock(d, heads, f, False, t_dim) for _ in range(refiners))
        self.t_embedder = nn.Module()
        self.t_embedder.mlp = _seq(nn.Linear(freq, t_dim), nn.SiLU(), nn.Linear(t_dim, t_dim))
        self.cap_embedder = _seq(nn.RMSNorm(cap), nn.Linear(cap, d))
        self.layers = nn.ModuleList(_ZBlock(d, heads, f, True, t_dim) for _ in range(depth))
        self.final_layer = nn.Module()
        self.final_layer.norm_final = nn.LayerNorm(d, elementwise_affine=False)
        self.final_layer.linear = nn.Linear(d, patch * patch * in_ch)
        self.final_layer.adaLN_modulation = _seq(nn.SiLU(), nn.Linear(t_dim, d))
        self.x_pad_token = nn.Parameter(torch.zeros(1, d))
        self.cap_pad_token = nn.Parameter(torch.zeros(1, d))


class _RefinerBlock(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.adaLN_modulation = _seq(nn.SiLU(), nn.Linear(h, 2 * h))
        self.norm1 = nn.LayerNorm(h)
        self.self_attn = nn.Module()
        self.self_attn.qkv = nn.Linear(h, 3 * h)
        self.self_attn.proj = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h)
        self.mlp = _seq(nn.Linear(h, 4 * h), nn.SiLU(), nn.Linear(4 * h, h))


class _TokenRefiner(nn.Module):
    def __init__(self, ctx, h, blocks, t_dim):
        super().__init__()
        self.input_embedder = nn.Linear(ctx, h)
        self.t_embedder = _MLPEmbedder(t_dim, h)
        self.c_embedder = _MLPEmbedder(ctx, h)
        self.individual_token_refiner = nn.Module()
        self.individual_token_refiner.blocks = nn.ModuleList(_RefinerBlock(h) for _ in range(blocks))


class TinyHunyuanVideo(nn.Module):
    """HunyuanVideo names (ComfyUI comfy/ldm/hunyuan_video/model.py): hidden 32, 2 heads, 2 double +
    2 single blocks, a 2-block token refiner. ``v15=True``: HunyuanVideo 1.5's layout (no vector_in
    or guidance_in, no single blocks, byT5 and vision projections, cond_type_embedding)."""

    def __init__(self, hidden=32, heads=2, mlp_ratio=4, depth=2, depth_single=2, in_ch=16, ctx=24, vec=12,
                 t_dim=8, v15=False, byt5=20, vision=20):
        super().__init__()
        self.hidden_size, self.mlp_hidden = hidden, hidden * mlp_ratio
        h, mlp = hidden, hidden * mlp_ratio
        self.img_in = nn.Module()
        self.img_in.proj = nn.Conv3d(in_ch, h, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        self.time_in = _MLPEmbedder(t_dim, h)
        if not v15:
            self.vector_in = _MLPEmbedder(vec, h)
            self.guidance_in = _MLPEmbedder(t_dim, h)
        self.txt_in = _TokenRefiner(ctx, h, 2, t_dim)
        self.double_blocks = nn.ModuleList(_DoubleBlock(h, heads, mlp) for _ in range(depth))
        self.single_blocks = nn.ModuleList(_SingleBlock(h, heads, mlp) for _ in range(0 if v15 else depth_single))
        if v15:
            self.byt5_in = nn.Module()
            self.byt5_in.layernorm = nn.LayerNorm(byt5)
            self.byt5_in.fc1, self.byt5_in.fc2 = nn.Linear(byt5, 2 * h), nn.Linear(2 * h, 2 * h)
            self.byt5_in.fc3 = nn.Linear(2 * h, h)
            self.vision_in = nn.Module()
            self.vision_in.proj = _seq(nn.LayerNorm(vision), nn.Linear(vision, vision), nn.GELU(),
                                       nn.Linear(vision, h), nn.LayerNorm(h))
            self.cond_type_embedding = nn.Embedding(3, h)
        self.final_layer = _LastLayer(h, in_ch * 4)


def TinyHunyuanVideo15(**kw):
    return TinyHunyuanVideo(v15=True, **kw)


MODELS = {"Flux": TinyFlux, "Flux 2": TinyFlux2, "Qwen-Image": TinyQwenImage, "LTX-Video": TinyLTXVideo,
          "Wan": TinyWan}
# Families added with ComfyUI's key maps (tests/lora_runtime/files/test_dialect_families.py): kept apart because
# Chroma's files carry Flux's dialect labels and HunyuanVideo has no bare parameter, which the
# per-family checks over MODELS assume
MORE_MODELS = {"Chroma": TinyChroma, "Z-Image": TinyZImage, "HunyuanVideo": TinyHunyuanVideo,
               "HunyuanVideo 1.5": TinyHunyuanVideo15}
ALL_MODELS = {**MODELS, **MORE_MODELS}


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


# --- hand-written layer tables: (file name, native module, rows | None, swap) --------


def _double_attention_names(t: str, d: str, h: int) -> list[tuple[str, str, tuple[int, int] | None, bool]]:
    """A Flux (1 or 2) double block's attention in diffusers names: q/k/v thirds of the fused qkv."""
    out = []
    for j, q in enumerate(("to_q", "to_k", "to_v")):
        out.append((f"{t}.attn.{q}", f"{d}.img_attn.qkv", (j * h, (j + 1) * h), False))
    for j, q in enumerate(("add_q_proj", "add_k_proj", "add_v_proj")):
        out.append((f"{t}.attn.{q}", f"{d}.txt_attn.qkv", (j * h, (j + 1) * h), False))
    return out + [(f"{t}.attn.to_out.0", f"{d}.img_attn.proj", None, False),
                  (f"{t}.attn.to_add_out", f"{d}.txt_attn.proj", None, False)]


def flux_layers(model: TinyFlux, naming: str) -> list[tuple[str, str, tuple[int, int] | None, bool]]:
    """Every Linear of TinyFlux as one dialect names it. naming: native | diffusers | xlabs."""
    h, mlp = model.hidden_size, model.mlp_hidden
    out = []
    nd, ns = len(model.double_blocks), len(model.single_blocks)
    if naming == "native":
        return [(n, n, None, False) for n in linear_names(model)]
    if naming == "xlabs":   # XLabs / USO: attention only
        for i in range(nd):
            out += [(f"double_blocks.{i}.processor.qkv_lora1", f"double_blocks.{i}.img_attn.qkv", None, False),
                    (f"double_blocks.{i}.processor.qkv_lora2", f"double_blocks.{i}.txt_attn.qkv", None, False),
                    (f"double_blocks.{i}.processor.proj_lora1", f"double_blocks.{i}.img_attn.proj", None, False),
                    (f"double_blocks.{i}.processor.proj_lora2", f"double_blocks.{i}.txt_attn.proj", None, False)]
        for i in range(ns):
            out += [(f"single_blocks.{i}.processor.qkv_lora", f"single_blocks.{i}.linear1", (0, 3 * h), False),
                    (f"single_blocks.{i}.processor.proj_lora", f"single_blocks.{i}.linear2", None, False)]
        return out
    assert naming == "diffusers"
    for i in range(nd):
        t, d = f"transformer_blocks.{i}", f"double_blocks.{i}"
        out += _double_attention_names(t, d, h)
        out += [(f"{t}.norm1.linear", f"{d}.img_mod.lin", None, False),
                (f"{t}.norm1_context.linear", f"{d}.txt_mod.lin", None, False),
                (f"{t}.ff.net.0.proj", f"{d}.img_mlp.0", None, False),
                (f"{t}.ff.net.2", f"{d}.img_mlp.2", None, False),
                (f"{t}.ff_context.net.0.proj", f"{d}.txt_mlp.0", None, False),
                (f"{t}.ff_context.net.2", f"{d}.txt_mlp.2", None, False)]
    for i in range(ns):
        t, s = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        out += [(f"{t}.attn.to_q", f"{s}.linear1", (0, h), False),
                (f"{t}.attn.to_k", f"{s}.linear1", (h, 2 * h), False),
                (f"{t}.attn.to_v", f"{s}.linear1", (2 * h, 3 * h), False),
                (f"{t}.proj_mlp", f"{s}.linear1", (3 * h, 3 * h + mlp), False),
                (f"{t}.proj_out", f"{s}.linear2", None, False),
                (f"{t}.norm.linear", f"{s}.modulation.lin", None, False)]
    out += [("x_embedder", "img_in", None, False), ("context_embedder", "txt_in", None, False),
            ("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer", None, False),
            ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer", None, False),
            ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer", None, False),
            ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer", None, False),
            ("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer", None, False),
            ("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer", None, False),
            ("proj_out", "final_layer.linear", None, False),
            ("norm_out.linear", "final_layer.adaLN_modulation.1", None, True)]
    return out


def flux2_layers(model: TinyFlux2, naming: str) -> list[tuple[str, str, tuple[int, int] | None, bool]]:
    """Every Linear of TinyFlux2 as one naming names it. naming: native | diffusers."""
    h = model.hidden_size
    if naming == "native":
        return [(n, n, None, False) for n in linear_names(model)]
    assert naming == "diffusers"
    out = []
    for i in range(len(model.double_blocks)):
        t, d = f"transformer_blocks.{i}", f"double_blocks.{i}"
        out += _double_attention_names(t, d, h)
        out += [(f"{t}.ff.linear_in", f"{d}.img_mlp.0", None, False),
                (f"{t}.ff.linear_out", f"{d}.img_mlp.2", None, False),
                (f"{t}.ff_context.linear_in", f"{d}.txt_mlp.0", None, False),
                (f"{t}.ff_context.linear_out", f"{d}.txt_mlp.2", None, False)]
    for i in range(len(model.single_blocks)):
        t, s = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        out += [(f"{t}.attn.to_qkv_mlp_proj", f"{s}.linear1", None, False),
                (f"{t}.attn.to_out", f"{s}.linear2", None, False)]
    out += [("x_embedder", "img_in", None, False), ("context_embedder", "txt_in", None, False),
            ("time_guidance_embed.timestep_embedder.linear_1", "time_in.in_layer", None, False),
            ("time_guidance_embed.timestep_embedder.linear_2", "time_in.out_layer", None, False),
            ("double_stream_modulation_img.linear", "double_stream_modulation_img.lin", None, False),
            ("double_stream_modulation_txt.linear", "double_stream_modulation_txt.lin", None, False),
            ("single_stream_modulation.linear", "single_stream_modulation.lin", None, False),
            ("proj_out", "final_layer.linear", None, False),
            ("norm_out.linear", "final_layer.adaLN_modulation.1", None, True)]
    if hasattr(model, "guidance_in"):
        out += [("time_guidance_embed.guidance_embedder.linear_1", "guidance_in.in_layer", None, False),
                ("time_guidance_embed.guidance_embedder.linear_2", "guidance_in.out_layer", None, False)]
    return out


def qwen_layers(model: TinyQwenImage, naming: str):
    return [(n, n, None, False) for n in linear_names(model)]   # ComfyUI uses diffusers' names


_LTX_TO_DIFFUSERS = [("patchify_proj", "proj_in"), ("adaln_single.", "time_embed.")]


def ltx_layers(model: TinyLTXVideo, naming: str):
    out = []
    for n in linear_names(model):
        f = n
        if naming == "diffusers":
            for a, b in _LTX_TO_DIFFUSERS:
                if f.startswith(a):
                    f = b + f[len(a):]
        out.append((f, n, None, False))
    return out


_WAN_TO_DIFFUSERS = [(".self_attn.q", ".attn1.to_q"), (".self_attn.k", ".attn1.to_k"), (".self_attn.v", ".attn1.to_v"),
                     (".self_attn.o", ".attn1.to_out.0"), (".cross_attn.q", ".attn2.to_q"),
                     (".cross_attn.k", ".attn2.to_k"), (".cross_attn.v", ".attn2.to_v"),
                     (".cross_attn.o", ".attn2.to_out.0"), (".cross_attn.k_img", ".attn2.add_k_proj"),
                     (".cross_attn.v_img", ".attn2.add_v_proj"), (".ffn.0", ".ffn.net.0.proj"),
                     (".ffn.2", ".ffn.net.2")]
_WAN_TOP = {"head.head": "proj_out", "time_embedding.0": "condition_embedder.time_embedder.linear_1",
            "time_embedding.2": "condition_embedder.time_embedder.linear_2",
            "time_projection.1": "condition_embedder.time_proj",
            "text_embedding.0": "condition_embedder.text_embedder.linear_1",
            "text_embedding.2": "condition_embedder.text_embedder.linear_2",
            "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
            "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2"}


def wan_layers(model: TinyWan, naming: str):
    out = []
    for n in linear_names(model):
        f = n
        if naming == "diffusers":
            f = _WAN_TOP.get(n, n)
            for a, b in _WAN_TO_DIFFUSERS:
                if n.endswith(a):
                    f = n[: -len(a)] + b
        out.append((f, n, None, False))
    return out


def chroma_layers(model: TinyChroma, naming: str):
    """Every Linear of TinyChroma: native, or diffusers (Flux's diffusers names of the modules Chroma
    has, and the approximator's PixArt-style layers)."""
    if naming == "native":
        return [(n, n, None, False) for n in linear_names(model)]
    have = set(linear_names(model))
    out = [e for e in flux_layers(model, "diffusers") if e[1] in have]
    out += [("distilled_guidance_layer.in_proj", "distilled_guidance_layer.in_proj", None, False),
            ("distilled_guidance_layer.out_proj", "distilled_guidance_layer.out_proj", None, False)]
    for i in range(len(model.distilled_guidance_layer.layers)):
        a = f"distilled_guidance_layer.layers.{i}"
        out += [(f"{a}.linear_1", f"{a}.in_layer", None, False), (f"{a}.linear_2", f"{a}.out_layer", None, False)]
    assert {e[1] for e in out} == have
    return out


# Z-Image diffusers names that differ from ComfyUI's (z_image_to_diffusers facts)
_Z_TOP = {"x_embedder": "all_x_embedder.2-1", "final_layer.linear": "all_final_layer.2-1.linear",
          "final_layer.adaLN_modulation.1": "all_final_layer.2-1.adaLN_modulation.1"}


def zimage_layers(model: TinyZImage, naming: str):
    """Every Linear of TinyZImage; diffusers: q/k/v thirds (dim rows each) of attention.qkv,
    to_out.0 for attention.out, all_x_embedder.2-1 / all_final_layer.2-1.* at the top."""
    if naming == "native":
        return [(n, n, None, False) for n in linear_names(model)]
    d = model.dim
    out = []
    for n in linear_names(model):
        if n.endswith(".attention.qkv"):
            b = n[: -len("qkv")]
            out += [(f"{b}to_q", n, (0, d), False), (f"{b}to_k", n, (d, 2 * d), False),
                    (f"{b}to_v", n, (2 * d, 3 * d), False)]
        elif n.endswith(".attention.out"):
            out.append((n[: -len("out")] + "to_out.0", n, None, False))
        else:
            out.append((_Z_TOP.get(n, n), n, None, False))
    return out


# HunyuanVideo: the original release's names (diffusion-pipe) for ComfyUI's, per name part
_HV_PIPE = [("_mod.lin", "_mod.linear"), ("_attn.qkv", "_attn_qkv"), ("_attn.proj", "_attn_proj"),
            ("mlp.0", "mlp.fc1"), ("mlp.2", "mlp.fc2"), (".modulation.lin", ".modulation.linear")]


def hunyuan_layers(model: TinyHunyuanVideo, naming: str):
    """Every Linear of TinyHunyuanVideo: native, or diffusion-pipe (img/txt_mod.linear, img_attn_qkv,
    img_attn_proj, img_mlp.fc1/fc2, modulation.linear, refiner self_attn_qkv/_proj, mlp.fc1/fc2)."""
    out = []
    for n in linear_names(model):
        f = n
        if naming == "diffusion-pipe":
            for a, b in _HV_PIPE:
                if f.endswith(a) or (a + ".") in f:
                    f = f.replace(a, b)
        out.append((f, n, None, False))
    return out


# --- dialects: family, layer naming, how a name is written, key style, expected label ---

def _dots(prefix):
    return lambda name: prefix + name


def _flat(prefix):
    return lambda name: prefix + name.replace(".", "_")


KOHYA, PEFT, XLABS = "kohya", "peft", "xlabs"

# name -> (family, naming, stem writer, key style, the label dialect_name should give)
DIALECT_FILES = {
    "Flux BFL native": ("Flux", "native", _dots("diffusion_model."), KOHYA, "Flux BFL native"),
    "Flux kohya": ("Flux", "native", _flat("lora_unet_"), KOHYA, "Flux kohya"),
    "Flux diffusers": ("Flux", "diffusers", _dots("transformer."), PEFT, "Flux diffusers"),
    "Flux ai-toolkit": ("Flux", "diffusers", _dots("transformer."), PEFT, "Flux diffusers"),
    "Flux fal": ("Flux", "diffusers", _dots("transformer."), PEFT, "Flux diffusers"),
    "Flux DiffSynth": ("Flux", "diffusers", _dots(""), PEFT, "Flux diffusers"),
    "Flux kohya-diffusers (OneTrainer)": ("Flux", "diffusers", _flat("lora_transformer_"), KOHYA,
                                          "Flux kohya-diffusers (OneTrainer)"),
    "Flux LyCORIS (SimpleTuner)": ("Flux", "diffusers", _flat("lycoris_"), KOHYA, "Flux LyCORIS (SimpleTuner)"),
    "Flux XLabs": ("Flux", "xlabs", _dots(""), XLABS, "Flux XLabs"),
    "Flux 2 BFL native": ("Flux 2", "native", _dots("diffusion_model."), KOHYA, "Flux BFL native"),
    "Flux 2 kohya": ("Flux 2", "native", _flat("lora_unet_"), KOHYA, "Flux kohya"),
    "Flux 2 diffusers": ("Flux 2", "diffusers", _dots("transformer."), PEFT, "Flux diffusers"),
    "Flux 2 LyCORIS (SimpleTuner)": ("Flux 2", "diffusers", _flat("lycoris_"), KOHYA, "Flux LyCORIS (SimpleTuner)"),
    "Qwen-Image diffusers": ("Qwen-Image", "diffusers", _dots("transformer."), PEFT, "Qwen-Image diffusers"),
    "Qwen-Image native": ("Qwen-Image", "native", _dots("diffusion_model."), KOHYA, "Qwen-Image native"),
    "Qwen-Image kohya": ("Qwen-Image", "native", _flat("lora_unet_"), KOHYA, "Qwen-Image kohya"),
    "Qwen-Image LyCORIS (SimpleTuner)": ("Qwen-Image", "native", _flat("lycoris_"), KOHYA,
                                         "Qwen-Image LyCORIS (SimpleTuner)"),
    "LTX-Video diffusers": ("LTX-Video", "diffusers", _dots("transformer."), PEFT, "LTX-Video diffusers"),
    "LTX-Video native": ("LTX-Video", "native", _dots("diffusion_model."), KOHYA, "LTX-Video native"),
    "LTX-Video kohya": ("LTX-Video", "native", _flat("lora_unet_"), KOHYA, "LTX-Video kohya"),
    "Wan native": ("Wan", "native", _dots("diffusion_model."), KOHYA, "Wan native"),
    "Wan kohya": ("Wan", "native", _flat("lora_unet_"), KOHYA, "Wan kohya"),
    "Wan VideoX-Fun": ("Wan", "native", _flat("lora_unet__"), KOHYA, "Wan VideoX-Fun"),
    "Wan PEFT": ("Wan", "native", _dots("base_model.model."), PEFT, "Wan PEFT"),
    "Wan diffusers": ("Wan", "diffusers", _dots("transformer."), PEFT, "Wan diffusers"),
}

# name -> as DIALECT_FILES, for MORE_MODELS' families
MORE_DIALECT_FILES = {
    "Chroma native": ("Chroma", "native", _dots("diffusion_model."), KOHYA, "Flux BFL native"),
    "Chroma diffusers": ("Chroma", "diffusers", _dots("transformer."), PEFT, "Flux diffusers"),
    "Chroma kohya-diffusers (OneTrainer)": ("Chroma", "diffusers", _flat("lora_transformer_"), KOHYA,
                                            "Flux kohya-diffusers (OneTrainer)"),
    "Z-Image native": ("Z-Image", "native", _dots("diffusion_model."), KOHYA, "Z-Image native"),
    "Z-Image kohya": ("Z-Image", "native", _flat("lora_unet_"), KOHYA, "Z-Image kohya"),
    "Z-Image diffusers": ("Z-Image", "diffusers", _dots("transformer."), PEFT, "Z-Image diffusers"),
    "Z-Image LyCORIS": ("Z-Image", "diffusers", _flat("lycoris_"), KOHYA, "Z-Image LyCORIS"),
    "HunyuanVideo native": ("HunyuanVideo", "native", _dots("diffusion_model."), KOHYA, "HunyuanVideo native"),
    "HunyuanVideo kohya": ("HunyuanVideo", "native", _flat("lora_unet_"), KOHYA, "HunyuanVideo kohya"),
    "HunyuanVideo diffusion-pipe": ("HunyuanVideo", "diffusion-pipe", _dots("transformer."), PEFT,
                                    "HunyuanVideo diffusion-pipe"),
    "HunyuanVideo 1.5 native": ("HunyuanVideo 1.5", "native", _dots("diffusion_model."), KOHYA,
                                "HunyuanVideo native"),
    "HunyuanVideo 1.5 diffusion-pipe": ("HunyuanVideo 1.5", "diffusion-pipe", _dots("transformer."), PEFT,
                                        "HunyuanVideo diffusion-pipe"),
    # read in the file's naming (a name both namings share takes the label the file's other names show)
    "Z-Image diffusers (diffusion_model.)": ("Z-Image", "diffusers", _dots("diffusion_model."), PEFT,
                                             "Z-Image diffusers"),
    "Z-Image diffusers (bare)": ("Z-Image", "diffusers", _dots(""), PEFT, "Z-Image diffusers"),
    "HunyuanVideo diffusion-pipe (diffusion_model.)": ("HunyuanVideo", "diffusion-pipe", _dots("diffusion_model."),
                                                       PEFT, "HunyuanVideo diffusion-pipe"),
    "HunyuanVideo musubi-tuner": ("HunyuanVideo", "diffusion-pipe", _flat("lora_unet_"), KOHYA,
                                  "HunyuanVideo musubi-tuner"),
}
# MORE_DIALECT_FILES whose shared names `resolve` alone (no file) labels by their prefix, not as the file
FILE_CONTEXT_LABELS = {"Z-Image diffusers (diffusion_model.)", "Z-Image diffusers (bare)",
                       "HunyuanVideo diffusion-pipe (diffusion_model.)", "HunyuanVideo musubi-tuner"}

_LAYERS = {"Flux": flux_layers, "Flux 2": flux2_layers, "Chroma": chroma_layers, "Qwen-Image": qwen_layers,
           "LTX-Video": ltx_layers, "Wan": wan_layers, "Z-Image": zimage_layers, "HunyuanVideo": hunyuan_layers,
           "HunyuanVideo 1.5": hunyuan_layers}


def _dialect(dialect: str):
    return DIALECT_FILES[dialect] if dialect in DIALECT_FILES else MORE_DIALECT_FILES[dialect]


def dialect_layers(dialect: str, model: nn.Module) -> list[tuple[str, str, tuple[int, int] | None, bool]]:
    """[(stem as written in the file, native module, rows | None, swap halves)]."""
    family, naming, write, _, _ = _dialect(dialect)
    return [(write(f), n, rows, swap) for f, n, rows, swap in _LAYERS[family](model, naming)]


def make_dialect_file(dialect: str, model: nn.Module, rank: int = 4, seed: int = 0
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(tensors of an adapter file in `dialect` for `model`, expected dense delta per native
    module, float64 [out, in]). kohya-style files carry alpha = rank / 2 (scale 0.5), PEFT
    and XLabs files none (scale 1)."""
    _, _, _, style, _ = _dialect(dialect)
    g = torch.Generator().manual_seed(seed)
    mods = dict(model.named_modules())
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for stem, native, rows, swap in dialect_layers(dialect, model):
        w = mods[native].weight
        out_f, in_f = w.shape
        lo, hi = rows if rows is not None else (0, out_f)
        down = torch.randn(rank, in_f, generator=g) * 0.1
        up = torch.randn(hi - lo, rank, generator=g) * 0.1
        scale = 1.0
        if style == KOHYA:
            alpha = rank / 2
            scale = alpha / rank
            tensors[f"{stem}.lora_down.weight"] = down
            tensors[f"{stem}.lora_up.weight"] = up
            tensors[f"{stem}.alpha"] = torch.tensor(alpha)
        elif style == PEFT:
            tensors[f"{stem}.lora_A.weight"] = down
            tensors[f"{stem}.lora_B.weight"] = up
        else:
            tensors[f"{stem}.down.weight"] = down
            tensors[f"{stem}.up.weight"] = up
        d = scale * (up.double() @ down.double())
        if swap:
            half = d.shape[0] // 2
            d = torch.cat([d[half:], d[:half]])
        full = expected.setdefault(native, torch.zeros(out_f, in_f, dtype=torch.float64))
        full[lo:hi] += d
    return tensors, expected


def save_dialect_file(path, dialect: str, model: nn.Module, rank: int = 4, seed: int = 0
                      ) -> dict[str, torch.Tensor]:
    """Write `make_dialect_file`'s tensors to a safetensors file at `path`; return `expected`."""
    from safetensors.torch import save_file

    tensors, expected = make_dialect_file(dialect, model, rank, seed)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return expected
