"""The bundled KSampler (euler, flow/CONST) against ComfyUI 0.3.64 traces and outputs."""
from __future__ import annotations

import pytest
import torch

from comfyui_lora_runtime.standalone.host import latent_format
from comfyui_lora_runtime.standalone.host.sampling import flow_sigmas, ksampler, prepare_noise, sample_flow

KSAMPLER_ATOL = 1e-4  # README: independent fp32 forward lands within 2.3e-5

OUTPUTS = {  # file suffix -> (steps, cfg, shift)
    "euler_simple_4": (4, 5.0, 8.0),
    "euler_simple_20": (20, 5.0, 8.0),
    "euler_simple_4_shift3": (4, 5.0, 3.0),
    "euler_simple_20_shift3": (20, 5.0, 3.0),
    "euler_simple_4_cfg1": (4, 1.0, 8.0),
}


class Recorder:
    """Wraps a model_fn and keeps every call's inputs and output."""

    def __init__(self, model):
        self.model = model
        self.calls = []

    def __call__(self, x, timestep, context):
        out = self.model(x, timestep, context)
        self.calls.append((x.clone(), timestep.clone(), context.clone(), out.clone()))
        return out


def _conds(cond_pos, neg_len=4):
    return [[cond_pos, {}]], [[torch.zeros(1, neg_len, 4096), {}]]


def _empty_latent():
    return {"samples": torch.zeros(1, 16, 1, 8, 8)}  # EmptyHunyuanLatentVideo(64, 64, 1, 1)


def test_step_trace_matches_comfyui(tiny_wan, cond_pos, load_ref):
    tr = load_ref("ksampler_trace_euler_simple_4")
    sigmas = flow_sigmas(4, "simple", shift=8.0)
    assert torch.equal(sigmas, tr["sigmas"])
    noise = prepare_noise(torch.zeros(1, 16, 1, 8, 8), 42)
    assert torch.equal(noise, tr["noise"])

    rec = Recorder(tiny_wan)
    seen = []
    x_final = sample_flow(rec, noise=noise, latent=torch.zeros_like(noise), sigmas=sigmas,
                          positive=cond_pos, negative=torch.zeros(1, 4, 4096), cfg=5.0,
                          callback=lambda i, n, x: seen.append((i, n, x.clone())))
    assert len(rec.calls) == 4 and [(i, n) for i, n, _ in seen] == [(i, 4) for i in range(4)]
    for i, (x_in, timestep, context, out) in enumerate(rec.calls):
        assert timestep.dtype == torch.float32 and torch.equal(timestep, tr[f"step{i}.timestep"])
        assert torch.equal(context[0], torch.zeros(4, 4096)) and torch.equal(context[1], cond_pos[0])  # [neg, pos]
        torch.testing.assert_close(seen[i][2], tr[f"step{i}.x"], atol=KSAMPLER_ATOL, rtol=0)
        torch.testing.assert_close(out, tr[f"step{i}.model_out"], atol=KSAMPLER_ATOL, rtol=0)
        sigma = sigmas[i]
        denoised = x_in - out * sigma
        torch.testing.assert_close(denoised[:1], tr[f"step{i}.denoised_uncond"], atol=KSAMPLER_ATOL, rtol=0)
        torch.testing.assert_close(denoised[1:], tr[f"step{i}.denoised_cond"], atol=KSAMPLER_ATOL, rtol=0)
        cfg = denoised[:1] + (denoised[1:] - denoised[:1]) * 5.0
        torch.testing.assert_close(cfg, tr[f"step{i}.denoised_cfg"], atol=KSAMPLER_ATOL, rtol=0)
        assert (denoised[1:] - tr[f"step{i}.denoised_uncond"]).abs().max() > 100 * KSAMPLER_ATOL  # rows not swapped
    torch.testing.assert_close(x_final, tr["x_final"], atol=KSAMPLER_ATOL, rtol=0)
    torch.testing.assert_close(latent_format.process_out(x_final), tr["samples"], atol=KSAMPLER_ATOL, rtol=0)
    assert (x_final - tr["samples"]).abs().max() > 0.1  # process_out is not a no-op


