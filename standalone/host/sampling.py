"""ComfyUI-compatible flow-matching sampler for Wan 2.1 (KSampler math, CONST model).

Contract
--------
* ``model_sigmas_table(shift)``: the 1000-entry ``model_sampling.sigmas`` table of
  ComfyUI's ``ModelSamplingDiscreteFlow``, bit-exact in float32.
* ``flow_sigmas(steps, scheduler, shift, denoise)``: float32 ``[steps + 1]``
  schedule, as ComfyUI's ``KSampler`` builds it (incl. the denoise rule), for
  the schedulers in ``SCHEDULER_NAMES``.
* ``prepare_noise(latent, seed, batch_index)``: ComfyUI's seeded CPU noise, bit-exact.
  It uses a private ``torch.Generator`` (same values, global RNG untouched).
* ``sample_flow(model_fn, ...)``: the sampler loop on a *model-space* latent:
  noise scaling, cond/uncond batching, ``denoised = x - out * sigma``, CFG,
  Euler steps, inverse noise scaling. Returns model-space latents.
* ``ksampler(model, ...)``: the KSampler node: LATENT dict in, LATENT dict out
  (``process_in`` on non-zero inputs, ``process_out`` always applied to the result).

``model_fn(x, timestep, context)`` takes x ``[B, 16, T, H, W]``, timestep
``[B]`` (= sigma * 1000, float32) and context ``[B, L, 4096]``.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Optional, Sequence

import torch

from . import latent_format

logger = logging.getLogger(__name__)

SCHEDULER_NAMES = ["simple", "sgm_uniform", "karras", "beta", "normal"]
SAMPLER_NAMES = ["euler", "heun"]  # heun: k-diffusion's sample_heun with s_churn 0 (two model calls a step)

NUM_TIMESTEPS = 1000
DEFAULT_SHIFT = 8.0  # Wan 2.1 T2V sampling_settings
KARRAS_RHO = 7.0
BETA_ALPHA = BETA_BETA = 0.6

ModelFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
StepCallback = Callable[[int, int, torch.Tensor], None]


# --------------------------------------------------------------------------
# sigma schedules
# --------------------------------------------------------------------------

def time_snr_shift(shift: float, t):
    """Flow time shift ``s*t / (1 + (s-1)*t)``; identity for shift 1."""
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


def model_sigmas_table(shift: float, multiplier: float = 1000) -> torch.Tensor:
    """float32 [1000]: sigma(t_i), t_i = ((i+1)/1000 * multiplier) / multiplier, in float32 ops."""
    timesteps = (torch.arange(1, NUM_TIMESTEPS + 1) / NUM_TIMESTEPS) * multiplier  # float32
    return time_snr_shift(shift, timesteps / multiplier)


def _simple(table: torch.Tensor, steps: int) -> list[float]:
    stride = len(table) / steps
    return [float(table[-(1 + int(k * stride))]) for k in range(steps)] + [0.0]


def _normal(table: torch.Tensor, steps: int, shift: float, multiplier: float, sgm: bool) -> list[float]:
    start = float(table[-1] * multiplier)  # timestep(sigma_max)
    end = float(table[0] * multiplier)  # timestep(sigma_min)
    append_zero = True
    if sgm:
        ts = torch.linspace(start, end, steps + 1)[:-1]
    else:
        if math.isclose(float(time_snr_shift(shift, table[0] * multiplier / multiplier)), 0, abs_tol=1e-5):
            steps += 1
            append_zero = False
        ts = torch.linspace(start, end, steps)
    sigs = [float(v) for v in time_snr_shift(shift, ts / multiplier)]
    return sigs + ([0.0] if append_zero else [])


def _karras(table: torch.Tensor, steps: int) -> list[float]:
    sigma_min, sigma_max = float(table[0]), float(table[-1])
    ramp = torch.linspace(0, 1, steps)
    lo, hi = sigma_min ** (1 / KARRAS_RHO), sigma_max ** (1 / KARRAS_RHO)
    sigs = (hi + ramp * (lo - hi)) ** KARRAS_RHO
    return [float(v) for v in sigs] + [0.0]


def _beta(table: torch.Tensor, steps: int) -> list[float]:
    last = len(table) - 1
    sigs: list[float] = []
    prev = -1
    step = 1.0 / steps
    for k in range(steps):
        p = 1.0 - k * step  # == 1 - numpy.linspace(0, 1, steps, endpoint=False)[k], bit for bit
        idx = int(round_half_even(beta_ppf(p, BETA_ALPHA, BETA_BETA) * last))
        if idx != prev:
            sigs.append(float(table[idx]))
        prev = idx
    return sigs + [0.0]


def round_half_even(x: float) -> float:
    """numpy.rint semantics (Python's round is also banker's rounding)."""
    return float(round(x))


def _betainc_cf(a: float, b: float, x: float) -> float:
    """Continued fraction for the regularised incomplete beta (modified Lentz)."""
    tiny, eps = 1e-300, 1e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def beta_cdf(x: float, a: float, b: float) -> float:
    """Regularised incomplete beta I_x(a, b) in float64."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betainc_cf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betainc_cf(b, a, 1.0 - x) / b


