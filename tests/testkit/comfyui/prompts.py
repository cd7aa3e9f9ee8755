"""The sampler tests' prompts and checks on a real ComfyUI (testkit.comfyui.server):

- `Prompt`: an API prompt under construction on the tiny Wan 2.1 (UNETLoader, the helper
  conditioning, a tagged latent) with our loader chain, ComfyUI's LoRA and every stock sampler;
- `run` / `latent_of` / `reports_sent`: queue a prompt, the latents its samplers saved, the
  report events;
- `assert_bitwise` / `assert_psnr` / `assert_changed`: the same bits, PSNR >= MIN_PSNR dB, far
  from the no-adapter latent;
- what the shared fixtures build (tests/integration/conftest.py: assets, fresh, no_adapter).
"""
from __future__ import annotations

import itertools
import time

import pytest
import torch
from safetensors.torch import load as load_safetensors_bytes
from testkit.lora_assets import (MODEL, STYLE_A, STYLE_B, _wan_modules, install_style_pair, psnr, sampling_graph,
                                 write_kohya_lora)

LORA_A, LORA_B = STYLE_A, STYLE_B     # the style adapters test_workflows_real.py writes too
LORA_PART = "it_any_comfy_part.safetensors"  # 5 of the 20 layers: ComfyUI's LoRA overlaps ours only there
MIN_PSNR = 40.0
MIN_EFFECT = 0.05  # an adapter moves the latent by at least this much (relative L2)
STATE = "ZZLoraRuntimeTestWeightState"  # the helper pack's weight-state node

_counter = itertools.count()