def test_trace_replay_is_bit_exact(load_ref):
    """Feeding ComfyUI's own model outputs through our loop reproduces its samples bit for bit."""
    tr = load_ref("ksampler_trace_euler_simple_4")
    outs = iter(tr[f"step{i}.model_out"] for i in range(4))
    x = sample_flow(lambda x, t, c: next(outs), noise=tr["noise"], latent=torch.zeros_like(tr["noise"]),
                    sigmas=tr["sigmas"], positive=torch.ones(1, 4, 8), negative=torch.zeros(1, 4, 8), cfg=5.0)
    assert torch.equal(x, tr["x_final"])
    assert torch.equal(latent_format.process_out(x), tr["samples"])


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_ksampler_outputs_match_comfyui(tiny_wan, cond_pos, load_ref, name):
    steps, cfg, shift = OUTPUTS[name]
    ref = load_ref(f"ksampler_out_{name}")["samples"]
    pos, neg = _conds(cond_pos)
    latent = _empty_latent()
    out = ksampler(tiny_wan, seed=42, steps=steps, cfg=cfg, sampler_name="euler", scheduler="simple",
                   positive=pos, negative=neg, latent=latent, shift=shift)
    assert set(out) == {"samples"} and out["samples"].dtype == torch.float32
    torch.testing.assert_close(out["samples"], ref, atol=KSAMPLER_ATOL, rtol=0)
    assert torch.equal(latent["samples"], torch.zeros(1, 16, 1, 8, 8))  # input untouched

    # a wrong setting is caught by far more than the tolerance
    wrong = ksampler(tiny_wan, seed=42, steps=steps, cfg=cfg, sampler_name="euler", scheduler="simple",
                     positive=pos, negative=neg, latent=latent, shift=3.0 if shift == 8.0 else 8.0)
    assert (wrong["samples"] - ref).abs().max() > 100 * KSAMPLER_ATOL


def test_cfg1_skips_negative_and_unequal_lengths_split(tiny_wan, cond_pos):
    rec = Recorder(tiny_wan)
    pos, neg = _conds(cond_pos, neg_len=7)
    ksampler(rec, seed=42, steps=2, cfg=1.0, sampler_name="euler", scheduler="simple",
             positive=pos, negative=neg, latent=_empty_latent())
    assert [c[0].shape[0] for c in rec.calls] == [1, 1]
    assert all(torch.equal(c[2], cond_pos) for c in rec.calls)

    rec.calls.clear()
    ksampler(rec, seed=42, steps=2, cfg=4.0, sampler_name="euler", scheduler="simple",
             positive=pos, negative=neg, latent=_empty_latent())
    # different context lengths: two batch-1 calls per step, positive first
    assert [tuple(c[2].shape[:2]) for c in rec.calls] == [(1, 4), (1, 7)] * 2


def test_callback_interrupts_and_batch_index_kept(tiny_wan, cond_pos):
    pos, neg = _conds(cond_pos)

    class Stop(Exception):
        pass

    def cb(i, n, x):
        if i == 1:
            raise Stop

    with pytest.raises(Stop):
        ksampler(tiny_wan, seed=1, steps=4, cfg=5.0, sampler_name="euler", scheduler="simple",
                 positive=pos, negative=neg, latent=_empty_latent(), callback=cb)

    latent = {"samples": torch.zeros(2, 16, 1, 4, 4), "batch_index": [3, 1]}
    rec = Recorder(tiny_wan)
    out = ksampler(rec, seed=5, steps=1, cfg=5.0, sampler_name="euler", scheduler="simple",
                   positive=pos, negative=neg, latent=latent)
    assert out["batch_index"] == [3, 1] and out["samples"].shape == (2, 16, 1, 4, 4)
    assert torch.equal(rec.calls[0][0][:2], prepare_noise(latent["samples"], 5, [3, 1]))  # sigma0 = 1
    assert rec.calls[0][0].shape[0] == 4  # [neg x2, pos x2]
    with pytest.raises(ValueError, match="sampler"):
        ksampler(tiny_wan, seed=1, steps=1, cfg=5.0, sampler_name="dpmpp_2m", scheduler="simple",
                 positive=pos, negative=neg, latent=_empty_latent())


def test_nonzero_latent_is_process_in_and_noised(cond_pos):
    """img2img path: x0 = sigma0*noise + (1 - sigma0)*process_in(latent)."""
    samples = torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(9))
    rec = Recorder(lambda x, t, c: torch.zeros_like(x))  # zero velocity: x stays put
    out = ksampler(rec, seed=11, steps=4, cfg=1.0, sampler_name="euler", scheduler="simple",
                   positive=[[cond_pos, {}]], negative=[[cond_pos, {}]], latent={"samples": samples}, denoise=0.5)
    sigmas = flow_sigmas(4, "simple", denoise=0.5)
    noise = prepare_noise(samples, 11)
    x0 = sigmas[0] * noise + (1.0 - sigmas[0]) * latent_format.process_in(samples)
    assert torch.equal(rec.calls[0][0], x0)
    assert torch.equal(rec.calls[0][1], (sigmas[0] * 1000).reshape(1))
    torch.testing.assert_close(out["samples"], latent_format.process_out(x0), atol=1e-6, rtol=0)
