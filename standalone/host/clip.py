"""The bundled host's CLIP: a tiny CLIP-L-shaped text encoder, its LoRA key map and patches.

What ComfyUI's CLIP object offers to a LoRA loader, on a model small enough for the CPU:

- `TinyClipTextModel`: a causal pre-LN transformer laid out like CLIP-L's
  (``clip_l.transformer.text_model.encoder.layers.N.{self_attn.{q,k,v,out}_proj,
  mlp.fc1, mlp.fc2}``, quick-GELU), built deterministically from a seed, or from a
  state dict of that layout (`from_state_dict`: the dims are read from the shapes).
  A byte-level tokenizer (BOS, the UTF-8 bytes, EOS, padded with EOS).
- `BundledCLIP`: ``cond_stage_model``, ``clone()`` (clones share the model, each has its
  own patches), ``add_patches(patches, strength_patch, strength_model)`` returning the
  keys it took, and ``encode(text)`` whose output uses the patched weights (the weights
  themselves are never written: each encode computes ``W*strength_model + sum(strength *
  delta)`` for the patched keys and runs the model functionally on them).
- `lora_key_map(model)`: file layer name -> weight key, written from the format facts:
  kohya ``lora_te_`` / ``lora_te1_text_model_encoder_layers_N_<self_attn_q_proj|..|mlp_fc1>``,
  diffusers ``text_encoder.text_model.encoder.layers.N.<self_attn.q_proj|..>``, and the
  generic ``text_encoders.<weight key without .weight>``.
- `load_lora(layers, key_map)`: the patches for the parsed text-encoder layers it maps
  (``{weight key: update}``) and why each other layer is not taken.

Its conditioning ([1, tokens, width], pooled output at the EOS) shows that a LoRA's
text-encoder part took effect; it is not the embedded Wan model's text conditioning.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

PREFIX = "clip_l.transformer.text_model."
LAYER_PARTS = {"self_attn.q_proj": "self_attn_q_proj", "self_attn.k_proj": "self_attn_k_proj",
               "self_attn.v_proj": "self_attn_v_proj", "self_attn.out_proj": "self_attn_out_proj",
               "mlp.fc1": "mlp_fc1", "mlp.fc2": "mlp_fc2"}
BOS, EOS = 256, 257
VOCAB = 258


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        b, n, w = x.shape
        q, k, v = (p(x).view(b, n, self.heads, w // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, n, w))


class _Mlp(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(1.702 * h))  # CLIP's quick-GELU


class _Layer(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int):
        super().__init__()
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.self_attn, self.mlp = _Attention(width, heads), _Mlp(width, hidden)

    def forward(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _TextModel(nn.Module):
    def __init__(self, width, heads, hidden, layers, tokens):
        super().__init__()
        self.embeddings = nn.Module()
        self.embeddings.token_embedding = nn.Embedding(VOCAB, width)
        self.embeddings.position_embedding = nn.Embedding(tokens, width)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(_Layer(width, heads, hidden) for _ in range(layers))
        self.final_layer_norm = nn.LayerNorm(width)


class TinyClipTextModel(nn.Module):
    """CLIP-L's text tower, small: ``width`` 64, 2 layers, 4 heads, MLP 256, 16 tokens by default."""

    def __init__(self, width: int = 64, heads: int = 4, hidden: int = 256, layers: int = 2, tokens: int = 16):
        super().__init__()
        self.tokens = tokens
        self.clip_l = nn.Module()
        self.clip_l.transformer = nn.Module()
        self.clip_l.transformer.text_model = _TextModel(width, heads, hidden, layers, tokens)

    @classmethod
    def make(cls, seed: int = 0, **dims) -> "TinyClipTextModel":
        gen = torch.Generator().manual_seed(seed)
        m = cls(**dims)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "layer_norm" in name:
                    p.copy_(torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * (0.02 if p.dim() > 1 and "embedding" in name
                                                                  else p.shape[-1] ** -0.5))
        return m.eval()

    @classmethod
    def from_state_dict(cls, sd: dict, heads: int = 4) -> "TinyClipTextModel":
        layers = 0
        while f"{PREFIX}encoder.layers.{layers}.mlp.fc1.weight" in sd:
            layers += 1
        if not layers:
            raise ValueError(f"not a CLIP-L text model state dict: no {PREFIX}encoder.layers.0.mlp.fc1.weight")
        hidden, width = sd[f"{PREFIX}encoder.layers.0.mlp.fc1.weight"].shape
        tokens = sd[f"{PREFIX}embeddings.position_embedding.weight"].shape[0]
        m = cls(width=width, heads=heads, hidden=hidden, layers=layers, tokens=tokens)
        m.load_state_dict(sd)
        return m.eval()

    def tokenize(self, text: str) -> torch.Tensor:
        ids = [BOS] + list(text.encode("utf-8"))[: self.tokens - 2] + [EOS]
        return torch.tensor([ids + [EOS] * (self.tokens - len(ids))])

    def forward(self, ids: torch.Tensor):
        tm = self.clip_l.transformer.text_model
        x = tm.embeddings.token_embedding(ids) + tm.embeddings.position_embedding.weight[: ids.shape[1]]
        for layer in tm.encoder.layers:
            x = layer(x)
        x = tm.final_layer_norm(x)
        eos = (ids == EOS).int().argmax(dim=-1)
        return x, x[torch.arange(x.shape[0]), eos]


