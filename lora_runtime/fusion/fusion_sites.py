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
- backends (kernels.registry): each fusion runs one kernel op; a site mounted with a
  backend name runs that backend, one mounted with "auto" may run every backend of the
  op available on its device (each probed, one that fails its probe is dropped and named
  on the report) or the unfused forward: on CUDA the first call of each shape bucket
  times them all on the real input and keeps the fastest for that bucket (the report says
  which, with the times, and which backend each route ran): a fused kernel that loses to
  cuBLAS on this GPU is not used. `use_backend(name)` forces a backend on "auto" sites.
- call time (live): the fused path runs only inside a non-exact runtime context,
  with matching dtype/device; and the layer's adapters (the AdaptedLayer attached to
  it, see wrapper.attach) are asked whether they add output now
  (`lora_active`). Inactive (disabled, or merged without offset): the base fused
  epilogue, since the weight already holds any update. Active dynamic adapter: the
  LoRA-aware fused kernel when mounted and every live slot is plain LoRA, else the
  unfused forward — never the base weight alone. A strength schedule reaches the kernel
  as its scale (`lora_factors`; scheduled to 0 this call: the base fused epilogue); a
  per-branch adapter in a batched CFG call reaches it as a per-row-and-rank scale on
  the backends that take one ("row_scale"), and runs unfused on the others (the route
  says why).

By default (backend "auto") sites mount only on CUDA, where the choice is measured;
on the CPU the eager forward runs. Tests mount with a backend name ("torch": the
reference, "triton": the interpreter, "delta_first", "kconcat_cached", ...).

Every fused LoRA path reads the adapters' factors through `lora_factors` only.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from ...kernels import linear_gelu_tanh, lora_linear, registry
from ...kernels.launch_configs import m_bucket
from ...kernels.linear_gelu_tanh import linear_gelu_tanh_torch
from ...kernels.lora_linear import lora_linear_torch
from .fusion_registry import FUSIONS
from ..layer.base_weight import fused_read_reason, wrapped
from ..layer.stacking import unfusable_reason
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
    """The adapters on this layer: an attached AdaptedLayer, or the layer itself when it is one."""
    if getattr(fc1, "is_lora_wrapper", False):
        return fc1
    return attached_wrapper(fc1)


def _is_linear_like(m) -> bool:
    if m is None:
        return False
    return isinstance(wrapped(m), nn.Linear)


def lora_factors(lw, x: torch.Tensor):
    """The factors of the adapters live on this layer for this call (`AdaptedLayer.fused_factors`:
    read off the layer's call plan, built once per plan). The one place fused paths read
    adapter factors."""
    return lw.fused_factors(x)


def static_guard(fc1: nn.Module) -> tuple[bool, str]:
    """Judge the layer a wrapper wraps (`base_weight.fused_read_reason`): a weight read through
    its layer (packed, quantized, GGUF of any type) is not handed to a fused GEMM."""
    why = fused_read_reason(fc1)
    return not why, why


UNFUSED = registry.UNFUSED
_KIND = {"linear_gelu_tanh": "base", "lora_linear": "lora"}



