"""Fixtures for the embedded-model tests: the committed weights, loaded once.

Sampling follows ComfyUI on the CPU: the bf16 base is upcast to fp32 at load, the
bundled KSampler runs euler / simple / shift 8 with ``DEFAULT_STEPS`` (20) steps and
CFG ``DEFAULT_CFG`` (5) on an empty [B, 16, 1, 8, 8] latent, and the codec decodes
the process_out'ed result. Every sampled batch is drawn once per session.
"""
from __future__ import annotations

import pytest
import torch

from comfyui_lora_runtime.standalone import embedded as E
from comfyui_lora_runtime.standalone.embedded import data as D

N_SAMPLES = 80  # every (digit, colour) pair twice
SAMPLE_SEED = 4321


def _need(path):
    if not path.is_file():
        pytest.fail(f"committed embedded-model file missing: {path}; run `python tools/train_embedded.py`")
    return path


@pytest.fixture(scope="session", autouse=True)
def _threads():
    old = torch.get_num_threads()
    torch.set_num_threads(min(2, old))
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def codec():
    from comfyui_lora_runtime.standalone.embedded.codec import TinyCodec
    return TinyCodec.load(_need(E.CODEC))


@pytest.fixture(scope="session")
def text_encoder():
    from comfyui_lora_runtime.standalone.embedded.text_encoder import TinyTextEncoder
    return TinyTextEncoder.load(_need(E.TEXT_ENCODER))


@pytest.fixture(scope="session")
def judge():
    from comfyui_lora_runtime.standalone.embedded.judge import GlyphJudge
    return GlyphJudge.load(_need(E.JUDGE))


@pytest.fixture(scope="session")
def base_model():
    from comfyui_lora_runtime.standalone.host.wan21 import load_wan_checkpoint
    return load_wan_checkpoint(_need(E.BASE_MODEL))  # bf16 file -> fp32, like ComfyUI on the CPU


@pytest.fixture(scope="session")
def prompts():
    digits = torch.arange(N_SAMPLES) % 10
    colours = (torch.arange(N_SAMPLES) // 10) % len(D.COLOUR_NAMES)
    return [D.prompt_for(int(d), int(c)) for d, c in zip(digits, colours)], digits, colours


@pytest.fixture(scope="session")
def sample(base_model, text_encoder, codec):
    from comfyui_lora_runtime.standalone.embedded.pipeline import generate

    def _sample(prompt_list, **kw):
        kw.setdefault("seed", SAMPLE_SEED)
        return generate(base_model, text_encoder, codec, prompt_list, **kw)

    return _sample


@pytest.fixture(scope="session")
def base_images(sample, prompts):
    return sample(prompts[0])


@pytest.fixture(scope="session")
def style_images(base_model, sample, prompts):
    from comfyui_lora_runtime.lora_runtime import AdapterSpec, applied, plan

    p = plan(base_model, [AdapterSpec(str(_need(E.STYLE_LORA)), 1.0)], "dynamic", "exact")
    with applied(base_model, p):
        return sample(prompts[0])


@pytest.fixture(scope="session")
def few_prompts(prompts):
    """A small batch for the bit-exactness checks (compared only with runs of the same batch)."""
    return prompts[0][:8]


@pytest.fixture(scope="session")
def base_few(sample, few_prompts):
    return sample(few_prompts)


@pytest.fixture(scope="session")
def style_few(base_model, sample, few_prompts):
    from comfyui_lora_runtime.lora_runtime import AdapterSpec, applied, plan

    p = plan(base_model, [AdapterSpec(str(_need(E.STYLE_LORA)), 1.0)], "dynamic", "exact")
    with applied(base_model, p):
        return sample(few_prompts)
