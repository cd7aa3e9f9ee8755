"""Speed on quantized bases: Wan-block linears with comfy-kitchen QuantizedTensor weights in
ComfyUI 0.33's layer shape (the bundled host's QuantLinear: dequantize at cast, then the GEMM),
base alone vs our dynamic adapters (1 and 4, rank 32) vs the host's cast-time LoRA patch
(ComfyUI's LoRA when it cannot merge: W + dW formed at every cast), side by side.

    python bench/bench_quantized.py                 # Wan-1.3B dims, 2 blocks, 512 tokens (~1-2 min)
    python bench/bench_quantized.py --smoke         # tiny dims, 1 round (CI)
    python bench/bench_quantized.py --device cuda   # the same on a GPU (the device check runs it)

Arms per layout (times are medians of per-round ratios to `base`, interleaved rounds):
- ``base``: the quantized model alone;
- ``dyn1`` / ``dyn4``: our dynamic path with 1 / 4 adapters (mode dynamic, tier lossless);
- ``cast1``: one adapter as a cast-time weight patch (`AdaptedLayer.patch_at_cast`).
Each forward is checked against the ideal float result at the end (the adapter is applied).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import header, interleaved_rounds, resolve_device  # noqa: E402

from comfyui_lora_runtime.standalone.host import quant_checkpoints  # noqa: E402
from comfyui_lora_runtime.lora_runtime import applied, plan  # noqa: E402
from comfyui_lora_runtime.lora_runtime.intent import AdapterSpec  # noqa: E402
from comfyui_lora_runtime.lora_runtime.layer.wrapper import attached_wrapper  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


class Block(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ffn = nn.Sequential(nn.Linear(d, f), nn.GELU(approximate="tanh"), nn.Linear(f, d))

    def forward(self, x):
        x = x + self.o(self.q(x) * torch.sigmoid(self.k(x)) + self.v(x))
        return x + self.ffn(x)


def model(d, f, n):
    torch.manual_seed(0)
    m = nn.Sequential(*(Block(d, f) for _ in range(n)))
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(0.5)
    return m.to(torch.bfloat16)


def adapter(path, m, rank, seed):
    g = torch.Generator().manual_seed(seed)
    t = {}
    for n, mod in m.named_modules():
        if isinstance(mod, nn.Linear):
            k = "lora_unet_" + n.replace(".", "_")
            t[k + ".lora_down.weight"] = torch.randn(rank, mod.in_features, generator=g) * 0.02
            t[k + ".lora_up.weight"] = torch.randn(mod.out_features, rank, generator=g) * 0.02
            t[k + ".alpha"] = torch.tensor(float(rank))
    save_file(t, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="1536,8960", help="dim,ffn_dim (Wan 1.3B: 1536,8960)")
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layouts", default="TensorCoreFP8Layout,TensorCoreNVFP4Layout")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny dims, one round")
    a = ap.parse_args()
    if a.smoke:
        a.dims, a.blocks, a.tokens, a.rank, a.repeats = "64,128", 1, 16, 4, 1
    torch.set_num_threads(a.threads)
    dev = resolve_device(a.device)
    d, f = (int(v) for v in a.dims.split(","))
    print(header(dev, f"quantized bases: dims {d}/{f}, {a.blocks} blocks, {a.tokens} tokens, rank {a.rank}"))
    plain = model(d, f, a.blocks).to(dev)
    tmp = tempfile.mkdtemp()
    paths = [os.path.join(tmp, f"a{i}.safetensors") for i in range(4)]
    for i, p in enumerate(paths):
        adapter(p, plain, a.rank, i)
    x = torch.randn(1, a.tokens, d).to(device=dev, dtype=torch.bfloat16)
    for layout in a.layouts.split(","):
        q = quant_checkpoints.quantize_model(plain, layout, min_numel=1)
        ms = {"base": q}
        stacks = {}
        for name, specs, cast in (("dyn1", paths[:1], False), ("dyn4", paths, False), ("cast1", paths[:1], True)):
            ms[name] = quant_checkpoints.quantize_model(plain, layout, min_numel=1)
            stacks[name] = applied(ms[name], plan(ms[name], [AdapterSpec(p, 1.0) for p in specs], mode="dynamic"),
                                   fusion_backend=None)
            stacks[name].__enter__()
            if cast:
                for mod in ms[name].modules():
                    w = attached_wrapper(mod)
                    if w is not None:
                        w.patch_at_cast()

        def arm(m):
            def run():
                with torch.no_grad():
                    m(x)
            return run

        stats = interleaved_rounds({n: arm(m) for n, m in ms.items()}, dev, refs=("base",),
                                   warmup=1, repeats=a.repeats)
        with torch.no_grad():
            y0, y1 = ms["base"](x), ms["dyn1"](x)
        assert (y1 - y0).abs().max() > 0, "the adapter changed nothing"
        for s in stacks.values():
            s.__exit__(None, None, None)
        print(f"{layout}: base {stats['base'].median_ms:.1f} ms/forward; "
              + ", ".join(f"{n} / base {stats[n].ratio('base'):.3f}" for n in ("dyn1", "dyn4", "cast1")))


if __name__ == "__main__":
    main()