class MountedSite:
    """A site with a fused forward installed; routes and backends counted per call.

    `requested`: {op: "auto" or a backend name}; `candidates`: {op: backend names this
    site may run, highest priority first} (set by `plan`, pruned by `probe`)."""

    def __init__(self, spec: SiteSpec, fusions: tuple[str, ...], tier: Tier, requested: dict[str, str]):
        self.spec, self.fusions, self.tier, self.requested = spec, fusions, tier, requested
        self.candidates: dict[str, list[str]] = {}
        self.routes: Counter = Counter()
        self.ran: Counter = Counter()         # "route:backend" -> calls
        self.speed: dict[str, dict] = {}      # measured choice per shape bucket (CUDA)
        self.dropped: dict[str, str] = {}     # "op/backend" -> why it failed its probe
        self.state: dict = {}                 # what backends keep per site (cached [W | B])
        self.cache_bytes = 0                  # the most bytes `state` held
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
        self.state.clear()

    def _base(self):
        fc1 = self.spec.fc1()
        return fc1, wrapped(fc1)

    def plan(self) -> str:
        """The backends each op may run on this site's device and dtype; '' or why none."""
        _, base = self._base()
        w = base.weight
        for op, req in self.requested.items():
            names, why = registry.candidates(op, req, w.device, w.dtype)
            if why:
                return why
            self.candidates[op] = names
        return ""

    @torch.no_grad()
    def probe(self) -> str:
        """Compile and launch every backend this site may run, on its real weights (and its
        adapters' real factors) with a 16-row input, and compare with the fp32 reference of
        the same math. A backend that fails or disagrees is dropped (named in the report);
        '' while every op keeps one, else why not (the site is then not mounted). Only here
        are kernel errors caught: at call time they propagate."""
        fc1, base = self._base()
        w, b = base.weight, base.bias
        x = torch.randn(16, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
        checks = {}
        if "linear_gelu_tanh" in self.fusions:
            checks["linear_gelu_tanh"] = (lambda be: linear_gelu_tanh(x, w, b, backend=be),
                                          lambda: linear_gelu_tanh_torch(x, w, b))
        lw = lora_wrapper(fc1)
        st = lora_factors(lw, x) if lw is not None and lw.lora_active else None
        if "lora_linear_gelu_tanh" in self.fusions and st is not None:
            a, bm, scale = st
            checks["lora_linear"] = (lambda be: lora_linear(x, w, b, a, bm, scale, gelu=True, backend=be),
                                     lambda: lora_linear_torch(x, w, b, a, bm, scale, gelu=True))
        for op, (fused, reference) in checks.items():
            kept = []
            for be in self.candidates.get(op, []):
                why = _compare(lambda: fused(be), reference, w, f"{op}/{be}")
                if why:
                    self.dropped[f"{op}/{be}"] = why
                    log.warning("fusion site %s: backend %s/%s dropped: %s", self.spec.path, op, be, why)
                else:
                    kept.append(be)
            if not kept:
                return "; ".join(self.dropped[f"{op}/{be}"] for be in self.candidates.get(op, []))
            self.candidates[op] = kept
        self.state.clear()
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
        base = wrapped(fc1)
        w, b = base.weight, base.bias
        if (x.dtype != w.dtype or x.device != w.device or getattr(base, "weight_function", None)
                or x.shape[-1] != w.shape[1]):
            return self.unfused(fc1, x)
        lw = lora_wrapper(fc1)
        if lw is not None and lw.lora_active:
            if "lora_linear_gelu_tanh" in self.fusions:
                st = lora_factors(lw, x)
                if st is not None:
                    a, bmat, scale = st
                    names = self.candidates["lora_linear"]
                    if isinstance(scale, torch.Tensor) and scale.dim() == 2:  # per-branch rows
                        names = registry.having("lora_linear", names, "row_scale")
                        if not names:
                            return self.unfused(fc1, x, "unfused (a per-branch adapter in a CFG batch: "
                                                        f"{'/'.join(self.candidates['lora_linear'])} take a "
                                                        "per-rank scale, not a per-row one)")
                    paths = {be: (lambda be=be: lora_linear(x, w, b, a, bmat, scale, gelu=True, backend=be,
                                                            state=self.state))
                             for be in names}
                    return self._run("lora_fused", "lora_linear", x, w, a.shape[0], paths, fc1)
                return self.unfused(fc1, x, f"unfused ({unfusable_reason(lw)})")
            return self.unfused(fc1, x)
        if "linear_gelu_tanh" in self.fusions:
            paths = {be: (lambda be=be: linear_gelu_tanh(x, w, b, backend=be))
                     for be in self.candidates["linear_gelu_tanh"]}
            return self._run("base_fused", "linear_gelu_tanh", x, w, 0, paths, fc1)
        return self.unfused(fc1, x)

    def _run(self, route: str, op: str, x, w, rank: int, paths: dict, fc1) -> torch.Tensor:
        """Run the backend `registry.choose` picks for this call (forced, named, or measured per
        shape bucket on an "auto" site)."""
        kind = _KIND[op]
        key = lambda: (str(x.device), str(x.dtype), kind, tuple(w.shape), rank,  # noqa: E731
                       m_bucket(x.numel() // x.shape[-1]))
        name, rec = registry.choose(op, self.requested[op], paths, x.device, key, self.state,
                                    lambda: self._eager(fc1, x))
        if rec is not None:
            self.speed[f"{kind} M<={m_bucket(x.numel() // x.shape[-1])} R={rank}"] = rec
        if name == UNFUSED:
            return self.unfused(fc1, x, "unfused (measured faster here)")
        self.routes[route] += 1
        self.ran[f"{route}:{name}"] += 1
        y = paths[name]()
        self.cache_bytes = max(self.cache_bytes, registry.cache_bytes(op, name, self.state))
        return y

    @staticmethod
    def _eager(fc1, x):
        return torch.nn.functional.gelu(fc1(x), approximate="tanh")

    def report(self) -> dict:
        r = {"site": self.spec.path, "fusions": list(self.fusions), "routes": dict(self.routes),
             "backends": {op: list(c) for op, c in self.candidates.items()}, "ran": dict(self.ran)}
        if self.speed:
            r["measured"] = dict(self.speed)
        if self.dropped:
            r["dropped"] = dict(self.dropped)
        if self.cache_bytes:
            r["cache_bytes"] = self.cache_bytes  # the K-concat [W | B] this site held
        return r


def _compare(fused, reference, w, name: str) -> str:
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


def mount_fusions(model: nn.Module, tier, backend: str | dict = "auto",
                  only: list[str] | None = None) -> MountedFusions:
    """Mount every fusion the tier admits on every site that passes the static guard.

    `backend`: "auto", a backend name every mounted fusion's op has, or {op: name}
    (ops not named: "auto")."""
    tier = parse_tier(tier)
    names = tuple(n for n, f in FUSIONS.items() if tier.admits(f.min_tier) and (only is None or n in only))
    mounted = MountedFusions()
    if not names:
        return mounted
    ops = sorted({FUSIONS[n].op for n in names})
    requested = {op: (backend.get(op, "auto") if isinstance(backend, dict) else backend) for op in ops}
    for op, req in requested.items():
        if req != "auto":
            registry.get(op, req)  # an unknown name is a programming error: ValueError
    for spec in find_sites(model):
        fc1 = spec.fc1()
        ok, why = static_guard(fc1)
        if ok and "auto" in requested.values():
            base = wrapped(fc1)
            if not registry.MEASURED.measures(base.weight.device):
                ok, why = False, (f"no CUDA device: fused paths are chosen by timing them against eager "
                                  f"on CUDA; on {base.weight.device.type} eager runs")
        if not ok:
            mounted.skipped[spec.path] = why
            continue
        site = MountedSite(spec, names, tier, requested)
        why = site.plan() or site.probe()
        if why:
            site.unmount()
            log.warning("fusion site %s left unfused: %s", spec.path, why)
            mounted.skipped[spec.path] = why
            continue
        mounted.sites.append(site)
    if mounted.sites:
        log.info("mounted %s on %d sites", ", ".join(names), len(mounted.sites))
    return mounted