SETTINGS = {"seed": 42, "steps": 4, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple"}


class Prompt:
    """An API prompt under construction: base nodes 1 (UNETLoader), 2/3 (conditioning),
    4 (empty latent), 40 (the latent with a unique tag)."""

    @classmethod
    def wrap(cls, api: dict) -> "Prompt":
        """An existing API prompt, to add nodes to."""
        self = cls.__new__(cls)
        self.tag, self.p, self.samplers = next(_counter), api, {}
        return self

    def __init__(self, cond_class):
        self.tag = next(_counter)
        self.p = sampling_graph(cond_class, f"any-sampler-{self.tag}")
        self.samplers: dict[str, str] = {}  # sampler node -> its SaveLatent node

    def node(self, nid, class_type, **inputs) -> list:
        assert nid not in self.p, nid
        self.p[nid] = {"class_type": class_type, "inputs": inputs}
        return [nid, 0]

    def ours(self, model, adapters=(), mode="dynamic", tier="exact", base=11) -> list:
        """Load LoRA Adapter nodes base, base+1, ... -> Merge Mode (base+9) -> Quality Tier (base+10)."""
        for i, (name, strength) in enumerate(adapters):
            model = self.node(str(base + i), "LoraRuntimeLoadAdapter", model=model, lora_name=name, strength=strength)
        if mode is not None:
            model = self.node(str(base + 9), "LoraRuntimeMergeMode", model=model, mode=mode)
        if tier is not None:
            model = self.node(str(base + 10), "LoraRuntimeQualityTier", model=model, tier=tier)
        return model

    def chain(self, nid, lora, *, model=("1", 0), strength=1.0, mode="dynamic", tier="exact", **loader) -> list:
        """Load LoRA Adapter (node nid, `loader`: its other inputs) -> Merge Mode (nid+1) -> Quality Tier (nid+2)."""
        m = self.node(nid, "LoraRuntimeLoadAdapter", model=list(model), lora_name=lora, strength=strength, **loader)
        m = self.node(str(int(nid) + 1), "LoraRuntimeMergeMode", model=m, mode=mode)
        return self.node(str(int(nid) + 2), "LoraRuntimeQualityTier", model=m, tier=tier)

    def comfy_lora(self, nid, model, name, strength=1.0) -> list:
        return self.node(nid, "LoraLoaderModelOnly", model=model, lora_name=name, strength_model=strength)

    def _save(self, nid, out):
        save = f"s{nid}"
        self.node(save, "SaveLatent", samples=out, filename_prefix=f"it_any/{save}_{self.tag}")
        self.samplers[nid] = save

    def ksampler(self, nid, model, class_type="KSampler"):
        self.node(nid, class_type, model=model, positive=["2", 0], negative=["3", 0], latent_image=["40", 0],
                  denoise=1.0, **SETTINGS)
        self._save(nid, [nid, 0])

    def ksampler_advanced(self, nid, model):
        s = SETTINGS
        self.node(nid, "KSamplerAdvanced", model=model, add_noise="enable", noise_seed=s["seed"], steps=s["steps"],
                  cfg=s["cfg"], sampler_name=s["sampler_name"], scheduler=s["scheduler"], positive=["2", 0],
                  negative=["3", 0], latent_image=["40", 0], start_at_step=0, end_at_step=10000,
                  return_with_leftover_noise="disable")
        self._save(nid, [nid, 0])

    def ksampler_two_stage(self, nid, model):
        """KSamplerAdvanced nid+1 (steps 0-2, leftover noise) -> KSamplerAdvanced nid (2-end, no noise)."""
        s = SETTINGS
        first = str(int(nid) + 1)
        common = dict(model=model, noise_seed=s["seed"], steps=s["steps"], cfg=s["cfg"],
                      sampler_name=s["sampler_name"], scheduler=s["scheduler"], positive=["2", 0], negative=["3", 0])
        half = s["steps"] // 2
        self.node(first, "KSamplerAdvanced", add_noise="enable", latent_image=["40", 0], start_at_step=0,
                  end_at_step=half, return_with_leftover_noise="enable", **common)
        self.node(nid, "KSamplerAdvanced", add_noise="disable", latent_image=[first, 0], start_at_step=half,
                  end_at_step=10000, return_with_leftover_noise="disable", **common)
        self._save(nid, [nid, 0])

    def _custom_parts(self, nid, model):
        n = int(nid)
        sampler = self.node(str(n + 1), "KSamplerSelect", sampler_name=SETTINGS["sampler_name"])
        sigmas = self.node(str(n + 2), "BasicScheduler", model=model, scheduler=SETTINGS["scheduler"],
                           steps=SETTINGS["steps"], denoise=1.0)
        return sampler, sigmas

    def sampler_custom_advanced(self, nid, model):
        n = int(nid)
        sampler, sigmas = self._custom_parts(nid, model)
        noise = self.node(str(n + 3), "RandomNoise", noise_seed=SETTINGS["seed"])
        guider = self.node(str(n + 4), "CFGGuider", model=model, positive=["2", 0], negative=["3", 0],
                           cfg=SETTINGS["cfg"])
        self.node(nid, "SamplerCustomAdvanced", noise=noise, guider=guider, sampler=sampler, sigmas=sigmas,
                  latent_image=["40", 0])
        self._save(nid, [nid, 0])

    def sampler_custom(self, nid, model):
        sampler, sigmas = self._custom_parts(nid, model)
        self.node(nid, "SamplerCustom", model=model, add_noise=True, noise_seed=SETTINGS["seed"],
                  cfg=SETTINGS["cfg"], positive=["2", 0], negative=["3", 0], sampler=sampler, sigmas=sigmas,
                  latent_image=["40", 0])
        self._save(nid, [nid, 0])


def latent_of(comfy, record, save_node) -> torch.Tensor:
    outputs = record["history"]["outputs"]
    assert save_node in outputs, f"no output for node {save_node}: {sorted(outputs)}"
    (item,) = outputs[save_node]["latents"]
    raw = comfy.fetch_view(item["filename"], item.get("subfolder", ""), item.get("type", "output"))
    return load_safetensors_bytes(raw)["latent_tensor"]


def run(comfy, prompt: Prompt) -> tuple[dict, dict[str, torch.Tensor]]:
    """Queue, wait; every sampler must have run (not cached). Returns (record, {sampler: latent})."""
    record = comfy.run(prompt.p)
    for nid in prompt.samplers:
        assert nid in record["executing"] and nid not in record["cached"], \
            f"sampler {nid} did not run (cached {record['cached']}); the check would prove nothing"
    return record, {nid: latent_of(comfy, record, save) for nid, save in prompt.samplers.items()}


def reports_sent(record) -> list[dict]:
    return [e["data"] for e in record["events"] if e["type"] == "lora_runtime.report"]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def max_abs(a, b) -> float:
    return float((a - b).abs().max())


def assert_bitwise(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    assert torch.equal(a, b), f"{what}: max |diff| {max_abs(a, b):.3g}, PSNR {psnr(a, b):.1f} dB"


def assert_psnr(a, b, what, min_db=MIN_PSNR):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    db = psnr(a, b)
    print(f"{what}: PSNR {db:.1f} dB, max |diff| {max_abs(a, b):.3g}")  # shown with -s / on failure
    assert db >= min_db, f"{what}: PSNR {db:.1f} dB < {min_db} (max |diff| {max_abs(a, b):.3g})"


def assert_changed(a, no_adapter, what):
    d = rel_diff(a, no_adapter)
    print(f"{what}: {d:.1%} away from the no-adapter latent")
    assert d > MIN_EFFECT, f"{what}: only {d:.2%} away from the no-adapter latent (the wrong answer)"


def install_any_sampler_assets(comfy, reference):
    """The style pair (the same files test_workflows_real.py writes; written again so a file runs
    alone) and LORA_PART in the server's loras folder."""
    install_style_pair(comfy, reference)
    part = [m for m in _wan_modules() if m[0].startswith("blocks.0.self_attn.") or m[0] == "blocks.1.ffn.0"]
    write_kohya_lora(comfy.loras_dir / LORA_PART, seed=505, rank=4, alpha=4, modules=part)
    return comfy


def fresh_load_state(comfy) -> dict:
    """The weight state of a freshly loaded model (every cache dropped first)."""
    for attempt in range(3):
        comfy.free()
        time.sleep(1.0 + attempt)
        p = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL, "weight_dtype": "default"}},
             "99": {"class_type": STATE, "inputs": {"model": ["1", 0], "unload_all": True}}}
        rec = comfy.run(p)
        if "1" not in rec["cached"]:
            state = rec["history"]["outputs"]["99"]["zz_weight_state"][0]
            assert state["keys"] and not state["leftovers"], state
            assert not [k for k in state["keys"] if "base_layer" in k or "lora" in k.lower()], state["keys"]
            return state
    pytest.fail("could not get a fresh model load after POST /free")


def no_adapter_latent(comfy, cond_class) -> torch.Tensor:
    """KSampler on the bare model (the wrong answer for every adapter run)."""
    p = Prompt(cond_class)
    p.ksampler("6", ["1", 0])
    _, out = run(comfy, p)
    return out["6"]
