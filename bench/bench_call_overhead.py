"""Microseconds the engine adds per adapted Linear call on tiny shapes, where Python and
launch overhead, not FLOPs, set the cost (the small-size dynamic-path gap).

One Linear (64 -> 64, 16 tokens, fp32, CPU) of a 1-block Wan-2.1-architecture model
carries a rank-4 kohya adapter applied with the engine (`plan` + `applied`, dynamic).
Arms, each timed right after the plain layer call (`paired_rounds`, medians of per-round
ratios), `--inner` calls per timing:
  plain      the same Linear without an adapter (nn.Module call): the reference
  lossless   the wrapped layer under runtime_context(tier="lossless")
  exact      the same under tier "exact" (reference path)
  scheduled  lossless with a per-call adapter multiplier 0.5 (a strength schedule)
  peft       base(x) + (x A^T) B^T * s written out in torch (the arithmetic floor)
  unplanned  lossless through the general path with the per-call selection redone each call
             (context read, factor dict, filtering: what every call did before call plans),
             behind the same nn.Module call: the before of the call-plan change, in the same run
Printed per arm: us per call, and us added over plain. The last line is
`added us per adapted call (lossless): <us>`.

    python bench/bench_call_overhead.py [--quick] [--inner N] [--repeats N] [--threads N]
"""
from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from comfyui_lora_runtime.standalone.host.wan21 import WanConfig, WanModel
from comfyui_lora_runtime.lora_runtime.apply import applied, plan
from comfyui_lora_runtime.lora_runtime.intent import AdapterSpec
from comfyui_lora_runtime.lora_runtime.layer.runtime_context import current_context, runtime_context

from _timing import header, load_string, paired_rounds

DIM, TOKENS, RANK, ALPHA, STRENGTH = 64, 16, 4, 4.0, 0.8
LAYER = "blocks.0.ffn.0"


def build():
    cfg = WanConfig(dim=DIM, ffn_dim=DIM, num_heads=2, num_layers=1, text_dim=DIM, freq_dim=32)
    torch.manual_seed(0)
    model = WanModel(cfg).eval().requires_grad_(False)
    lin = model.get_submodule(LAYER)
    g = torch.Generator().manual_seed(1)
    down = torch.randn(RANK, lin.in_features, generator=g) / lin.in_features ** 0.5
    up = torch.randn(lin.out_features, RANK, generator=g) * 0.05
    return model, lin, down, up


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds (~20 s)")
    p.add_argument("--inner", type=int, default=2000, help="calls per timing")
    p.add_argument("--repeats", type=int, default=None, help="rounds (default 5 quick / 15)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (5 if args.quick else 15)
    model, lin, down, up = build()
    x = torch.randn(1, TOKENS, DIM)
    w, b = lin.weight, lin.bias
    s = ALPHA / RANK * STRENGTH
    print(header("cpu", f"one Linear {DIM}->{DIM}, {TOKENS} tokens, fp32, rank-{RANK} adapter; "
                        f"{args.inner} calls per timing, median of {repeats} rounds"))
    from safetensors.torch import save_file
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        path = Path(tmp) / "tiny.safetensors"
        save_file({f"diffusion_model.{LAYER}.lora_down.weight": down.contiguous(),
                   f"diffusion_model.{LAYER}.lora_up.weight": up.contiguous(),
                   f"diffusion_model.{LAYER}.alpha": torch.tensor(ALPHA)}, str(path))
        stack.enter_context(applied(model, plan(model, [AdapterSpec(str(path), STRENGTH, name="a")],
                                                mode="dynamic"), fusion_backend=None))
        plain_lin = torch.nn.Linear(lin.in_features, lin.out_features)   # the same layer without an adapter
        plain_lin.load_state_dict(lin.state_dict())
        plain_lin.requires_grad_(False)

        def plain():
            return plain_lin(x)

        def under(tier, adapters=None):
            def call():
                with runtime_context(tier=tier, adapters=adapters):
                    for _ in range(args.inner):
                        lin(x)
            return call

        wr = lin._lora_runtime

        class Unplanned(torch.nn.Module):
            def forward(self, x):
                y = wr._base_call(x)
                ctx = current_context()
                return wr._forward_general(x, y, ctx, *wr._call_selection(ctx))

        unplanned_mod = Unplanned()

        def unplanned():
            with runtime_context(tier="lossless"):
                for _ in range(args.inner):
                    unplanned_mod(x)

        def peft():
            for _ in range(args.inner):
                F.linear(x, w, b) + F.linear(F.linear(x, down), up) * s

        def plain_n():
            for _ in range(args.inner):
                plain()

        with runtime_context(tier="lossless"):
            got = lin(x)
        want = F.linear(x, w, b) + F.linear(F.linear(x, down), up) * s
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6) and not torch.allclose(got, plain(), atol=1e-4), \
            "the wrapped layer does not compute base + adapter"
        with runtime_context(tier="lossless"):
            assert torch.equal(unplanned_mod(x), lin(x)), "the unplanned arm computes other bits"
        arms = {"lossless": under("lossless"), "exact": under("exact"),
                "scheduled": under("lossless", {"a": (0.5, None)}), "peft": peft, "unplanned": unplanned}
        stats = paired_rounds(arms, plain_n, "cpu", warmup=1, repeats=repeats)
    out = {}
    print(f"{'arm':10s} {'us/call':>8s} {'x plain':>8s} {'+us':>7s}")
    for name, st in stats.items():
        us = st.median_ms * 1e3 / args.inner
        ratio = st.ratio("base")
        plain_us = us / ratio
        out[name] = {"us": us, "ratio": ratio, "added_us": us - plain_us}
        print(f"{name:10s} {us:8.2f} {ratio:8.2f} {us - plain_us:7.2f}")
    print(f"# {load_string()}")
    print(f"added us: planned / unplanned (lossless): {out['lossless']['added_us'] / out['unplanned']['added_us']:.2f}")
    print(f"added us per adapted call (lossless): {out['lossless']['added_us']:.2f}")
    return out


if __name__ == "__main__":
    main()
