"""Train the embedded default model from scratch: data, codec, text encoder, judge,
base Wan 2.1 DiT and three LoRA adapters. Deterministic (seeded), CPU only.

    python tools/train_embedded.py                 # full run, writes standalone/models/
    python tools/train_embedded.py --quick --out /tmp/emb   # a short smoke run

Stages (time printed per stage):
  data      render the glyph pools (plain for the base, outlined for the style)
  codec     PCA patch codec + learned decoder; text encoder (seeded embeddings)
  judge     CNN: digit / colour / outlined, on raw and codec-decoded glyphs
  base      Wan 2.1 T2V DiT (dim 128, ffn 512, 4 blocks), flow matching, EMA; a component of
            cross-attention k, v orthogonal to the contexts (function-preserving)
  style     rank-16 LoRA on the attention projections (not cross-attn k, v) and FFN linears -> outlined
  distill   rank-8 LoRA on cross-attention k, v: 4 steps at CFG 1 land where the base's 20 steps
            at CFG 5 do; every entry of its update below half a bf16 ulp of the weight
  eval      the figures the tests check, on the saved (bf16) files
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from comfyui_lora_runtime.standalone import embedded as E
from comfyui_lora_runtime.standalone.embedded import data as D
from comfyui_lora_runtime.standalone.embedded.codec import TinyCodec, psnr
from comfyui_lora_runtime.standalone.embedded.judge import GlyphJudge, JudgeNet
from comfyui_lora_runtime.standalone.embedded.pipeline import generate, mean_abs_diff_255
from comfyui_lora_runtime.standalone.embedded.text_encoder import MAX_TOKENS, VOCAB, TinyTextEncoder
from comfyui_lora_runtime.standalone.host.sampling import time_snr_shift
from comfyui_lora_runtime.standalone.host.wan21 import WanConfig, WanModel, load_wan_checkpoint

BASE_CONFIG = WanConfig(dim=128, ffn_dim=512, num_layers=4, num_heads=1, in_dim=16, out_dim=16,
                        text_dim=4096, freq_dim=256, patch_size=(1, 2, 2))
# The style adapter's layers: every attention projection and FFN linear except cross-attention
# k and v, whose weights carry the headroom the distilled adapter uses (inflate_cross_kv): a
# style update merged there would lose ~8 % and auto's merge would drift from dynamic.
LORA_TARGETS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
                "cross_attn.q", "cross_attn.o", "ffn.0", "ffn.2")
DIFFUSERS_NAMES = {"self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
                   "self_attn.o": "attn1.to_out.0", "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k",
                   "cross_attn.v": "attn2.to_v", "cross_attn.o": "attn2.to_out.0", "ffn.0": "ffn.net.0.proj",
                   "ffn.2": "ffn.net.2"}
SHIFT = 8.0
PAD_ID = len(VOCAB)

STAGE_TIMES: dict[str, float] = {}


def stage(name):
    def deco(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            print(f"== {name} ...", flush=True)
            out = fn(*a, **k)
            STAGE_TIMES[name] = time.perf_counter() - t0
            print(f"== {name}: {STAGE_TIMES[name]:.1f} s", flush=True)
            return out
        return run
    return deco


# ----------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------

def token_ids(digits: torch.Tensor, colours: torch.Tensor) -> torch.Tensor:
    """[N] digit, colour -> [N, MAX_TOKENS] token ids ("<colour> <digit>" + padding)."""
    n = digits.shape[0]
    ids = torch.full((n, MAX_TOKENS), PAD_ID, dtype=torch.int64)
    ids[:, 0] = colours  # VOCAB starts with the colours ...
    ids[:, 1] = len(D.COLOUR_NAMES) + digits  # ... then the digits
    return ids


def check_token_ids(te: TinyTextEncoder) -> None:
    ids = token_ids(torch.tensor([7]), torch.tensor([0]))
    assert te.token_ids(D.prompt_for(7, 0)) == ids[0].tolist(), "token layout mismatch"


@stage("data")
def make_data(args):
    pools = {}
    pools["codec"] = torch.cat([D.render_batch(args.codec_images, 11)[0],
                                D.render_batch(args.codec_images, 12, outlined=True)[0]])
    pools["plain"] = D.render_batch(args.base_images, 21)
    pools["outlined"] = D.render_batch(args.style_images, 22, outlined=True)
    print(f"   rendered {len(pools['codec'])} codec, {len(pools['plain'][0])} plain, "
          f"{len(pools['outlined'][0])} outlined glyphs", flush=True)
    return pools


@stage("codec")
def make_codec(args, pools, out: Path):
    codec = TinyCodec.fit(D.to_float(pools["codec"]))
    t0 = time.perf_counter()
    codec.fit_decoder(D.to_float(pools["codec"]), steps=args.decoder_steps, seed=args.seed + 2)
    print(f"   codec decoder: {args.decoder_steps} steps, {time.perf_counter() - t0:.0f} s", flush=True)
    codec.save(out / "embedded" / "tiny_codec.safetensors")
    te = TinyTextEncoder.make(seed=args.seed + 5)
    te.save(out / "embedded" / "tiny_text_encoder.safetensors")
    check_token_ids(te)
    latents = {}
    for key in ("plain", "outlined"):
        imgs, digits, colours = pools[key]
        z = torch.cat([codec.encode_model(D.to_float(c)) for c in imgs.split(2048)])  # [N, 16, 1, 8, 8]
        latents[key] = (z, token_ids(digits, colours))
    held = D.to_float(D.render_batch(200, 901)[0])
    print(f"   codec held-out PSNR {psnr(codec.decode(codec.encode(held)), held):.2f} dB, "
          f"latent std {float(latents['plain'][0].std()):.3f}", flush=True)
    return codec, te, latents


# ----------------------------------------------------------------------------------
# judge
# ----------------------------------------------------------------------------------

def judge_batch(codec, imgs, gen, noise_std=0.15):
    """Half of the batch goes through the codec (with latent noise) like sampled images do."""
    x = D.to_float(imgs)
    n = x.shape[0] // 2
    z = codec.encode_model(x[:n])
    z = z + noise_std * torch.rand(n, 1, 1, 1, 1, generator=gen) * torch.randn(z.shape, generator=gen)
    return torch.cat([codec.decode_model(z), x[n:]])


@stage("judge")
def train_judge(args, codec, out: Path):
    gen = torch.Generator().manual_seed(args.seed + 3)
    torch.manual_seed(args.seed + 3)
    p_imgs, p_d, p_c = D.render_batch(args.judge_images, 31)
    o_imgs, o_d, o_c = D.render_batch(args.judge_images, 32, outlined=True)
    imgs = torch.cat([p_imgs, o_imgs])
    digits, colours = torch.cat([p_d, o_d]), torch.cat([p_c, o_c])
    outl = torch.cat([torch.zeros(len(p_d), dtype=torch.int64), torch.ones(len(o_d), dtype=torch.int64)])
    net = JudgeNet()
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-4)
    steps = args.judge_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    for step in range(steps):
        idx = torch.randint(0, len(imgs), (128,), generator=gen)
        x = judge_batch(codec, imgs[idx], gen)
        ld, lc, lo = JudgeNet.split(net(x))
        loss = F.cross_entropy(ld, digits[idx]) + F.cross_entropy(lc, colours[idx]) + F.cross_entropy(lo, outl[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"   judge step {step} loss {loss.item():.4f}", flush=True)
    judge = GlyphJudge(net)
    judge.save(out / "embedded" / "glyph_judge.safetensors")
    return GlyphJudge.load(out / "embedded" / "glyph_judge.safetensors")


# ----------------------------------------------------------------------------------
# diffusion training helpers
# ----------------------------------------------------------------------------------

class GatherText(nn.Module):
    """Training-time stand-in for ``text_embedding``: embeds the 15 table rows once per
    step and gathers them by token id (same math as embedding every 4096-wide row)."""

    def __init__(self, seq: nn.Sequential, table: torch.Tensor):
        super().__init__()
        self.seq = seq
        self.register_buffer("table", table, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [B, L, 1] float token ids -> [B, L, D]
        return self.seq(self.table)[ids[..., 0].long()]


class TrainLoRA(nn.Module):
    """y = base(x) + ((x @ A^T) @ B^T) * (alpha / rank); A kaiming-uniform, B zero."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.down = nn.Parameter(torch.empty(rank, base.in_features))
        self.up = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.down, a=math.sqrt(5))

    def forward(self, x):
        return self.base(x) + (x @ self.down.T @ self.up.T) * self.scale


