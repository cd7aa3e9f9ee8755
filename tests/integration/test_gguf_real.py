"""GGUF bases in real ComfyUI: our nodes on models loaded by ComfyUI-GGUF, against its own LoRA path.

Opt-in twice: besides ComfyUI (``COMFYUI_DIR``), it needs a ComfyUI-GGUF checkout
(``COMFYUI_GGUF_DIR``, default ``<COMFYUI_DIR>/../ComfyUI-GGUF``; never part of this repo) and the
``gguf`` package in ComfyUI's python; it skips naming what is missing. A second server runs with
this pack, the test-only helper nodes and ComfyUI-GGUF in its custom_nodes.

The reference tiny Wan (bf16) is converted at test time with the ``gguf`` package
(``testkit.gguf_files``: 2-D weights as F16, BF16 or Q8_0; everything else F32; a 5-D kernel stored 2-D
with ComfyUI-GGUF's ``comfy.gguf.orig_shape`` field) and loaded by ``UnetLoaderGGUF``. Per type,
one prompt samples (KSampler, euler/simple, 3 steps, CFG 1, seed 42):

  no adapter; ComfyUI-GGUF's own LoRA path (``LoraLoaderModelOnly`` on its model: F16 merged
  into the weight, BF16 / Q8_0 patched onto the dequantized weight per call); ours in every
  mode (auto / dynamic / merge) and tier (exact / lossless / high), each with a report node.

Asserted: every latent of ours within MIN_PSNR of ComfyUI-GGUF's (the same update; the order of
the fp32 multiplications of the delta and, for dynamic, adding x dW^T to the output instead of
dW to the weight differ: rounding only), bit for bit where both fold fp32 W + dW into the F16
weight with one rounding (F16, LoRA, merged), and far from the no-adapter latent; the reports' decision
(Q8_0: auto -> dynamic naming "GGUF Q8_0", merge refused with advice that then runs; F16 / BF16:
plain weights, merge merges). Update types (LoHa, LoKr, full diff, DoRA [1, in] and [out, 1])
in dynamic and, on F16 / BF16, merge: within MIN_PSNR of ComfyUI-GGUF's path (DoRA [out, 1]:
ComfyUI divides by ||W|| where ours divides by ||W + s dW||, see test_variants_real.py: compared
to our own dynamic path, and away from ComfyUI-GGUF's).
"""
from __future__ import annotations

import itertools
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from testkit.gguf_files import write_gguf
from testkit.lora_assets import MODEL, PromptGraph, psnr, write_kohya_lora, write_variant_file