def beta_ppf(p: float, a: float, b: float) -> float:
    """Inverse CDF of Beta(a, b) by bisection in float64 (no scipy needed)."""
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    if a == b and p == 0.5:
        return 0.5  # exact median of a symmetric beta (rint(0.5 * 999) must give 500)
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if beta_cdf(mid, a, b) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _full_schedule(steps: int, scheduler: str, shift: float, multiplier: float) -> list[float]:
    table = model_sigmas_table(shift, multiplier)
    if scheduler == "simple":
        return _simple(table, steps)
    if scheduler == "normal":
        return _normal(table, steps, shift, multiplier, sgm=False)
    if scheduler == "sgm_uniform":
        return _normal(table, steps, shift, multiplier, sgm=True)
    if scheduler == "karras":
        return _karras(table, steps)
    if scheduler == "beta":
        return _beta(table, steps)
    raise ValueError(f"unknown scheduler {scheduler!r}; supported: {SCHEDULER_NAMES}")


def flow_sigmas(steps: int, scheduler: str, shift: float = DEFAULT_SHIFT, denoise: float = 1.0,
                multiplier: float = 1000) -> torch.Tensor:
    """float32 [steps + 1] KSampler schedule; with denoise < 1 the tail of a longer one."""
    if scheduler not in SCHEDULER_NAMES:
        raise ValueError(f"unknown scheduler {scheduler!r}; supported: {SCHEDULER_NAMES}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if denoise is None or denoise > 0.9999:
        sigs = _full_schedule(steps, scheduler, shift, multiplier)
    elif denoise <= 0.0:
        sigs = []
    else:
        sigs = _full_schedule(int(steps / denoise), scheduler, shift, multiplier)[-(steps + 1):]
    return torch.tensor(sigs, dtype=torch.float32)


# --------------------------------------------------------------------------
# noise
# --------------------------------------------------------------------------

def prepare_noise(latent_samples: torch.Tensor, seed: int, batch_index: Optional[Sequence[int]] = None) -> torch.Tensor:
    """ComfyUI's KSampler noise: one CPU randn draw, or per-sample draws for batch_index."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed) & 0xFFFFFFFFFFFFFFFF)
    shape = list(latent_samples.shape)
    kw = dict(dtype=latent_samples.dtype, layout=latent_samples.layout, generator=gen, device="cpu")
    if batch_index is None:
        return torch.randn(shape, **kw)
    inds = [int(i) for i in batch_index]
    if not inds or min(inds) < 0:
        raise ValueError(f"batch_index must be a non-empty list of ints >= 0, got {batch_index!r}")
    wanted = set(inds)
    kept: dict[int, torch.Tensor] = {}
    for i in range(max(inds) + 1):  # draws 0..max in sequence; keep the wanted ones
        draw = torch.randn([1] + shape[1:], **kw)
        if i in wanted:
            kept[i] = draw
    return torch.cat([kept[i] for i in inds], dim=0)  # duplicates share one draw


# --------------------------------------------------------------------------
# sampler loop
# --------------------------------------------------------------------------

def _expand_context(ctx: torch.Tensor, batch: int) -> torch.Tensor:
    # ctx: [1 or B, L, C] -> [B, L, C] (ComfyUI repeats conditioning to the latent batch)
    if ctx.ndim != 3:
        raise ValueError(f"context must be [B, L, C], got shape {tuple(ctx.shape)}")
    if ctx.shape[0] == batch:
        return ctx
    if batch % ctx.shape[0]:
        raise ValueError(f"context batch {ctx.shape[0]} does not divide latent batch {batch}")
    return ctx.repeat(batch // ctx.shape[0], 1, 1)


def _denoise_rows(model_fn: ModelFn, x: torch.Tensor, sigma: torch.Tensor, contexts: list[torch.Tensor],
                  call=None, cond_or_uncond: Sequence[int] = (0,)) -> list[torch.Tensor]:
    """One model call on the row-stacked contexts; returns denoised per context.

    x: [B, ...]; sigma: 0-d; each context [B, L, C] (same L) -> list of [B, ...].
    `call`: the APPLY_MODEL chain (see `_model_call`), told the chunks' `cond_or_uncond`.
    """
    n = len(contexts)
    b = x.shape[0]
    x_in = torch.cat([x] * n) if n > 1 else x  # [n*B, ...]
    sig = sigma.reshape(1).expand(n * b)  # [n*B]
    context = torch.cat(contexts) if n > 1 else contexts[0]
    if call is not None:
        out = call(x_in, sig, context, list(cond_or_uncond)).float()
    else:
        timestep = sig * 1000  # float32, what the DiT receives
        out = model_fn(x_in, timestep, context).float()
    denoised = x_in - out * sig.view(-1, *([1] * (out.ndim - 1)))
    return list(denoised.chunk(n)) if n > 1 else [denoised]


def _guided_denoise(model_fn, x, sigma, pos, neg, cfg, call=None) -> torch.Tensor:
    """CFG-combined denoised prediction at one sigma (ComfyUI's sampling_function)."""
    if neg is None:
        return _denoise_rows(model_fn, x, sigma, [pos], call, (COND,))[0]
    if pos.shape[1:] == neg.shape[1:]:  # rows: negative, positive
        uncond, cond = _denoise_rows(model_fn, x, sigma, [neg, pos], call, (UNCOND, COND))
    else:
        cond = _denoise_rows(model_fn, x, sigma, [pos], call, (COND,))[0]
        uncond = _denoise_rows(model_fn, x, sigma, [neg], call, (UNCOND,))[0]
    return uncond + (cond - uncond) * cfg


COND, UNCOND = 0, 1  # ComfyUI's transformer_options["cond_or_uncond"] values


def _model_call(model_fn: ModelFn, wrappers: Sequence, transformer_options: dict, sample_sigmas: torch.Tensor):
    """ComfyUI's per-call APPLY_MODEL wrapper chain around the DiT, with its calling convention
    ``(x, t, c_concat, c_crossattn, control, transformer_options)``: `t` is the sigma per row
    (the DiT gets ``t * 1000``), and transformer_options is a per-call copy holding
    ``sample_sigmas``, ``sigmas`` (one chunk's sigma per row) and ``cond_or_uncond``."""
    from .model_patcher import run_wrapped

    def original(x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kwargs):
        return model_fn(x, t * 1000, c_crossattn)

    def call(x, sig, context, cond_or_uncond):
        opts = dict(transformer_options)
        opts["sample_sigmas"] = sample_sigmas
        opts["cond_or_uncond"] = cond_or_uncond
        opts["sigmas"] = sig[: sig.shape[0] // len(cond_or_uncond)]
        return run_wrapped(original, model_fn, list(wrappers), x, sig, None, context, None, opts)

    return call


@torch.no_grad()
def sample_flow(model_fn: ModelFn, *, noise: torch.Tensor, latent: torch.Tensor, sigmas: torch.Tensor,
                positive: torch.Tensor, negative: Optional[torch.Tensor], cfg: float,
                sampler_name: str = "euler", callback: Optional[StepCallback] = None,
                model_call_wrappers: Sequence = (), transformer_options: Optional[dict] = None) -> torch.Tensor:
    """Run the KSampler loop for a flow (CONST) model; returns model-space latents.

    noise, latent: [B, C, T, H, W] (latent in model space, zeros for text-to-video);
    sigmas: float32 [steps + 1]; positive/negative: contexts [1 or B, L, C].
    ``callback(i, total_steps, x)`` runs once per step after the model call and
    before the Euler update (where ComfyUI calls its callback); exceptions propagate.
    ``model_call_wrappers``: APPLY_MODEL wrappers run around every model call (ComfyUI's
    convention, see `_model_call`); none: the DiT is called directly.
    """
    if sampler_name not in SAMPLER_NAMES:
        raise ValueError(f"unsupported sampler {sampler_name!r}; supported: {SAMPLER_NAMES}")
    sigmas = sigmas.to(device=noise.device, dtype=torch.float32)
    latent = latent.to(noise.device)
    if len(sigmas) < 2:
        logger.info("empty sigma schedule: returning the latent unchanged")
        return latent.clone()
    b = noise.shape[0]
    pos = _expand_context(positive.to(noise.device), b)
    use_neg = not math.isclose(cfg, 1.0)
    if use_neg and negative is None:
        raise ValueError("cfg != 1 needs a negative conditioning")
    neg = _expand_context(negative.to(noise.device), b) if use_neg else None

    call = _model_call(model_fn, model_call_wrappers, transformer_options or {}, sigmas) \
        if model_call_wrappers else None
    x = sigmas[0] * noise + (1.0 - sigmas[0]) * latent  # noise scaling, [B, C, T, H, W]
    total = len(sigmas) - 1
    for i in range(total):
        sigma = sigmas[i]
        denoised = _guided_denoise(model_fn, x, sigma, pos, neg, cfg, call)
        if callback is not None:
            callback(i, total, x)
        d = (x - denoised) / sigma
        if sampler_name == "heun" and float(sigmas[i + 1]) != 0.0:
            # Heun's corrector: a second model call at the next sigma, then the average slope
            dt = sigmas[i + 1] - sigma
            x2 = x + d * dt
            d2 = (x2 - _guided_denoise(model_fn, x2, sigmas[i + 1], pos, neg, cfg, call)) / sigmas[i + 1]
            x = x + (d + d2) / 2 * dt
        else:
            x = x + d * (sigmas[i + 1] - sigma)
    return x / (1.0 - sigmas[-1])  # inverse noise scaling


# --------------------------------------------------------------------------
# KSampler node
# --------------------------------------------------------------------------

def _context_of(conditioning, name: str) -> torch.Tensor:
    """CONDITIONING [[tensor [1, L, C], dict]] -> the tensor."""
    if not isinstance(conditioning, (list, tuple)) or not conditioning:
        raise ValueError(f"{name} must be a non-empty CONDITIONING list of [tensor, dict]")
    if len(conditioning) > 1:
        raise NotImplementedError(f"{name}: only a single conditioning entry is supported, got {len(conditioning)}")
    entry = conditioning[0]
    ctx = entry[0]
    if not isinstance(ctx, torch.Tensor) or ctx.ndim != 3:
        raise ValueError(f"{name}: conditioning tensor must be [B, L, C]")
    return ctx


def _fix_empty_latent(samples: torch.Tensor) -> torch.Tensor:
    # 4-D image latent -> 5-D video latent; an empty latent with the wrong channel count -> 16 channels
    if samples.ndim == 4:
        samples = samples.unsqueeze(2)
    if samples.shape[1] != latent_format.LATENT_CHANNELS and torch.count_nonzero(samples) == 0:
        shape = list(samples.shape)
        shape[1] = latent_format.LATENT_CHANNELS
        samples = samples.new_zeros(shape)
    return samples


def _model_device(model) -> torch.device:
    params = getattr(model, "parameters", None)
    if callable(params):
        first = next(iter(params()), None)
        if first is not None:
            return first.device
    return torch.device("cpu")


def ksampler(model: ModelFn, *, seed: int, steps: int, cfg: float, sampler_name: str, scheduler: str,
             positive, negative, latent: dict, denoise: float = 1.0, shift: float = DEFAULT_SHIFT,
             callback: Optional[StepCallback] = None, model_call_wrappers: Sequence = (),
             transformer_options: Optional[dict] = None) -> dict:
    """ComfyUI's KSampler node for Wan 2.1 T2V; returns a LATENT dict (VAE space)."""
    if "noise_mask" in latent:
        raise NotImplementedError("LATENT noise_mask (inpainting) is not supported by the bundled sampler")
    samples = _fix_empty_latent(latent["samples"])
    noise = prepare_noise(samples, seed, latent.get("batch_index"))  # always drawn on the CPU
    device = _model_device(model)
    noise = noise.to(device)
    sigmas = flow_sigmas(steps, scheduler, shift=shift, denoise=denoise)
    model_latent = samples.to(device=device, dtype=torch.float32)
    if torch.count_nonzero(model_latent) > 0:  # an empty latent is not shifted
        model_latent = latent_format.process_in(model_latent)
    logger.debug("ksampler: %s/%s steps=%d cfg=%s shift=%s sigmas=%s", sampler_name, scheduler, steps, cfg, shift,
                 sigmas.tolist())
    x = sample_flow(model, noise=noise, latent=model_latent, sigmas=sigmas,
                    positive=_context_of(positive, "positive"),
                    negative=_context_of(negative, "negative") if not math.isclose(cfg, 1.0) else None,
                    cfg=cfg, sampler_name=sampler_name, callback=callback,
                    model_call_wrappers=model_call_wrappers, transformer_options=transformer_options)
    out = dict(latent)
    out["samples"] = latent_format.process_out(x.to(torch.float32)).cpu()
    return out