class BundledCLIP:
    """ComfyUI's CLIP handle, for the bundled host: clones share ``cond_stage_model``."""

    def __init__(self, model: TinyClipTextModel):
        self.cond_stage_model = model
        self.patches: dict[str, list[tuple]] = {}

    def clone(self) -> "BundledCLIP":
        n = BundledCLIP(self.cond_stage_model)
        n.patches = {k: list(v) for k, v in self.patches.items()}
        return n

    def add_patches(self, patches: dict, strength_patch: float = 1.0, strength_model: float = 1.0) -> list[str]:
        """Record `patches` ({weight key: update}) on this clone; returns the keys taken
        (those the model has)."""
        sd = self.cond_stage_model.state_dict()
        taken = []
        for key, update in patches.items():
            if key in sd:
                self.patches.setdefault(key, []).append((float(strength_patch), update, float(strength_model)))
                taken.append(key)
        return taken

    def patched_weights(self) -> dict[str, torch.Tensor]:
        """The weights the encoder runs with: the model's, with this clone's patches added."""
        sd = dict(self.cond_stage_model.state_dict())
        for key, entries in self.patches.items():
            w = sd[key].float()
            for strength, update, strength_model in entries:
                if strength_model != 1.0:
                    w = w * strength_model
                w = w + strength * update.delta("cpu", torch.float32, weight=sd[key]).reshape(w.shape)
            sd[key] = w.to(sd[key].dtype)
        return sd

    def encode(self, text: str) -> list:
        m = self.cond_stage_model
        with torch.no_grad():
            cond, pooled = torch.func.functional_call(m, self.patched_weights(), (m.tokenize(text),))
        return [[cond, {"pooled_output": pooled}]]


def lora_key_map(model: nn.Module) -> dict[str, str]:
    """File layer name -> weight key of `model` (see the module docstring for the formats)."""
    out = {}
    sd = model.state_dict()
    for k in sd:
        if k.endswith(".weight"):
            out[f"text_encoders.{k[:-len('.weight')]}"] = k
    b = 0
    while f"{PREFIX}encoder.layers.{b}.mlp.fc1.weight" in sd:
        for part, kohya in LAYER_PARTS.items():
            k = f"{PREFIX}encoder.layers.{b}.{part}.weight"
            for name in (f"lora_te_text_model_encoder_layers_{b}_{kohya}",
                         f"lora_te1_text_model_encoder_layers_{b}_{kohya}",
                         f"text_encoder.text_model.encoder.layers.{b}.{part}"):
                out[name] = k
        b += 1
    return out


def load_lora(layers: dict, key_map: dict[str, str], model: nn.Module) -> tuple[dict, dict[str, str]]:
    """(patches {weight key: update}, {file layer: why not taken}) for parsed layers."""
    sd = model.state_dict()
    patches, skipped = {}, {}
    for stem, la in layers.items():
        key = key_map.get(stem)
        if key is None:
            skipped[stem] = "no such layer in this CLIP"
            continue
        if la.update is None or not la.update.has_weight_delta:
            skipped[stem] = "not a weight-matrix update (the bundled CLIP patches Linear weights only)"
            continue
        w = sd[key]
        o, i = la.update.out_features, la.update.in_features
        if o != w.shape[0] or (i is not None and i != w[0].numel()):
            skipped[stem] = f"shape [{o}, {i}] does not fit the weight {list(w.shape)} of {key}"
            continue
        patches[key] = la.update
    return patches, skipped
