"""Sigma schedules, seeded noise and the latent format against ComfyUI 0.3.64 vectors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from comfyui_lora_runtime.standalone.host import latent_format
from comfyui_lora_runtime.standalone.host.sampling import (
    SCHEDULER_NAMES,
    beta_ppf,
    flow_sigmas,
    model_sigmas_table,
    prepare_noise,
)

SIGMA_ATOL = 2.5e-7  # README: float32-emulation is exact; a float64 re-derivation is within 1.8e-7
SHIFTS = ("8.0", "3.0")


@pytest.mark.parametrize("shift", SHIFTS)
def test_model_sigmas_table_bit_exact(ref_json, shift):
    ref = torch.tensor(ref_json("sigmas.json")["tables"][f"shift={shift}"], dtype=torch.float32)
    got = model_sigmas_table(float(shift))
    assert got.dtype == torch.float32 and got.shape == (1000,)
    assert torch.equal(got, ref)
    other = model_sigmas_table(3.0 if shift == "8.0" else 8.0)
    assert (other - ref).abs().max() > 1e-2  # a wrong shift is caught


@pytest.mark.parametrize("scheduler", ["simple", "normal", "sgm_uniform", "beta", "karras"])
@pytest.mark.parametrize("shift", SHIFTS)
def test_flow_sigmas_match_comfyui(ref_json, scheduler, shift):
    table = ref_json("sigmas.json")["schedules"][f"shift={shift}"][scheduler]
    wrong_shift = 3.0 if shift == "8.0" else 8.0
    checked = 0
    for steps_key, by_denoise in table.items():
        steps = int(steps_key.split("=")[1])
        for denoise_key, ref_list in by_denoise.items():
            denoise = float(denoise_key.split("=")[1])
            ref = torch.tensor(ref_list, dtype=torch.float32)
            got = flow_sigmas(steps, scheduler, shift=float(shift), denoise=denoise)
            where = f"{scheduler} shift={shift} steps={steps} denoise={denoise}"
            assert got.dtype == torch.float32
            assert len(got) == len(ref) == steps + 1, where
            torch.testing.assert_close(got, ref, atol=SIGMA_ATOL, rtol=0, msg=where)
            if len(ref) > 2 or ref[0] != 1.0:  # [1, 0] is the same for every shift
                bad = flow_sigmas(steps, scheduler, shift=wrong_shift, denoise=denoise)
                assert (bad - ref).abs().max() > 1e-3, where
            checked += 1
    assert checked == 6


def test_scheduler_names_and_errors():
    assert set(SCHEDULER_NAMES) == {"simple", "normal", "sgm_uniform", "beta", "karras"}
    with pytest.raises(ValueError, match="scheduler"):
        flow_sigmas(4, "no_such_scheduler")
    assert flow_sigmas(4, "simple", denoise=0.0).numel() == 0


def test_beta_ppf_matches_scipy():
    stats = pytest.importorskip("scipy.stats", reason="scipy is only the oracle here")
    for steps in (1, 2, 3, 4, 7, 20, 33, 50, 100, 257):
        p = 1 - np.linspace(0, 1, steps, endpoint=False)
        ref = stats.beta.ppf(p, 0.6, 0.6)
        got = np.array([beta_ppf(float(v), 0.6, 0.6) for v in p])
        np.testing.assert_allclose(got, ref, atol=1e-13, rtol=0)
        assert np.array_equal(np.rint(got * 999), np.rint(ref * 999))
    assert abs(beta_ppf(0.3, 0.6, 0.6) - stats.beta.ppf(0.3, 2.0, 2.0)) > 1e-3  # parameters matter


NOISE_NAMES = [
    "1x16x1x8x8",
    "2x16x2x8x8",
    "2x16x2x8x8_batch_index_0_1",
    "2x16x2x8x8_batch_index_1_3",
    "2x16x2x8x8_batch_index_2_0",
]


@pytest.mark.parametrize("seed", [42, 12345])
def test_prepare_noise_bit_exact(load_ref, seed):
    ref = load_ref(f"noise_seed{seed}")
    assert set(ref) == set(NOISE_NAMES)
    for name in NOISE_NAMES:
        shape = [int(s) for s in name.split("_")[0].split("x")]
        batch_index = [int(i) for i in name.split("batch_index_")[1].split("_")] if "batch_index" in name else None
        latent = torch.zeros(shape, dtype=torch.float32)
        got = prepare_noise(latent, seed, batch_index)
        assert got.dtype == torch.float32 and got.shape == ref[name].shape, name
        assert torch.equal(got, ref[name]), name
        assert not torch.equal(prepare_noise(latent, seed + 1, batch_index), ref[name]), name
    # the global RNG is left alone (ComfyUI reseeds it; we use a private generator)
    state = torch.get_rng_state()
    prepare_noise(torch.zeros(1, 16, 1, 8, 8), seed)
    assert torch.equal(state, torch.get_rng_state())


def test_prepare_noise_duplicate_batch_index_shares_a_draw():
    noise = prepare_noise(torch.zeros(3, 16, 1, 4, 4), 7, [1, 0, 1])
    assert torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[1])


def test_latent_format_constants_and_direction(ref_json):
    fmt = ref_json("wan21_latent_format.json")["latent_format"]
    mean = torch.tensor(fmt["latents_mean_float32"], dtype=torch.float32)
    std = torch.tensor(fmt["latents_std_float32"], dtype=torch.float32)
    assert torch.equal(torch.tensor(latent_format.LATENTS_MEAN, dtype=torch.float32), mean)
    assert torch.equal(torch.tensor(latent_format.LATENTS_STD, dtype=torch.float32), std)
    x = torch.randn(2, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    out = latent_format.process_out(x)
    torch.testing.assert_close(out, x * std.view(1, 16, 1, 1, 1) + mean.view(1, 16, 1, 1, 1), atol=0, rtol=0)
    torch.testing.assert_close(latent_format.process_in(out), x, atol=1e-5, rtol=0)
    assert (latent_format.process_in(x) - out).abs().max() > 1.0  # the directions are not swapped