def attach_loras(model: WanModel, rank: int, alpha: float) -> dict[str, TrainLoRA]:
    loras = {}
    for b, block in enumerate(model.blocks):
        for target in LORA_TARGETS:
            parent_name, leaf = target.rsplit(".", 1)
            parent = block.get_submodule(parent_name)
            lora = TrainLoRA(getattr(parent, leaf), rank, alpha)
            setattr(parent, leaf, lora)
            loras[f"blocks.{b}.{target}"] = lora
    return loras


def sample_sigmas(n: int, gen: torch.Generator) -> torch.Tensor:
    """70 %: uniform t through the shift-8 map (what the sampler visits); 30 %: uniform sigma."""
    t = torch.rand(n, generator=gen)
    shifted = time_snr_shift(SHIFT, t)
    plain = torch.rand(n, generator=gen)
    pick = torch.rand(n, generator=gen) < 0.7
    return torch.where(pick, shifted, plain).clamp(1e-3, 1.0)


def flow_batch(z: torch.Tensor, ids: torch.Tensor, gen: torch.Generator, batch: int, dropout: float = 0.1):
    idx = torch.randint(0, z.shape[0], (batch,), generator=gen)
    x0 = z[idx]
    tok = ids[idx].clone()
    drop = torch.rand(batch, generator=gen) < dropout
    tok[drop] = PAD_ID  # empty prompt = unconditional
    noise = torch.randn(x0.shape, generator=gen)
    sigma = sample_sigmas(batch, gen)
    s = sigma.view(-1, 1, 1, 1, 1)
    x = s * noise + (1 - s) * x0
    return x, sigma * 1000, tok.unsqueeze(-1).float(), noise - x0


