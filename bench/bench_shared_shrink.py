"""One shrink GEMM for q/k/v and for sliced updates: the time the adapter adds, shared vs not,
side by side in one run.

Two cases, each timed as the time of the layer calls over plain (adapter-free) calls of the same
layers, arms in rotated order per round (medians over rounds):
- ``qkv``: Wan-2.1-1.3B self-attention q, k, v (dim 1536) carrying a rank-32 adapter each, called
  on one input as the model does: ``shared`` (the engine's sibling group, lossless) against
  ``unshared`` (``LoraInjector.share_shrink = False``: each projection its own shrink GEMM).
- ``sliced``: a Flux double block's fused ``qkv`` (3072 -> 9216) carrying diffusers-format
  ``to_q``/``to_k``/``to_v`` adapters of rank 16 (one sliced update): ``segmented`` (one shrink
  GEMM, per-slice addmm_ into the output) against ``per part`` (the general path: per part its
  own GEMM pair into a zero-filled full-width delta, then added).
Times are CPU seconds of this process at one thread (robust to other jobs), wall clock else.
Every arm's output is checked against the fp64 truth before timing (and against the adapter-off
output). The last line is ``added time shared / unshared (qkv): <ratio>``; the line before it
gives the sliced case's ``segmented / per part``.

    python bench/bench_shared_shrink.py [--quick] [--tokens N] [--dtype fp32|bf16] [--threads N]
    python bench/bench_shared_shrink.py --smoke      # tiny dims, one round (the CI test)
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from comfyui_lora_runtime.lora_runtime import AdaptedLayer, runtime_context
from comfyui_lora_runtime.lora_runtime import updates as U
from comfyui_lora_runtime.lora_runtime import AdapterSpec, LoraInjector, applied, plan
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
from comfyui_lora_runtime.lora_runtime.layer.general_path import forward_general, select
from comfyui_lora_runtime.lora_runtime.layer.runtime_context import current_context

from _timing import dtype_name, header, interleaved_rounds, load_string, parse_dtype
from bench_dit_step import ALPHA, STRENGTH, write_kohya



class Attn(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x):
        return self.q(x), self.k(x), self.v(x)


class Holder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.self_attn = Attn(dim)


def _pair(out_f, in_f, r, g, dtype):
    return ((torch.randn(r, in_f, generator=g) / in_f ** 0.5).to(dtype),
            (torch.randn(out_f, r, generator=g) / r ** 0.5 * 0.05).to(dtype))


def _err(got, truth):
    return float((got.double() - truth).norm() / truth.norm())


def qkv_case(dim, rank, tokens, dtype, tmp):
    """(arms, plain, check lines) of the q/k/v case."""
    g = torch.Generator().manual_seed(0)
    models = {}
    base = Holder(dim).to(dtype).eval().requires_grad_(False)
    tensors = {f"self_attn.{n}": _pair(dim, dim, rank, g, dtype) for n in "qkv"}
    path = Path(tmp) / "qkv.safetensors"
    write_kohya(path, tensors)
    stack = contextlib.ExitStack()
    for arm, share in (("shared", True), ("unshared", False)):
        m = copy.deepcopy(base)
        inj = LoraInjector(m)
        inj.share_shrink = share
        stack.enter_context(applied(m, plan(m, [AdapterSpec(str(path), STRENGTH)], mode="dynamic"),
                                    fusion_backend=None, injector=inj))
        models[arm] = (m, inj)
    x = torch.randn(1, tokens, dim, generator=g).to(dtype)
    xd = x.double()
    truth = [xd @ base.self_attn.get_submodule(n).weight.double().T + base.self_attn.get_submodule(n).bias.double()
             + (xd @ tensors[f"self_attn.{n}"][0].double().T) @ tensors[f"self_attn.{n}"][1].double().T
             * (ALPHA / rank * STRENGTH) for n in "qkv"]
    lines = []
    with torch.inference_mode(), runtime_context(tier="lossless"):
        plain = [base.self_attn(x)]
        for arm, (m, inj) in models.items():
            m.self_attn(x)  # the first call teaches the group who shares
            got = m.self_attn(x)
            errs = [_err(o, t) for o, t in zip(got, truth)]
            off = min(_err(p, t) for p, t in zip(plain[0], truth))
            assert max(errs) < off / 10, f"{arm}: the adapter is not in the output"
            lines.append(f"# qkv {arm}: rel. error vs fp64 {max(errs):.2e} (adapter off: {off:.2e}); sibling groups "
                         f"{len(inj.sibling_groups)}, calls served from a sibling's GEMM so far "
                         f"{sum(gr.shared for gr in inj.sibling_groups)}")

    def call(m):
        def run():
            with torch.inference_mode(), runtime_context(tier="lossless"):
                m.self_attn(x)
        return run
    arms = {"plain": call(base), "shared": call(models["shared"][0]), "unshared": call(models["unshared"][0])}
    return arms, lines, stack


def sliced_case(dim, rank, tokens, dtype):
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(dim, 3 * dim).to(dtype).eval().requires_grad_(False)
    parts = []
    for i in range(3):
        down, up = _pair(dim, dim, rank, g, dtype)
        parts.append((i * dim, (i + 1) * dim, U.LoRA(down, up, ALPHA)))
    v = U.Sliced(parts, 3 * dim)
    v.check_module(3 * dim, dim)
    w = AdaptedLayer(lin, "qkv")
    w.add_adapter("a", LayerAdapter("qkv", update=v), STRENGTH)
    w.attach()
    x = torch.randn(1, tokens, dim, generator=g).to(dtype)
    xd = x.double()
    truth = xd @ lin.weight.double().T + lin.bias.double()
    for lo, hi, p in parts:
        truth[..., lo:hi] += (xd @ p.down.double().T) @ p.up.double().T * (ALPHA / rank * STRENGTH)

    def general(x):
        y = w._base_call(x)
        ctx = current_context()
        return forward_general(w, x, y, ctx, select(w, ctx))

    with torch.inference_mode(), runtime_context(tier="lossless"):
        plain_out = F.linear(x, lin.weight, lin.bias)
        got, ref = lin(x), general(x)
        assert "_segmented" in w._last_plan.run.__qualname__, "the segmented plan did not run"
    off = _err(plain_out, truth)
    e_new, e_old = _err(got, truth), _err(ref, truth)
    assert e_new < off / 10 and e_old < off / 10, "the adapter is not in the output"
    lines = [f"# sliced: rel. error vs fp64 segmented {e_new:.2e}, per part {e_old:.2e} (adapter off: {off:.2e})"]

    def arm(fn):
        def run():
            with torch.inference_mode(), runtime_context(tier="lossless"):
                fn(x)
        return run
    arms = {"plain": arm(lambda t: F.linear(t, lin.weight, lin.bias)), "segmented": arm(lin), "per part": arm(general)}
    return arms, lines, w


def _added(stats, arm, ref):
    """(median arm - median plain) / (median ref - median plain): the time each adds over the
    adapter-free calls (a ratio of per-round differences is too noisy: the adapter is a few %)."""
    p = stats["plain"].median_ms
    return (stats[arm].median_ms - p) / (stats[ref].median_ms - p)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    p.add_argument("--smoke", action="store_true", help="tiny dims, one round (CI)")
    p.add_argument("--tokens", type=int, default=1530)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    if args.smoke:
        qdim, fdim, tokens, repeats, inner = 64, 64, 16, args.repeats or 1, 2
    else:
        qdim, fdim, tokens = 1536, 3072, args.tokens
        repeats, inner = args.repeats or (5 if args.quick else 11), 3
    clock = "cpu_process" if args.threads == 1 else "cpu"  # CPU seconds of this process at one thread
    times = "CPU seconds of this process" if clock == "cpu_process" else "wall clock"
    print(header("cpu", f"times: {times}; qkv: Wan-1.3B self-attention q/k/v {qdim}, rank 32; sliced: Flux qkv "
                        f"{fdim}->{3 * fdim}, 3 slices of rank 16; {tokens} tokens, {dtype_name(dtype)}, {args.threads} thread(s); "
                        f"median of {repeats} rounds x {inner} calls"))
    out = {}

    def timed(case, arms, lines, new, old):
        print("\n".join(lines))
        st = interleaved_rounds(arms, clock, refs=("plain",), warmup=1, repeats=repeats, inner=inner)
        out[case] = _added(st, new, old)
        for n in arms:
            print(f"| {case} | {n:9} | {st[n].median_ms:9.2f} ms | x plain {st[n].ratio('plain'):.3f} | added "
                  f"{st[n].median_ms - st['plain'].median_ms:8.2f} ms |")

    with tempfile.TemporaryDirectory() as tmp:
        arms, lines, stack = qkv_case(qdim, 32, tokens, dtype, tmp)
        with stack:
            timed("qkv", arms, lines, "shared", "unshared")
    arms, lines, w = sliced_case(fdim, 16, tokens, dtype)
    try:
        timed("sliced", arms, lines, "segmented", "per part")
    finally:
        w.detach()
    print(f"# {load_string()}")
    print(f"added time segmented / per part (sliced): {out['sliced']:.3f}")
    print(f"added time shared / unshared (qkv): {out['qkv']:.3f}")
    return out


if __name__ == "__main__":
    main()
