"""Fusion sites: Linear -> GELU(tanh) feed-forwards, mounted with guarded fused forwards.

Sites are found by structure (names are only reported):
- ``sequential``: nn.Sequential(Linear, GELU(tanh), ...) — Wan ``blocks.N.ffn``, Flux
  ``img_mlp``/``txt_mlp`` (ComfyUI), the embedded model;
- ``proj_gelu``: a GELU module holding ``.proj`` with ``approximate == "tanh"`` —
  diffusers FeedForward ``ff.net.0`` (LTX, Qwen-Image ``img_mlp.net.0``);
- ``mlp``: a module with ``fc1``, ``act`` (GELU tanh) and ``fc2`` and no dropout/norm
  between them — PixArt / SD3 ``mlp``.

Mounting sets an instance ``forward`` on the site module, so module names, state
dicts and LoRA wrapping of ``fc1`` by name are untouched; unmounting deletes it and
the class forward is back: the output is bit for bit the unmounted one.

Guards
- mount time (static): the first linear is judged by the layer it wraps
  (``get_base_layer()``): a plain float weight, no weight-function patches, no
  on-the-fly cast, no quantization attributes, GELU really tanh. Sites failing it
  are listed with the reason and not mounted.
- probe (mount time): every fused path the site may take is compiled and launched on
  its real weights and adapter factors and compared with the fp32 reference; a path
  that fails or disagrees leaves the site unmounted, with the reason in the report.
  After that nothing is caught: a kernel error during sampling (out-of-memory too)
  propagates, after the weights are restored, never a silent switch of path.
- speed (CUDA, first call per shape bucket): the fused and the unfused path are both
  timed on the real input and the faster one is kept for that bucket (the report says
  which and the times): a fused kernel that loses to cuBLAS on this GPU is not used.
- call time (live): the fused path runs only inside a non-exact runtime context,
  with matching dtype/device; and the layer's adapters (the LoraLinear attached to
  it, see wrapper.attach) are asked whether they add output now
  (`lora_active`). Inactive (disabled, or merged without offset): the base fused
  epilogue, since the weight already holds any update. Active dynamic adapter: the
  LoRA-aware fused kernel when mounted and every live slot is plain LoRA, else the
  unfused forward — never the base weight alone. A strength schedule reaches the kernel
  as its scale (`adapter_stack`; scheduled to 0 this call: the base fused epilogue); a
  per-branch adapter in a batched CFG call runs unfused (`unfusable_reason` says so).

By default (backend "auto") sites mount only where the Triton kernels run (CUDA):
on the CPU the fp32 torch reference is not faster than the eager forward. Tests
mount with backend "torch" (the reference) or "triton" (interpreter).
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from ...kernels import linear_gelu_tanh, lora_linear, resolve_backend
from ...kernels.launch_configs import m_bucket
from ...kernels.linear_gelu_tanh import linear_gelu_tanh_torch
from ...kernels.lora_linear import lora_linear_torch
from .fusion_registry import FUSIONS
from ..layer.runtime_context import current_context
from ..settings import Tier, parse_tier
from ..layer.wrapper import attached_wrapper

log = logging.getLogger(__name__)


def _is_tanh_gelu(m) -> bool:
    return isinstance(m, nn.GELU) and m.approximate == "tanh"


def _is_passthrough(m) -> bool:
    return isinstance(m, nn.Identity) or (isinstance(m, nn.Dropout) and m.p == 0.0)


@dataclass
class SiteSpec:
    path: str
    kind: str
    module: nn.Module

    def fc1(self) -> nn.Module:
        m = self.module
        if self.kind == "sequential":
            return m._modules["0"]
        if self.kind == "proj_gelu":
            return m.proj
        return m.fc1

    @property
    def fc1_path(self) -> str:
        tail = {"sequential": "0", "proj_gelu": "proj", "mlp": "fc1"}[self.kind]
        return f"{self.path}.{tail}" if self.path else tail


def find_sites(model: nn.Module) -> list[SiteSpec]:
    sites = []
    for path, m in model.named_modules():
        if isinstance(m, nn.Sequential) and len(m) >= 2 and _is_linear_like(m[0]) and _is_tanh_gelu(m[1]):
            sites.append(SiteSpec(path, "sequential", m))
        elif (type(m).__name__ == "GELU" and not isinstance(m, nn.GELU) and _is_linear_like(getattr(m, "proj", None))
              and getattr(m, "approximate", None) == "tanh"):
            sites.append(SiteSpec(path, "proj_gelu", m))
        elif (_is_linear_like(getattr(m, "fc1", None)) and _is_tanh_gelu(getattr(m, "act", None))
              and isinstance(getattr(m, "fc2", None), nn.Module)
              and all(_is_passthrough(getattr(m, a)) for a in ("drop1", "norm", "drop2") if hasattr(m, a))):
            sites.append(SiteSpec(path, "mlp", m))
    return sites


def lora_wrapper(fc1: nn.Module):
    """The adapters on this layer: an attached LoraLinear, or the layer itself when it is one."""
    if getattr(fc1, "is_lora_wrapper", False):
        return fc1
    return attached_wrapper(fc1)


def _is_linear_like(m) -> bool:
    if m is None:
        return False
    base = m.get_base_layer() if hasattr(m, "get_base_layer") else m
    return isinstance(base, nn.Linear)


def static_guard(fc1: nn.Module) -> tuple[bool, str]:
    """Judge the layer a wrapper wraps; never the wrapper's forwarded attributes alone."""
    base = fc1.get_base_layer() if hasattr(fc1, "get_base_layer") else fc1
    if not isinstance(base, nn.Linear):
        return False, f"first linear is a {type(base).__name__}"
    w = base.weight
    if type(w) not in (torch.Tensor, nn.Parameter):
        return False, f"weight is a {type(w).__name__} (quantized/packed)"
    if w.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False, f"weight dtype {w.dtype}"
    if getattr(base, "weight_function", None) or getattr(base, "bias_function", None):
        return False, "weight/bias-function patches (computed at call time)"
    if getattr(base, "comfy_cast_weights", False):
        return False, "weights are cast/offloaded at call time"
    for attr in ("scale_weight", "weight_scale", "quant_state", "qweight", "gather_output", "skip_bias_add"):
        if getattr(base, attr, None) not in (None, False):
            return False, f"layer has {attr}"
    if base.bias is not None and base.bias.dtype != w.dtype:
        return False, "bias dtype differs from weight dtype"
    return True, ""