STRENGTH = 0.8
MIN_PSNR = 40.0
MIN_EFFECT = 0.05
SETTINGS = {"seed": 42, "steps": 3, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple"}
QTYPES = ("F16", "BF16", "Q8_0")
MODES = ("auto", "dynamic", "merge")
TIERS = ("exact", "lossless", "high")
KINDS = ("loha", "lokr_w1_w2ab", "full_diff", "dora_in", "dora_out")
_counter = itertools.count()
# measured on ComfyUI 0.3.64 (CPU), ours vs ComfyUI-GGUF's LoRA path, LoRA in every tier:
#   F16: merge / auto (merges) bitwise, dynamic 95.3 dB (ComfyUI-GGUF merges into fp16; dynamic does not round)
#   BF16: dynamic 149.2-149.5 dB; merge / auto (merges) 76.6 dB (ComfyUI-GGUF patches BF16 per call in fp32,
#         never rounding the update into bf16; our merge does)
#   Q8_0: auto / dynamic 149.3-149.4 dB
# update types (exact): 144-149 dB dynamic on BF16 / Q8_0, 84-95 dB on F16; merge F16 122 dB-bitwise, BF16 69-77 dB;
#   DoRA [out, 1] 21.9 dB (the ||W|| convention, asserted away)

def _gguf_dir(comfy) -> Path:
    env = os.environ.get("COMFYUI_GGUF_DIR")
    return Path(env) if env else Path(comfy.comfy_dir).parent / "ComfyUI-GGUF"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gguf_comfy(comfy, reference, tmp_path_factory):
    src = _gguf_dir(comfy)
    if not (src / "nodes.py").is_file() or not (src / "loader.py").is_file():
        pytest.skip(f"ComfyUI-GGUF not found at {src}: set COMFYUI_GGUF_DIR to a checkout of city96/ComfyUI-GGUF")
    probe = subprocess.run([comfy.python, "-c", "import gguf"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"the gguf package is not installed in ComfyUI's python ({comfy.python}): pip install gguf")
    base = tmp_path_factory.mktemp("comfyui-gguf-base")
    for sub in ("custom_nodes", "models/diffusion_models", "models/loras", "input", "output", "temp", "user"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    cn = base / "custom_nodes"
    (cn / comfy.pack_link_name).symlink_to((comfy.custom_nodes_dir / comfy.pack_link_name).resolve(),
                                           target_is_directory=True)
    (cn / comfy.helper_pack_name).symlink_to(comfy.custom_nodes_dir / comfy.helper_pack_name, target_is_directory=True)
    (cn / "ComfyUI-GGUF").symlink_to(src.resolve(), target_is_directory=True)
    for q in QTYPES:
        write_gguf(comfy.python, reference / MODEL, base / "models" / "diffusion_models" / f"tiny_wan_{q}.gguf", q)
    loras = base / "models" / "loras"
    write_kohya_lora(loras / "it_gguf" / "lora.safetensors", seed=2301, rank=8, alpha=4.0)
    for i, kind in enumerate(KINDS):
        write_variant_file(loras / "it_gguf" / f"{kind}.safetensors", kind, seed=2400 + i,
                           model_path=reference / MODEL)
    server = type(comfy)(comfy.comfy_dir, comfy.python, base, _free_port())
    try:
        server.start()
    except Exception:
        server.stop()
        raise
    status, info = server.get_json("/object_info/UnetLoaderGGUF")
    if status != 200 or "UnetLoaderGGUF" not in info:
        server.stop()
        pytest.fail(f"ComfyUI-GGUF did not load in the test server; log:\n{server.log_tail()}")
    yield server
    server.stop()


class Prompt(PromptGraph):
    def __init__(self, comfy, qtype):
        super().__init__(comfy.helper_cond_class, "gguf", next(_counter), SETTINGS, STRENGTH)
        self.p["1"] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": f"tiny_wan_{qtype}.gguf"}}


def run(comfy, prompt: Prompt):
    return prompt.run(comfy)


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("qtype", QTYPES)
def test_every_mode_and_tier_against_comfyui_gguf(gguf_comfy, qtype):
    p = Prompt(gguf_comfy, qtype)
    p.ksampler("base", ["1", 0])
    p.comfy_lora("gguf", "it_gguf/lora.safetensors")
    cases = [(m, t) for m in MODES for t in TIERS if not (qtype == "Q8_0" and m == "merge")]
    for i, (mode, tier) in enumerate(cases):
        p.ours(f"o{i}", "it_gguf/lora.safetensors", mode, tier)
    lat, reps = run(gguf_comfy, p)
    ref, base = lat["gguf"], lat["base"]
    assert rel(ref, base) > MIN_EFFECT, "ComfyUI-GGUF's LoRA must move the latent for this test to mean anything"
    seen = {}
    for i, (mode, tier) in enumerate(cases):
        y, r = lat[f"o{i}"], reps[f"o{i}"]
        seen[(mode, tier)] = "bitwise" if torch.equal(y, ref) else f"{psnr(y, ref):.1f} dB"
        assert psnr(y, ref) >= MIN_PSNR, (qtype, mode, tier, seen)
        assert rel(y, base) > MIN_EFFECT, (qtype, mode, tier)
        chosen = r["decision"]["chosen"]
        if qtype == "F16" and chosen == "merge":  # both fold fp32 W + dW into the fp16 weight with one rounding
            assert torch.equal(y, ref), (mode, tier, seen)
        if qtype == "Q8_0":
            assert chosen == "dynamic", r["decision"]
            if mode == "auto":
                assert "GGUF Q8_0 (quantized/packed)" in r["decision"]["reason"], r["decision"]
        elif mode == "merge":
            assert chosen == "merge", r["decision"]
    print(f"\n{qtype}: ours vs ComfyUI-GGUF's LoRA path: {seen}")


def test_q8_0_merge_is_refused_and_its_advice_runs(gguf_comfy):
    p = Prompt(gguf_comfy, "Q8_0")
    p.ours("m", "it_gguf/lora.safetensors", "merge", "lossless")
    with pytest.raises(AssertionError) as ei:  # testkit.comfyui.server.PromptFailed: ComfyUI's execution_error
        run(gguf_comfy, p)
    msg = str(ei.value)
    assert "weight is GGUF Q8_0 (quantized/packed)" in msg and "Use merge mode 'dynamic'" in msg, msg[:2000]
    p = Prompt(gguf_comfy, "Q8_0")
    p.ours("d", "it_gguf/lora.safetensors", "dynamic", "lossless")
    _, reps = run(gguf_comfy, p)
    assert reps["d"]["decision"]["chosen"] == "dynamic"


@pytest.mark.parametrize("qtype", QTYPES)
def test_update_types_against_comfyui_gguf(gguf_comfy, qtype):
    p = Prompt(gguf_comfy, qtype)
    p.ksampler("base", ["1", 0])
    modes = ("dynamic",) if qtype == "Q8_0" else ("dynamic", "merge")
    for kind in KINDS:
        p.comfy_lora(f"g_{kind}", f"it_gguf/{kind}.safetensors")
        for mode in modes:
            p.ours(f"o_{kind}_{mode}", f"it_gguf/{kind}.safetensors", mode, "exact")
    lat, reps = run(gguf_comfy, p)
    seen = {}
    for kind in KINDS:
        ref = lat[f"g_{kind}"]
        for mode in modes:
            y = lat[f"o_{kind}_{mode}"]
            assert reps[f"o_{kind}_{mode}"]["decision"]["chosen"] == mode
            assert rel(y, lat["base"]) > MIN_EFFECT, (qtype, kind, mode)
            seen[(kind, mode)] = f"{psnr(y, ref):.1f} dB"
            if kind == "dora_out":  # ComfyUI's ||W|| convention vs ours (||W + s dW||): ours against itself
                assert psnr(y, lat[f"o_{kind}_dynamic"]) >= MIN_PSNR and psnr(y, ref) < MIN_PSNR, seen
            else:
                assert psnr(y, ref) >= MIN_PSNR, (qtype, kind, mode, seen)
    print(f"\n{qtype}: update types, ours vs ComfyUI-GGUF's LoRA path: {seen}")