def cosine_lr(step: int, steps: int, warmup: int, floor: float = 0.05) -> float:
    if step < warmup:
        return (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))


def text_table(te: TinyTextEncoder) -> torch.Tensor:
    return te.table.clone()  # [len(VOCAB)+1, 4096]


# ----------------------------------------------------------------------------------
# base model
# ----------------------------------------------------------------------------------

@stage("base")
def train_base(args, te, latents, out: Path) -> Path:
    torch.manual_seed(args.seed + 4)
    gen = torch.Generator().manual_seed(args.seed + 4)
    model = WanModel(BASE_CONFIG)
    real_text = model.text_embedding
    model.text_embedding = GatherText(real_text, text_table(te))
    params = [p for p in model.parameters()]
    ema = [p.detach().clone() for p in params]
    decay_max = 0.999
    opt = torch.optim.AdamW(params, lr=args.base_lr, betas=(0.9, 0.99), weight_decay=0.01)
    z, ids = latents["plain"]
    steps = args.base_steps
    t0 = time.perf_counter()
    running = None
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = args.base_lr * cosine_lr(step, steps, args.warmup)
        x, t, ctx, target = flow_batch(z, ids, gen, args.batch)
        loss = F.mse_loss(model(x, t, ctx), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(decay_max, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(ema, params):
                e.mul_(decay).add_(p.detach(), alpha=1 - decay)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 100 == 0 or step == steps - 1:
            print(f"   base step {step}/{steps} loss {running:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    with torch.no_grad():
        for e, p in zip(ema, params):
            p.copy_(e)
    model.text_embedding = real_text
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    inflate_cross_kv(sd, te, args.seed + 8, args.kv_null_scale)
    path = out / "diffusion_models" / "tiny_wan_glyphs.safetensors"
    from safetensors.torch import save_file
    save_file(sd, str(path), metadata={"format": "pt"})
    n = sum(v.numel() for v in sd.values())
    print(f"   saved {path} ({n / 1e6:.2f} M parameters, bf16)", flush=True)
    return path


DISTILL_TARGETS = tuple(f"blocks.{b}.cross_attn.{t}" for b in range(BASE_CONFIG.num_layers) for t in ("k", "v"))


def context_vectors(sd: dict, te: TinyTextEncoder) -> torch.Tensor:
    """[15, dim] float64: ``text_embedding`` of every table row (each word and the padding),
    from the bf16 weights upcast, as the sampler computes it: every context token is one of these."""
    model = WanModel(BASE_CONFIG)
    model.load_state_dict({k: v.float() for k, v in sd.items()})
    with torch.no_grad():
        return model.text_embedding(te.table).to(torch.float64)


def snap_to_bf16_keeping(w: torch.Tensor, target: torch.Tensor, ctx: torch.Tensor, max_moves: int = 2000) -> torch.Tensor:
    """A bf16 matrix near ``target`` [out, in] (float64) whose products with the contexts
    ``ctx`` [in, n] stay those of ``w``: ``(W' - w) @ ctx`` small. Rounding ``target`` to the
    nearest bf16 leaves an error of up to half an ulp per entry, and with entries of +-8 that
    error moved the layers' outputs on the contexts by up to 23 %. Each move steps one entry
    per row to its bf16 neighbour above or below, the one that shrinks the row's residual
    ``(W' - w) @ ctx`` most (greedy, all rows at once), until no single step helps: every entry
    stays within a few ulps of ``target`` and the residual drops ~12x (measured)."""
    cur = target.to(torch.bfloat16).to(torch.float64)
    norms = (ctx * ctx).sum(1)  # [in]
    inf = torch.tensor(float("inf"), dtype=torch.bfloat16)
    for _ in range(max_moves):
        gain = ((cur - w) @ ctx) @ ctx.T  # [out, in]: ctx_j . residual
        r = cur.to(torch.bfloat16)
        steps = [torch.nextafter(r, inf.expand_as(r)).double() - cur, torch.nextafter(r, -inf.expand_as(r)).double() - cur]
        scores = [2 * d * gain + d * d * norms for d in steps]  # change of |residual|^2 per move
        best_up, j_up = scores[0].min(1)
        best_dn, j_dn = scores[1].min(1)
        up = best_up <= best_dn
        best, j = torch.where(up, best_up, best_dn), torch.where(up, j_up, j_dn)
        rows = torch.nonzero(best < 0).flatten()
        if len(rows) == 0:
            break
        d = torch.where(up, steps[0].gather(1, j_up[:, None])[:, 0], steps[1].gather(1, j_dn[:, None])[:, 0])
        cur[rows, j[rows]] += d[rows]
    return cur.to(torch.bfloat16).contiguous()


def inflate_cross_kv(sd: dict, te: TinyTextEncoder, seed: int, scale: float) -> None:
    """Add to every block's bf16 ``cross_attn.k`` / ``cross_attn.v`` weight [dim, dim] a
    component ``K`` of entries +-``scale``, orthogonal to every context vector the model can
    see (``K @ c = 0`` for the 15 text-embedded words): the model computes the same function,
    up to what bf16 cannot hold of ``W + K`` (``snap_to_bf16_keeping`` picks the bf16 matrix that
    keeps the layers' outputs on the contexts: ~2 % of them at +-8, where plain rounding moved
    them 23 %), but the weight's entries are ~100x larger and so is their ulp.

    Why: a real model's cross-attention sees text tokens in a small subspace of its inputs
    and carries large weights in directions they never take; that headroom is what lets a
    distilled adapter's update sit below a bf16 ulp of the weight and still matter (it acts
    on the directions the tokens do take). A dim-128 toy without it has none: a sub-ulp
    update of its linears changed the sampled latent by ~0.3 % (measured). Applied to the
    bf16-rounded weights, so a fresh run and an earlier base file give the same result."""
    ctx = context_vectors(sd, te)  # [15, dim]
    q, _ = torch.linalg.qr(ctx.T)  # [dim, 15] orthonormal basis of the context span
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for name in DISTILL_TARGETS:
        key = f"{name}.weight"
        w = sd[key].to(torch.float64)
        k = (torch.randint(0, 2, tuple(w.shape), generator=gen).to(torch.float64) * 2 - 1) * scale
        k = k - (k @ q) @ q.T
        sd[key] = snap_to_bf16_keeping(w, w + k, ctx.T)
        change = ((sd[key].to(torch.float64) - w) @ ctx.T).norm() / (w @ ctx.T).norm()
        worst = max(worst, float(change))
    print(f"   cross-attention k, v: +-{scale} component orthogonal to the contexts; largest relative "
          f"change of a layer's output on the contexts {worst:.4f}", flush=True)


def load_base_for_training(path: Path, te: TinyTextEncoder) -> WanModel:
    """The saved bf16 base, upcast to fp32 (what ComfyUI runs on the CPU), frozen."""
    model = load_wan_checkpoint(path)  # fp32, eval, requires_grad False
    model.text_embedding = GatherText(model.text_embedding, text_table(te))
    return model


def lora_tensors(loras: dict[str, TrainLoRA]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {name: (l.down.detach().to(torch.bfloat16).contiguous(), l.up.detach().to(torch.bfloat16).contiguous())
            for name, l in loras.items()}


def save_kohya(tensors, alpha: float, path: Path, meta: dict) -> None:
    from safetensors.torch import save_file
    sd = {}
    for name, (down, up) in tensors.items():
        sd[f"diffusion_model.{name}.lora_down.weight"] = down
        sd[f"diffusion_model.{name}.lora_up.weight"] = up
        sd[f"diffusion_model.{name}.alpha"] = torch.tensor(alpha, dtype=torch.bfloat16)
    save_file(sd, str(path), metadata=meta)


def save_peft(tensors, alpha: float, rank: int, path: Path, prefix: str, rename=None) -> None:
    from safetensors.torch import save_file
    sd = {}
    for name, (down, up) in tensors.items():
        if rename is not None:
            name = rename(name)
        sd[f"{prefix}{name}.lora_A.weight"] = down
        sd[f"{prefix}{name}.lora_B.weight"] = up
    # one metadata key per file: safetensors writes several in a random order, so bytes would differ run to run
    save_file(sd, str(path), metadata={"lora_adapter_metadata": json.dumps({"lora_alpha": alpha, "r": rank})})


def diffusers_name(name: str) -> str:
    _, b, target = name.split(".", 2)
    return f"blocks.{b}.{DIFFUSERS_NAMES[target]}"


# ----------------------------------------------------------------------------------
# style adapter
# ----------------------------------------------------------------------------------

@stage("style")
def train_style(args, te, latents, base_path: Path, out: Path):
    torch.manual_seed(args.seed + 6)
    gen = torch.Generator().manual_seed(args.seed + 6)
    model = load_base_for_training(base_path, te)
    loras = attach_loras(model, args.rank, args.style_alpha)
    params = [p for l in loras.values() for p in (l.down, l.up)]
    opt = torch.optim.AdamW(params, lr=args.style_lr, betas=(0.9, 0.99), weight_decay=0.0)
    z, ids = latents["outlined"]
    steps = args.style_steps
    running = None
    t0 = time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = args.style_lr * cosine_lr(step, steps, 20)
        x, t, ctx, target = flow_batch(z, ids, gen, args.batch)
        loss = F.mse_loss(model(x, t, ctx), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % 50 == 0 or step == steps - 1:
            print(f"   style step {step}/{steps} loss {running:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    tensors = lora_tensors(loras)
    meta = {"format": "pt"}
    kohya = out / "loras" / "glyph_outline_style.safetensors"
    save_kohya(tensors, args.style_alpha, kohya, meta)
    diff = out / "loras" / "glyph_outline_style_diffusers.safetensors"
    save_peft(tensors, args.style_alpha, args.rank, diff, "transformer.", rename=diffusers_name)
    return kohya, diff


# ----------------------------------------------------------------------------------
# distilled (sub-ulp) adapter
# ----------------------------------------------------------------------------------

def euler_model_space(model, z, ids, steps: int, cfg: float) -> torch.Tensor:
    """The bundled KSampler's euler / simple / shift-8 loop in model space (training-time copy,
    batched cond/uncond like ComfyUI). z: noise [B, 16, 1, 8, 8]; ids: token ids [B, L]."""
    from comfyui_lora_runtime.standalone.host.sampling import flow_sigmas
    sig = flow_sigmas(steps, "simple", SHIFT)
    x = z.clone()
    ctx = ids.unsqueeze(-1).float()
    unc = torch.full_like(ctx, PAD_ID)
    for i in range(steps):
        t = torch.full((z.shape[0],), float(sig[i]) * 1000)
        with torch.no_grad():
            if cfg == 1.0:
                v = model(x, t, ctx)
            else:
                u, c = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([unc, ctx])).chunk(2)
                v = u + cfg * (c - u)
        x = x + (sig[i + 1] - sig[i]) * v
    return x


def half_ulp_bf16(w: torch.Tensor) -> torch.Tensor:
    """Half a bf16 ulp of each entry of ``w`` (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(w.abs().clamp(min=1e-30))) - 8)


@stage("distill")
def train_distilled(args, te, latents, base_path: Path, out: Path) -> Path:
    """A few-step adapter: with it the base's 4-step, CFG-1 sampler lands where the base's
    20-step, CFG-5 sampler does. Targets (reflow): for teacher pairs (noise z, x0 = the
    teacher's 20-step CFG-5 sample from z), the student at every point x = s*z + (1-s)*x0 of
    the 4-step schedule predicts v = z - x0, so its 4 Euler steps follow the straight line
    to x0. Only the text projection is adapted, and every entry of its update is kept below
    ``--distill-ulp-fraction`` of half a bf16 ulp of the weight (a penalty), so a bf16 merge
    rounds it away while the dynamic path applies all of it."""
    torch.manual_seed(args.seed + 7)
    gen = torch.Generator().manual_seed(args.seed + 7)
    teacher = load_base_for_training(base_path, te)
    n = args.distill_pairs
    digits = torch.randint(0, 10, (n,), generator=gen)
    colours = torch.randint(0, len(D.COLOUR_NAMES), (n,), generator=gen)
    ids = token_ids(digits, colours)
    z = torch.randn(n, 16, 1, 8, 8, generator=gen)
    x0 = torch.cat([euler_model_space(teacher, z[i:i + 256], ids[i:i + 256], E.DEFAULT_STEPS, E.DEFAULT_CFG)
                    for i in range(0, n, 256)])
    print(f"   {n} teacher pairs (20 steps, CFG 5)", flush=True)
    student = teacher
    loras = {}
    for name in DISTILL_TARGETS:
        parent_name, leaf = name.rsplit(".", 1)
        parent = student.get_submodule(parent_name)
        loras[name] = TrainLoRA(getattr(parent, leaf), args.distill_rank, args.distill_alpha)
        setattr(parent, leaf, loras[name])
    hus = {n: half_ulp_bf16(l.base.weight.detach()) for n, l in loras.items()}
    params = [p for l in loras.values() for p in (l.down, l.up)]
    opt = torch.optim.AdamW(params, lr=args.distill_lr, betas=(0.9, 0.99), weight_decay=0.0)
    from comfyui_lora_runtime.standalone.host.sampling import flow_sigmas
    sig4 = flow_sigmas(args.distill_student_steps, "simple", SHIFT)[:-1]
    running = None
    for step in range(args.distill_steps):
        for g in opt.param_groups:
            g["lr"] = args.distill_lr * cosine_lr(step, args.distill_steps, 20)
        idx = torch.randint(0, n, (args.batch,), generator=gen)
        s = sig4[torch.randint(0, len(sig4), (args.batch,), generator=gen)].view(-1, 1, 1, 1, 1)
        x = s * z[idx] + (1 - s) * x0[idx]
        loss = F.mse_loss(student(x, s.flatten() * 1000, ids[idx].unsqueeze(-1).float()), z[idx] - x0[idx])
        pen = sum((F.relu((l.up @ l.down).abs() * l.scale - args.distill_ulp_fraction * hus[n])
                   / hus[n].mean()).pow(2).mean() for n, l in loras.items())
        opt.zero_grad(set_to_none=True)
        (loss + args.distill_penalty * pen).backward()
        opt.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % 50 == 0 or step == args.distill_steps - 1:
            with torch.no_grad():
                err = ref = 0.0
                for l in loras.values():
                    dw, w = (l.up @ l.down) * l.scale, l.base.weight
                    err += float(((w + dw).to(torch.bfloat16).float() - w - dw).pow(2).sum())
                    ref += float(dw.pow(2).sum())
                lost = (err / max(ref, 1e-30)) ** 0.5
            print(f"   distill step {step}/{args.distill_steps} loss {running:.4f} penalty {pen.item():.5f} "
                  f"share a bf16 merge loses {lost:.3f}", flush=True)
    path = out / "loras" / "glyph_distilled_cfg.safetensors"
    save_peft(lora_tensors(loras), args.distill_alpha, args.distill_rank, path, "base_model.model.")
    return path


# ----------------------------------------------------------------------------------
# evaluation (the figures the tests check)
# ----------------------------------------------------------------------------------

def eval_prompts(n: int) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    digits = torch.arange(n) % 10
    colours = (torch.arange(n) // 10) % len(D.COLOUR_NAMES)
    return [D.prompt_for(int(d), int(c)) for d, c in zip(digits, colours)], digits, colours


def share_lost(base_path: Path, lora_path: Path) -> float:
    from comfyui_lora_runtime.lora_runtime import AdapterSpec, LoraInjector, measure_share_lost, plan
    model = load_wan_checkpoint(base_path, dtype=torch.bfloat16)
    inj = LoraInjector(model)
    inj.apply(plan(model, [AdapterSpec(str(lora_path), 1.0)], "dynamic", "exact"))
    try:
        return measure_share_lost(list(inj.wrappers.values()))
    finally:
        inj.clear()


@stage("eval")
def evaluate(args, out: Path, base_path: Path, style_path: Path, diff_path: Path, distilled_path: Path) -> dict:
    from comfyui_lora_runtime.lora_runtime import AdapterSpec, applied, plan
    codec = TinyCodec.load(out / "embedded" / "tiny_codec.safetensors")
    te = TinyTextEncoder.load(out / "embedded" / "tiny_text_encoder.safetensors")
    judge = GlyphJudge.load(out / "embedded" / "glyph_judge.safetensors")
    m: dict[str, float] = {}
    held, hd, hc = D.render_batch(400, 1001)
    held_o, od, oc = D.render_batch(400, 1002, outlined=True)
    x, xo = D.to_float(held), D.to_float(held_o)
    m["codec_psnr_plain"] = psnr(codec.decode(codec.encode(x)), x)
    m["codec_psnr_outlined"] = psnr(codec.decode(codec.encode(xo)), xo)
    v, vo = judge(x), judge(xo)
    m["judge_digit_acc"] = float(torch.cat([v.digit == hd, vo.digit == od]).float().mean())
    m["judge_colour_acc"] = float(torch.cat([v.colour == hc, vo.colour == oc]).float().mean())
    m["judge_outline_acc"] = float(torch.cat([~v.outlined, vo.outlined]).float().mean())
    vr = judge(codec.decode(codec.encode(x)))
    m["judge_digit_acc_decoded"] = float((vr.digit == hd).float().mean())

    model = load_wan_checkpoint(base_path)
    prompts, pd, pc = eval_prompts(args.eval_images)
    kw = dict(seed=args.eval_seed, steps=E.DEFAULT_STEPS, cfg=E.DEFAULT_CFG)
    base_imgs = generate(model, te, codec, prompts, **kw)
    vb = judge(base_imgs)
    m["base_digit_agree"] = float((vb.digit == pd).float().mean())
    m["base_colour_agree"] = float((vb.colour == pc).float().mean())
    m["base_outlined"] = float(vb.outlined.float().mean())
    with applied(model, plan(model, [AdapterSpec(str(style_path), 1.0)], "dynamic", "exact")):
        style_imgs = generate(model, te, codec, prompts, **kw)
    vs = judge(style_imgs)
    m["style_outlined"] = float(vs.outlined.float().mean())
    m["style_digit_agree"] = float((vs.digit == pd).float().mean())
    m["style_colour_agree"] = float((vs.colour == pc).float().mean())
    m["style_mean_abs_diff"] = mean_abs_diff_255(style_imgs, base_imgs)
    with applied(model, plan(model, [AdapterSpec(str(diff_path), 1.0)], "dynamic", "exact")):
        diff_imgs = generate(model, te, codec, prompts, **kw)
    m["diffusers_vs_kohya_max_abs"] = float((diff_imgs - style_imgs).abs().max())
    m["distilled_share_lost_bf16"] = share_lost(base_path, distilled_path)
    m["style_share_lost_bf16"] = share_lost(base_path, style_path)
    few = dict(seed=args.eval_seed, steps=args.distill_student_steps, cfg=1.0)
    base_few = generate(model, te, codec, prompts, **few)
    with applied(model, plan(model, [AdapterSpec(str(distilled_path), 1.0)], "dynamic", "exact")):
        dist_imgs = generate(model, te, codec, prompts, **few)
    vd, vf = judge(dist_imgs), judge(base_few)
    m["distilled_4step_digit_agree"] = float((vd.digit == pd).float().mean())
    m["distilled_4step_colour_agree"] = float((vd.colour == pc).float().mean())
    m["base_4step_digit_agree"] = float((vf.digit == pd).float().mean())
    m["distilled_4step_mad_vs_base_4step"] = mean_abs_diff_255(dist_imgs, base_few)
    m["distilled_4step_mad_vs_base_20step_cfg5"] = mean_abs_diff_255(dist_imgs, base_imgs)
    m["base_4step_mad_vs_base_20step_cfg5"] = mean_abs_diff_255(base_few, base_imgs)
    if args.save_grid:
        save_grid(out / "samples.png", [base_imgs[:20], style_imgs[:20], base_few[:20], dist_imgs[:20]])
    for k, val in m.items():
        print(f"   {k}: {val:.4f}", flush=True)
    return m


def save_grid(path: Path, rows: list[torch.Tensor]) -> None:
    from PIL import Image
    grid = torch.cat([torch.cat(list(r), dim=1) for r in rows], dim=0)
    Image.fromarray((grid * 255).round().clamp(0, 255).to(torch.uint8).numpy()).save(path)


# ----------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=E.MODELS_DIR, help="output models folder (default: the pack's standalone/models/)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="a short smoke run (small pools, few steps)")
    p.add_argument("--codec-images", type=int, default=2000)
    p.add_argument("--base-images", type=int, default=40000)
    p.add_argument("--style-images", type=int, default=12000)
    p.add_argument("--decoder-steps", type=int, default=1500)
    p.add_argument("--judge-images", type=int, default=8000)
    p.add_argument("--judge-steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--base-steps", type=int, default=2500)
    p.add_argument("--base-lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--kv-null-scale", type=float, default=8.0,
                   help="magnitude of the cross-attention k/v component orthogonal to the contexts")
    p.add_argument("--rank", type=int, default=16, help="style adapter rank")
    p.add_argument("--style-steps", type=int, default=1500)
    p.add_argument("--style-lr", type=float, default=2e-3)
    p.add_argument("--style-alpha", type=float, default=16.0)
    p.add_argument("--distill-steps", type=int, default=300)
    p.add_argument("--distill-lr", type=float, default=3e-3)
    p.add_argument("--distill-rank", type=int, default=8)
    p.add_argument("--distill-alpha", type=float, default=8.0)
    p.add_argument("--distill-pairs", type=int, default=1024, help="teacher (noise, 20-step CFG-5 sample) pairs")
    p.add_argument("--distill-student-steps", type=int, default=4)
    p.add_argument("--distill-ulp-fraction", type=float, default=0.9,
                   help="bound on each entry of the update, as a fraction of half a bf16 ulp of the weight")
    p.add_argument("--distill-penalty", type=float, default=1.0)
    p.add_argument("--eval-images", type=int, default=80)
    p.add_argument("--eval-seed", type=int, default=1234)
    p.add_argument("--reuse-base", action="store_true",
                   help="keep the judge and base already in --out; retrain only the adapters (and re-evaluate)")
    p.add_argument("--save-grid", action="store_true", help="write <out>/samples.png (base / style / distilled)")
    p.add_argument("--metrics", type=Path, default=None, help="write the evaluation figures as JSON here")
    a = p.parse_args(argv)
    if a.quick:
        a.codec_images, a.base_images, a.style_images, a.judge_images = 500, 4000, 2000, 2000
        a.judge_steps, a.base_steps, a.style_steps, a.distill_steps = 150, 300, 60, 20
        a.decoder_steps, a.distill_pairs = 150, 256
        a.eval_images = 40
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out: Path = args.out
    for sub in ("diffusion_models", "loras", "embedded"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    pools = make_data(args)
    codec, te, latents = make_codec(args, pools, out)
    del pools
    base_path = out / "diffusion_models" / "tiny_wan_glyphs.safetensors"
    if args.reuse_base:  # the judge and base of an earlier run with the same settings (deterministic stages)
        print(f"== judge, base: reusing {out / 'embedded' / 'glyph_judge.safetensors'} and {base_path}")
    else:
        train_judge(args, codec, out)
        train_base(args, te, latents, out)
    style_path, diff_path = train_style(args, te, latents, base_path, out)
    distilled_path = train_distilled(args, te, latents, base_path, out)
    train_total = time.perf_counter() - t_all
    metrics = evaluate(args, out, base_path, style_path, diff_path, distilled_path)
    print("== stage times: " + ", ".join(f"{k} {v:.1f} s" for k, v in STAGE_TIMES.items()))
    print(f"== training total (without eval): {train_total:.1f} s; with eval: {time.perf_counter() - t_all:.1f} s")
    if args.metrics:
        args.metrics.write_text(json.dumps({"metrics": metrics, "stage_seconds": STAGE_TIMES,
                                            "threads": args.threads}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