def adapter_stack(lw, x: torch.Tensor):
    """(A [R, in], B [out, R], per-rank scale) the LoRA-aware kernel takes for this call: the
    layer's updates answer `stack()` (`LoraLinear.stack`), or None: the site runs unfused."""
    return lw.stack(x.device, x.dtype)


class MountedSite:
    """A site with a fused forward installed; routes counted per call."""

    def __init__(self, spec: SiteSpec, fusions: tuple[str, ...], tier: Tier, backend: str):
        self.spec, self.fusions, self.tier, self.backend = spec, fusions, tier, backend
        self.routes: Counter = Counter()
        self.speed: dict[str, dict] = {}  # measured choice per shape bucket (CUDA): key -> ms of both paths
        module = spec.module
        if spec.kind == "sequential":
            def fwd(x, _s=self):
                h = _s.linear_gelu(x)
                for m in list(module._modules.values())[2:]:
                    h = m(h)
                return h
        elif spec.kind == "proj_gelu":
            def fwd(x, _s=self):
                return _s.linear_gelu(x)
        else:
            def fwd(x, _s=self):
                h = _s.linear_gelu(x)
                for a in ("drop1", "norm"):
                    if hasattr(module, a):
                        h = getattr(module, a)(h)
                h = module.fc2(h)
                return module.drop2(h) if hasattr(module, "drop2") else h
        module.forward = fwd

    def unmount(self) -> None:
        self.spec.module.__dict__.pop("forward", None)

    @torch.no_grad()
    def probe(self) -> str:
        """Compile and launch every fused path this site may take, on its real weights (and
        its adapters' real factors) with a 16-row input, and compare with the fp32 reference
        of the same math. '' when every path ran and agreed, else why not (the site is then
        not mounted). Only here are kernel errors caught: at call time they propagate."""
        fc1 = self.spec.fc1()
        base = fc1.get_base_layer() if hasattr(fc1, "get_base_layer") else fc1
        w, b = base.weight, base.bias
        x = torch.randn(16, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
        checks = []
        if "linear_gelu_tanh" in self.fusions:
            checks.append(("linear_gelu_tanh", lambda: linear_gelu_tanh(x, w, b, backend=self.backend),
                           lambda: linear_gelu_tanh_torch(x, w, b)))
        lw = lora_wrapper(fc1)
        st = adapter_stack(lw, x) if lw is not None and lw.lora_active else None
        if "lora_linear_gelu_tanh" in self.fusions and st is not None:
            a, bm, scale = st
            checks.append(("lora_linear_gelu_tanh", lambda: lora_linear(x, w, b, a, bm, scale, gelu=True,
                                                                        backend=self.backend),
                           lambda: lora_linear_torch(x, w, b, a, bm, scale, gelu=True)))
        for name, fused, reference in checks:
            try:
                got, want = fused().float(), reference().float()
            except Exception as e:  # the probe is where a kernel that cannot compile or launch here is caught
                return f"{name} failed its probe on {w.device} ({type(e).__name__}: {str(e)[:240]})"
            # 4 ulps of the output dtype at the output's scale: a broken tile or launch is off by O(1)
            tol = 4 * torch.finfo(w.dtype).eps * float(want.abs().max().clamp_min(1.0))
            err = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
            if not err <= tol:
                return f"{name} computed wrong on {w.device} in its probe (max error {err:.3g} > {tol:.3g})"
        return ""

    def unfused(self, fc1: nn.Module, x: torch.Tensor, route: str = "unfused") -> torch.Tensor:
        self.routes[route] += 1
        return torch.nn.functional.gelu(fc1(x), approximate="tanh")

    def linear_gelu(self, x: torch.Tensor) -> torch.Tensor:
        fc1 = self.spec.fc1()
        ctx = current_context()
        if ctx is None or not ctx.tier.admits(Tier.LOSSLESS) or not ctx.tier.admits(self.tier):
            return self.unfused(fc1, x)
        return self._routed(fc1, x, ctx)

    def _routed(self, fc1: nn.Module, x: torch.Tensor, ctx) -> torch.Tensor:
        base = fc1.get_base_layer() if hasattr(fc1, "get_base_layer") else fc1
        w, b = base.weight, base.bias
        if (x.dtype != w.dtype or x.device != w.device or getattr(base, "weight_function", None)
                or x.shape[-1] != w.shape[1]):
            return self.unfused(fc1, x)
        lw = lora_wrapper(fc1)
        if lw is not None and lw.lora_active:
            if "lora_linear_gelu_tanh" in self.fusions:
                st = adapter_stack(lw, x)
                if st is not None:
                    a, bmat, scale = st
                    def fused():
                        return lora_linear(x, w, b, a, bmat, scale, gelu=True, backend=self.backend)
                    if self._fused_is_faster("lora", x, w, a.shape[0], fused, lambda: self._eager(fc1, x)):
                        self.routes["lora_fused"] += 1
                        return fused()
                    return self.unfused(fc1, x, "unfused (measured faster here)")
                return self.unfused(fc1, x, f"unfused ({lw.unfusable_reason()})")
            return self.unfused(fc1, x)
        if "linear_gelu_tanh" in self.fusions:
            def fused():
                return linear_gelu_tanh(x, w, b, backend=self.backend)
            if self._fused_is_faster("base", x, w, 0, fused, lambda: self._eager(fc1, x)):
                self.routes["base_fused"] += 1
                return fused()
            return self.unfused(fc1, x, "unfused (measured faster here)")
        return self.unfused(fc1, x)

    @staticmethod
    def _eager(fc1, x):
        return torch.nn.functional.gelu(fc1(x), approximate="tanh")

    def _fused_is_faster(self, kind: str, x, w, rank: int, fused, eager) -> bool:
        """On CUDA, the first call of each shape bucket times both paths on the real input
        (shared by every site of that shape) and keeps the faster; elsewhere fused."""
        if not x.is_cuda or not MEASURE_SPEED:
            return True
        key = (str(x.device), str(x.dtype), kind, tuple(w.shape), rank, m_bucket(x.numel() // x.shape[-1]))
        choice = _SPEED_CHOICES.get(key)
        if choice is None:
            f_ms, e_ms = _time_cuda(fused), _time_cuda(eager)
            choice = _SPEED_CHOICES[key] = {"fused_ms": round(f_ms, 4), "unfused_ms": round(e_ms, 4),
                                            "fused": f_ms <= e_ms}
        self.speed[f"{kind} M<={key[-1]} R={rank}"] = choice
        return choice["fused"]

    def report(self) -> dict:
        r = {"site": self.spec.path, "fusions": list(self.fusions), "routes": dict(self.routes)}
        if self.speed:
            r["measured"] = dict(self.speed)
        return r


_SPEED_CHOICES: dict[tuple, dict] = {}
#: Tests that must exercise the fused kernels on CUDA turn the measured choice off.
MEASURE_SPEED = True


def _time_cuda(fn, reps: int = 3) -> float:
    """Median ms of `fn` on the current CUDA stream after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@dataclass
class MountedFusions:
    sites: list[MountedSite] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)   # site path -> why not mounted

    def unmount(self) -> None:
        for s in self.sites:
            s.unmount()

    def report(self) -> list[dict]:
        out = [s.report() for s in self.sites]
        out += [{"site": p, "fusions": [], "skipped": why} for p, why in self.skipped.items()]
        return out


def mount_fusions(model: nn.Module, tier, backend: str = "auto", only: list[str] | None = None) -> MountedFusions:
    """Mount every fusion the tier admits on every site that passes the static guard."""
    tier = parse_tier(tier)
    names = tuple(n for n, f in FUSIONS.items() if tier.admits(f.min_tier) and (only is None or n in only))
    mounted = MountedFusions()
    if not names:
        return mounted
    for spec in find_sites(model):
        fc1 = spec.fc1()
        ok, why = static_guard(fc1)
        if ok and backend == "auto":
            base = fc1.get_base_layer() if hasattr(fc1, "get_base_layer") else fc1
            if resolve_backend("auto", base.weight) != "triton":
                ok, why = False, "no Triton device: the torch reference is not faster than eager here"
        if not ok:
            mounted.skipped[spec.path] = why
            continue
        site = MountedSite(spec, names, tier, backend)
        why = site.probe()
        if why:
            site.unmount()
            log.warning("fusion site %s left unfused: %s", spec.path, why)
            mounted.skipped[spec.path] = why
            continue
        mounted.sites.append(site)
    if mounted.sites:
        log.info("mounted %s on %d sites", ", ".join(names), len(mounted.sites))
    return mounted
