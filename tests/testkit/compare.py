"""Comparison helpers for the tests: one verbose tensor comparison, and an aten.mul counter.

Every failure message says how many elements disagree, where the first ones are
(with both values), the max abs error, and any NaN/Inf disagreement, so a broken
tile or mask shows up as a pattern of indices rather than a bare assert.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SHOW = 5


def _special_report(actual: torch.Tensor, expected: torch.Tensor) -> tuple[int, str]:
    a, e = actual.double(), expected.double()
    nan_bad = torch.isnan(a) != torch.isnan(e)
    inf_bad = (torch.isinf(a) | torch.isinf(e)) & ~torch.isnan(a) & ~torch.isnan(e) & (a != e)
    bad = nan_bad | inf_bad
    n = int(bad.sum())
    if not n:
        return 0, ""
    idx = bad.nonzero()[:SHOW].tolist()
    lines = [f"  {tuple(i)}: got {a[tuple(i)].item()!r}, expected {e[tuple(i)].item()!r}" for i in idx]
    return n, f"{n} NaN/Inf disagreement(s), first:\n" + "\n".join(lines)


def _finite_error(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|actual - expected| in fp64 where both are finite, 0 elsewhere."""
    a, e = actual.double(), expected.double()
    both = torch.isfinite(a) & torch.isfinite(e)
    return torch.where(both, (a - e).abs(), torch.zeros_like(a))


def max_error(actual: torch.Tensor, truth: torch.Tensor) -> float:
    """Max abs error over the elements where both are finite."""
    err = _finite_error(actual, truth)
    return float(err.max()) if err.numel() else 0.0


def _most(tol) -> float:
    """A tolerance for the message: a number, or the largest of a per-element tensor."""
    return float(torch.as_tensor(tol).max())


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float,
                 name: str = "") -> None:
    """|actual - expected| <= atol + rtol * |expected| elementwise, specials equal."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    n_special, special = _special_report(actual, expected)
    a, e = actual.double(), expected.double()
    err = _finite_error(actual, expected)
    bad = err > atol + rtol * e.abs()
    n_bad = int(bad.sum())
    if n_bad or n_special:
        idx = bad.nonzero()[:SHOW].tolist()
        lines = [f"  {tuple(i)}: got {a[tuple(i)].item():.8g}, expected {e[tuple(i)].item():.8g}"
                 for i in idx]
        raise AssertionError(
            f"{name}: {n_bad}/{err.numel()} elements off (atol={_most(atol):g}, rtol={_most(rtol):g}), "
            f"max abs err {float(err.max()):.3g}\n" + "\n".join(lines) + ("\n" + special if special else ""))


def assert_within_relative_rule(kernel: torch.Tensor, torch_lowp: torch.Tensor, truth: torch.Tensor,
                                *, factor: float = 2.0, eps: float = 1e-6, name: str = "") -> None:
    """Low-precision rule: the kernel's max error against an fp64 truth is below
    `factor` x torch's own low-precision error (+eps), and specials agree with it."""
    n_special, special = _special_report(kernel, truth)
    k_err, t_err = max_error(kernel, truth), max_error(torch_lowp, truth)
    if n_special or k_err > factor * t_err + eps:
        diff = _finite_error(kernel, truth)
        worst = diff.flatten().topk(min(SHOW, diff.numel())).indices
        lines = []
        for flat in worst.tolist():
            i = tuple(torch.unravel_index(torch.tensor(flat), diff.shape))
            i = tuple(int(v) for v in i)
            lines.append(f"  {i}: kernel {kernel.double()[i].item():.8g}, "
                         f"torch {torch_lowp.double()[i].item():.8g}, truth {truth[i].item():.8g}")
        raise AssertionError(
            f"{name}: kernel max err {k_err:.3g} > {factor} x torch {kernel.dtype} err {t_err:.3g} + {eps:g}; "
            "worst:\n" + "\n".join(lines) + ("\n" + special if special else ""))


def assert_differs(actual: torch.Tensor, wrong: torch.Tensor, *, min_abs: float, name: str = "") -> None:
    """The output must not equal a wrong answer (base only, GELU off...): max |diff| > min_abs."""
    diff = max_error(actual, wrong)
    assert diff > min_abs, (f"{name}: output is within {diff:.3g} of the wrong answer "
                            f"(needs > {min_abs:g}); the tested branch did not change the result")


def order_atol(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor | None = None, bb: torch.Tensor | None = None,
               scale=None) -> torch.Tensor:
    """Per-element tolerance for two fp32 accumulations of the same k = K (+ R) products
    summed in different orders (the kernel's tiles vs cuBLAS / numpy).

    Model: each add rounds by up to 2^-24 of the running sum, whose size after i of k
    random-signed products is about sqrt(i/k * sum p^2); the two sums then differ with a
    standard deviation of about 0.3 * 2^-24 * sqrt(k * sum p^2). The tolerance is 5x that
    scale (about 17 standard deviations: the max over 10^6 outputs is about 5) times 1.2
    for GELU's slope (<= 1.13). It only matters where the output cancels (|y| far below
    sqrt(sum p^2)): K = 1536 gave 1.4e-6 on outputs of 2.6e-5 on an H200, where one bf16
    ulp is 1.2e-7 and this tolerance is 2.1e-5."""
    xd = x.double().reshape(-1, x.shape[-1])
    sq = xd.square() @ w.double().square().t()
    k = x.shape[-1]
    if a is not None and a.shape[0]:
        s = scale.double().to(xd.device) if isinstance(scale, torch.Tensor) else float(scale)
        b2 = bb.double().square().t()
        h = (xd @ a.double().t()) * s
        sq = sq + h.square() @ b2 + ((xd.square() @ a.double().square().t()) * (s * s)) @ b2
        k += a.shape[0]
    return (1.2 * 5 * 2.0 ** -24 * (k * sq).sqrt()).reshape(*x.shape[:-1], w.shape[0])


class MulCounter(TorchDispatchMode):
    """Counts aten.mul / aten.mul_ calls inside its block (the scaling contract: a unit factor
    is never multiplied; folded tiers multiply once)."""

    def __init__(self):
        super().__init__()
        self.muls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mul, torch.ops.aten.mul_):
            self.muls += 1
        return func(*args, **(kwargs or {}))
