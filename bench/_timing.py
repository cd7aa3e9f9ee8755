"""Shared timing helpers for the bench/ scripts: side-by-side ratios on a noisy machine.

Two schemes, both reporting medians of per-round ratios (never ratios of medians), so
load from other processes hits both sides of every ratio alike:

- `paired_rounds(arms, base)`: every round times `base` immediately before each arm
  (arm order rotated round by round); ratio = arm / the base timed just before it.
  For cheap calls (one Linear).
- `interleaved_rounds(arms)`: every round times each arm once, order rotated round by
  round; ratios between arms are taken within a round. For expensive calls (a
  model forward) where a base call per arm would double the run time.

CPU: time.perf_counter around `inner` calls. CUDA: torch.cuda.Event pairs recorded
around the `inner` calls after a synchronize (GPU time, launch gaps included).
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


def load_string() -> str:
    try:
        a, b, c = os.getloadavg()
        return f"load avg {a:.2f} {b:.2f} {c:.2f} (1/5/15 min) on {os.cpu_count()} cpus"
    except OSError:
        return "load avg n/a"


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine() or "cpu"


def header(device: str, extra: str = "") -> str:
    s = (f"# device={device} ({device_name(device)}), torch {torch.__version__}, "
         f"threads={torch.get_num_threads()}, {load_string()}")
    return s + (f"\n# {extra}" if extra else "")


def resolve_device(requested: str | None) -> str:
    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    return device


def time_calls(fn: Callable, device: str, inner: int = 1) -> float:
    """Milliseconds per call of `fn`, averaged over `inner` back-to-back calls. Device
    "cpu_process": CPU seconds of this process (robust to other jobs at one thread)."""
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / inner
    clock = time.process_time if device == "cpu_process" else time.perf_counter
    t0 = clock()
    for _ in range(inner):
        fn()
    return (clock() - t0) * 1e3 / inner


@dataclass
class ArmStats:
    ms: list[float] = field(default_factory=list)                 # per round
    ratios: dict[str, list[float]] = field(default_factory=dict)  # reference name -> per-round ratios

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ms)

    @property
    def min_ms(self) -> float:
        return min(self.ms)

    def ratio(self, ref: str) -> float:
        return statistics.median(self.ratios[ref])

    def spread(self, ref: str) -> tuple[float, float]:
        r = self.ratios[ref]
        return min(r), max(r)


def _rotated(names: list[str], k: int) -> list[str]:
    k %= max(1, len(names))
    return names[k:] + names[:k]


def paired_rounds(arms: dict[str, Callable], base: Callable, device: str, *, warmup: int, repeats: int,
                  inner: int = 1) -> dict[str, ArmStats]:
    """Each arm timed right after a base call, `repeats` rounds; ratios under key "base"."""
    for _ in range(warmup):
        base()
        for fn in arms.values():
            fn()
    names = list(arms)
    out = {n: ArmStats(ratios={"base": []}) for n in names}
    for k in range(repeats):
        for n in _rotated(names, k):
            b = time_calls(base, device, inner)
            m = time_calls(arms[n], device, inner)
            out[n].ms.append(m)
            out[n].ratios["base"].append(m / b)
    return out


def interleaved_rounds(arms: dict[str, Callable], device: str, *, refs: tuple[str, ...], warmup: int,
                       repeats: int, inner: int = 1, progress: Callable[[str], None] | None = None
                       ) -> dict[str, ArmStats]:
    """Every arm once per round (order rotated); ratios to each arm in `refs` within the round."""
    names = list(arms)
    for w in range(warmup):
        for n in names:
            arms[n]()
        if progress:
            progress(f"warm-up {w + 1}/{warmup} done")
    out = {n: ArmStats(ratios={r: [] for r in refs}) for n in names}
    for k in range(repeats):
        round_ms = {}
        for n in _rotated(names, k):
            round_ms[n] = time_calls(arms[n], device, inner)
        for n in names:
            out[n].ms.append(round_ms[n])
            for r in refs:
                out[n].ratios[r].append(round_ms[n] / round_ms[r])
        if progress:
            progress(f"round {k + 1}/{repeats}: " + ", ".join(f"{n} {round_ms[n]:.0f}" for n in names) + " ms")
    return out


def parse_dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
            "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
