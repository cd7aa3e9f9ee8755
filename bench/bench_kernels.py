"""Side-by-side timings of the LoRA linear paths and the fused linear+GELU.

Every row is timed in alternation with the base F.linear of its shape and dtype
and reported as the median ratio ("x base"; the base row itself reads ~1.00,
which shows the noise), so machines and runs compare by ratio.

CPU (always; torch paths only, the Triton interpreter is not a CPU backend):
  base      F.linear(x, W, b)
  peft      F.linear(x, W, b) + F.linear(F.linear(x, A), B) * s     (PEFT's shape)
  addmm     torch.addmm(b, x, W^T).addmm_(x A^T, B^T, alpha=s)        (in place)
  merged    F.linear(x, W + s B A, b)                                 (base cost on merged W)
  delta first / kconcat cached / kconcat rebuilt: the registered cuBLAS-shaped LoRA
            backends (kernels/lora_linear_cublas.py), no GELU
  gelu eager / gelu fp32 ref: linear+GELU unfused in the dtype, and the fp32 reference
CUDA (when present) adds the Triton kernels and cuBLASLt, tokens 4096 and 8192:
  fused gelu        linear_gelu_tanh, backend triton (base fused kernel)
  cublaslt gelu     linear_gelu_tanh, backend cublaslt (where its device check passes)
  lora fused gelu   lora_linear(gelu=True), backend triton (LoRA-aware fused kernel)
  lora eager gelu   the unfused chain: PEFT-shaped delta, then GELU

Shapes: Wan2.1-1.3B FFN (1536 -> 8960) and Flux (3072 -> 12288); ranks 16/64/128.

    python bench/bench_kernels.py [--device cpu|cuda] [--quick]

Last CPU run (--quick, 2 shared cores, torch 2.13): the base row reads 0.91-1.04
(the noise); bf16: peft 1.19-1.26x, addmm 1.04-1.28x, merged 0.96-1.23x, gelu
eager 1.12x, gelu fp32 ref 3.2-3.3x; fp32: peft 1.12-1.39x, addmm 0.79-1.19x.
No CUDA numbers yet: the Triton rows have not been measured on a GPU.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from comfyui_lora_runtime.kernels.linear_gelu_tanh import (linear_gelu_tanh, linear_gelu_tanh_eager,
                                                           linear_gelu_tanh_torch)
from comfyui_lora_runtime.kernels import registry
from comfyui_lora_runtime.kernels.lora_linear import lora_linear, lora_linear_eager

SHAPES = {"wan-1.3b-ffn": (1536, 8960), "flux": (3072, 12288)}
CPU_TOKENS = {"wan-1.3b-ffn": 1024, "flux": 512}  # kept short: CPU bf16 GEMMs are slow
CUDA_TOKENS = (4096, 8192)
RANKS = (16, 64, 128)
SCALE = 0.75  # a strength * alpha/rank that is not 1.0, so the multiply is timed


def timed(fn, base, device: str, warmup: int, repeats: int, inner: int) -> tuple[float, float]:
    """(median ms per call, median ratio to `base`), the two timed in alternation.

    Each repeat times `inner` calls of base, then `inner` calls of fn, so drift
    and other load on a shared machine hit both sides of every ratio alike.
    """
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def batch(f):
        sync()
        start = time.perf_counter()
        for _ in range(inner):
            f()
        sync()
        return (time.perf_counter() - start) * 1e3 / inner

    for _ in range(warmup):
        fn()
    ms, ratios = [], []
    for _ in range(repeats):
        b = batch(base)
        m = batch(fn)
        ms.append(m)
        ratios.append(m / b)
    return statistics.median(ms), statistics.median(ratios)


def make(tokens, k, n, r, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(device, dtype)
    a = (torch.randn(r, k, generator=g) / k ** 0.5).to(device, dtype)
    bb = (torch.randn(n, r, generator=g) / r ** 0.5).to(device, dtype)
    return x, w, b, a, bb


def rows_for(name, tokens, dtype, device, args):
    """[(rank, path, ms, ratio to base)] for one shape and dtype."""
    k, n = SHAPES[name]
    x, w, b, _, _ = make(tokens, k, n, 1, dtype, device)

    def base():
        return F.linear(x, w, b)

    t = dict(base=base, device=device, warmup=args.warmup, repeats=args.repeats, inner=args.inner)
    out = [("-", "base", *timed(base, **t)),
           ("-", "gelu eager", *timed(lambda: linear_gelu_tanh_eager(x, w, b), **t)),
           ("-", "gelu fp32 ref", *timed(lambda: linear_gelu_tanh_torch(x, w, b), **t))]
    if device == "cuda":
        out.append(("-", "fused gelu", *timed(lambda: linear_gelu_tanh(x, w, b, backend="triton"), **t)))
        if not registry.get("linear_gelu_tanh", "cublaslt").why_not(x.device, x.dtype):
            out.append(("-", "cublaslt gelu", *timed(lambda: linear_gelu_tanh(x, w, b, backend="cublaslt"), **t)))
    wt = w.t()
    for r in RANKS:
        _, _, _, a, bb = make(tokens, k, n, r, dtype, device, seed=r)
        merged = (w.float() + SCALE * (bb.float() @ a.float())).to(dtype)
        out += [
            (r, "peft", *timed(lambda: F.linear(x, w, b) + F.linear(F.linear(x, a), bb) * SCALE, **t)),
            (r, "addmm", *timed(lambda: torch.addmm(b, x, wt).addmm_(x @ a.t(), bb.t(), alpha=SCALE), **t)),
            (r, "merged", *timed(lambda: F.linear(x, merged, b), **t)),
        ]
        for be in ("delta_first", "kconcat_cached", "kconcat_rebuilt"):
            state = {}
            out.append((r, be.replace("_", " "), *timed(
                lambda be=be, state=state: lora_linear(x, w, b, a, bb, SCALE, backend=be, state=state), **t)))
        if device == "cuda":
            out += [
                (r, "lora fused gelu",
                 *timed(lambda: lora_linear(x, w, b, a, bb, SCALE, gelu=True, backend="triton"), **t)),
                (r, "lora eager gelu",
                 *timed(lambda: lora_linear_eager(x, w, b, a, bb, SCALE, gelu=True), **t)),
            ]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda when available, else cpu")
    p.add_argument("--quick", action="store_true", help="fewer repeats (and one CUDA token count)")
    args = p.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    if device == "cpu":
        args.warmup, args.repeats, args.inner = (1, 3, 1) if args.quick else (2, 7, 1)
        token_sets = {name: (CPU_TOKENS[name],) for name in SHAPES}
    else:
        args.warmup, args.repeats, args.inner = (3, 5, 5) if args.quick else (5, 9, 10)
        token_sets = {name: CUDA_TOKENS[:1] if args.quick else CUDA_TOKENS for name in SHAPES}

    print(f"# device={device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}, threads={torch.get_num_threads()}, scale={SCALE}, "
          f"median of {args.repeats} x {args.inner} calls after {args.warmup} warm-up")
    print(f"| {'dtype':8} | {'shape':13} | {'tokens':>6} | {'rank':>4} | {'path':16} | {'ms':>9} | {'x base':>6} |")
    print(f"|{'-' * 10}|{'-' * 15}|{'-' * 8}|{'-' * 6}|{'-' * 18}|{'-' * 11}|{'-' * 8}|")
    for dtype in (torch.bfloat16, torch.float32):
        for name in SHAPES:
            for tokens in token_sets[name]:
                for rank, path, ms, ratio in rows_for(name, tokens, dtype, device, args):
                    print(f"| {str(dtype).split('.')[-1]:8} | {name:13} | {tokens:>6} | {str(rank):>4} | "
                          f"{path:16} | {ms:9.3f} | {ratio:6.2f} |", flush=True)


if __name__ == "__main__":
    main()
