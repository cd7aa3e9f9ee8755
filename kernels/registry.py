"""Kernel backends, registered once: what each one takes, how they rank, how one is chosen.

Every implementation of an op (``linear_gelu_tanh``, ``lora_linear``) registers a
`Backend`: the dtypes and device types it takes, the capabilities it has (``bias``,
``gelu``, ``per_rank_scale``, ...), a priority, and an availability check run on the
real device (Triton importable, the cuBLASLt epilogue computing the tanh GELU, ...).

- `resolve(op, requested, *tensors)`: "auto" takes the available backend of highest
  priority that allows auto use (never the Triton interpreter: it runs a GEMM tile by
  tile in numpy); a named backend is honoured where it is available, else
  `KernelUnavailableError` says why and what to do; an unknown name is a ValueError.
- `use_backend(name)`: a context in which "auto" resolves to `name` (tests, benches).
- A fusion site's choice, all here: `candidates(op, requested, device, dtype)` (the backends it
  may run), `choose(...)` (the one a call runs: forced, named or measured; a backend not chosen
  drops what it kept in the site's state), `cache_bytes(op, name, state)` (what a backend keeps).
- `validate(...)`: the argument checks every op shares (shapes, dtypes, scale).
- `MeasuredChoice`: the per-shape-bucket measured choice among a site's paths (on
  CUDA the first call of a bucket times each path on the real input and keeps the
  fastest; elsewhere the first path, i.e. the highest priority).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import numbers
import os
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

logger = logging.getLogger(__name__)

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


class KernelUnavailableError(RuntimeError):
    """A backend was requested where it cannot run."""


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    """True when `import triton` works (cached: the import is slow)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything
        logger.debug("triton is not importable: %r", exc)
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1).

    Triton reads this variable when a kernel is decorated, so it must be set
    before the kernel modules are imported (tests/conftest.py does that).
    """
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_available(device: torch.device, dtype: torch.dtype, auto: bool) -> str:
    """Triton runs on CUDA; on the CPU only under its interpreter, and never for "auto"."""
    if not triton_importable():
        return ("backend 'triton' needs triton, which cannot be imported; install it "
                "(pip install 'comfyui-lora-runtime[triton]') or use backend='auto'")
    if device.type == "cuda":
        return ""
    if auto:
        return "the Triton interpreter is not a speed path"
    if interpreting():
        return ""
    return (f"backend 'triton' needs the tensors on one CUDA device, got {device}; move them to CUDA, "
            "use backend='auto' (falls back to torch), or set TRITON_INTERPRET=1 before importing "
            "the kernels to run them slowly on the CPU")


def _always(device: torch.device, dtype: torch.dtype, auto: bool) -> str:
    return ""


@dataclass(frozen=True)
class Backend:
    """One implementation of an op. `available(device, dtype, auto)` returns '' where it
    runs (for an "auto" request when `auto` is True), else why not and what to do."""
    op: str
    name: str
    fn: Callable
    dtypes: frozenset
    devices: frozenset
    capabilities: frozenset
    priority: int
    available: Callable[[torch.device, torch.dtype, bool], str] = _always
    description: str = ""
    cache_key: str = ""                  # where it keeps state in a site's `state` dict ('' none)
    cache_bytes: Callable[[dict], int] | None = None   # bytes it keeps there

    def why_not(self, device: torch.device, dtype: torch.dtype, auto: bool = False,
                needs: frozenset = frozenset()) -> str:
        if device.type not in self.devices:
            return f"{self.op}/{self.name} runs on {'/'.join(sorted(self.devices))}, not {device.type}"
        if dtype not in self.dtypes:
            return f"{self.op}/{self.name} takes {', '.join(_dt(d) for d in self.dtypes)}, not {_dt(dtype)}"
        missing = needs - self.capabilities
        if missing:
            return f"{self.op}/{self.name} cannot do {', '.join(sorted(missing))}"
        return self.available(device, dtype, auto)


def _dt(d) -> str:
    return str(d).rsplit(".", 1)[-1]


_BACKENDS: dict[str, dict[str, Backend]] = {}
_forced = threading.local()


def register(backend: Backend) -> Backend:
    ops = _BACKENDS.setdefault(backend.op, {})
    if backend.name in ops or backend.name == "auto":
        raise ValueError(f"backend {backend.op}/{backend.name} is registered twice (or is named 'auto')")
    ops[backend.name] = backend
    return backend


def backends(op: str) -> list[Backend]:
    """Every backend registered for `op`, highest priority first."""
    if op not in _BACKENDS:
        raise ValueError(f"unknown kernel op {op!r}; known: {', '.join(sorted(_BACKENDS))}")
    return sorted(_BACKENDS[op].values(), key=lambda b: -b.priority)


def get(op: str, name: str) -> Backend:
    ops = _BACKENDS.get(op, {})
    if name not in ops:
        raise ValueError(f"unknown {op} backend {name!r}; use 'auto' or one of {', '.join(sorted(ops))}")
    return ops[name]


def _device_of(tensors) -> torch.device:
    present = [t for t in tensors if t is not None]
    devices = {t.device for t in present}
    if len(devices) > 1:
        raise KernelUnavailableError(
            f"kernel arguments are on several devices {sorted(str(d) for d in devices)}; "
            "move them to one device")
    return present[0].device if present else torch.device("cpu")


def available(op: str, device, dtype, needs: frozenset = frozenset(), auto: bool = True) -> list[Backend]:
    """The backends of `op` that run here, highest priority first."""
    device = torch.device(device)
    return [b for b in backends(op) if not b.why_not(device, dtype, auto, needs)]


def resolve(op: str, requested: str, *tensors: torch.Tensor | None,
            needs: frozenset = frozenset()) -> Backend:
    """The backend for `requested` ('auto' or a name) on the tensors' device and dtype
    (the first tensor's dtype; None entries, an absent bias, are ignored)."""
    device = _device_of(tensors)
    dtype = next(t.dtype for t in tensors if t is not None)
    if requested == "auto":
        forced = getattr(_forced, "name", None)
        if forced is not None and forced in _BACKENDS.get(op, {}):
            requested = forced
        else:
            for b in backends(op):
                if not b.why_not(device, dtype, True, needs):
                    return b
            raise KernelUnavailableError(f"no {op} backend runs on {device} for {_dt(dtype)}")
    b = get(op, requested)
    why = b.why_not(device, dtype, False, needs)
    if why:
        raise KernelUnavailableError(why)
    return b


@contextlib.contextmanager
def use_backend(name: str):
    """Within the block, an "auto" request of any op that has backend `name` resolves to it
    (and sites skip the measured choice); other ops resolve as before."""
    if not any(name in ops for ops in _BACKENDS.values()):
        raise ValueError(f"no op has a backend named {name!r}")
    prev = getattr(_forced, "name", None)
    _forced.name = name
    try:
        yield
    finally:
        _forced.name = prev


def forced_backend() -> str | None:
    """The name `use_backend` forces in this thread, or None."""
    return getattr(_forced, "name", None)


# ---- a fusion site's choice

#: The name of a site's eager (unfused) path among its measured choices.
UNFUSED = "unfused"


def candidates(op: str, requested: str, device, dtype) -> tuple[list[str], str]:
    """(backend names a site asking for `requested` ("auto" or a name) may run on `device` for
    `dtype`, highest priority first, ''), or ([], why none)."""
    if requested == "auto":
        names = [b.name for b in available(op, device, dtype, auto=True)]
        return names, "" if names else f"no {op} backend runs on {device} for {dtype}"
    why = get(op, requested).why_not(device, dtype)
    return ([], why) if why else ([requested], "")


def having(op: str, names, capability: str) -> list[str]:
    """The backends among `names` that have `capability`."""
    return [n for n in names if capability in get(op, n).capabilities]


def choose(op: str, requested: str, paths: dict, device, key: Callable[[], tuple], state: dict,
           eager: Callable) -> tuple[str, dict | None]:
    """(name, measured record or None) of the path a site runs this call, among `paths` ({backend
    name: thunk}, highest priority first): the backend `use_backend` forces when the site has it,
    the named one (the first), or on an "auto" site the measured choice (`MEASURED`) for this
    shape bucket `key()` among `paths` and the eager path (`UNFUSED`: `eager`), after which a
    backend not chosen keeps nothing in the site's `state`."""
    forced = forced_backend()
    if forced in paths:
        return forced, None
    if requested != "auto":
        return next(iter(paths)), None
    name, rec = MEASURED.pick(key(), {**paths, UNFUSED: eager}, device)
    for b in _BACKENDS.get(op, {}).values():
        if b.cache_key and b.name != name:
            state.pop(b.cache_key, None)  # hold no copy for a path this site does not take
    return name, rec


def cache_bytes(op: str, name: str, state: dict) -> int:
    """Bytes backend `name` keeps in a site's `state` (0 for one that keeps nothing)."""
    b = _BACKENDS.get(op, {}).get(name)
    return b.cache_bytes(state) if b is not None and b.cache_bytes is not None else 0


# ---- argument checks shared by the ops

def validate(op: str, x, weight, bias, lora_a=None, lora_b=None, scale=None):
    """Check an op's arguments; return the scale as a float or a contiguous fp32 [R] (per
    rank) or [M, R] (per row of x flattened to [M, K], and rank) tensor on x's device
    (None when the op has no adapter)."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit; "
                         "expected x [..., K] and weight [N, K]")
    N, K = weight.shape
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{op}: bias {tuple(bias.shape)} must be [N={N}]")
    if weight.dtype != x.dtype:
        raise TypeError(f"{op}: weight dtype {weight.dtype} differs from x dtype {x.dtype}; "
                        "cast one of them (the fused GEMM reads both natively)")
    named = [("x", x)] + ([] if lora_a is None else [("lora_a", lora_a), ("lora_b", lora_b)])
    for name, t in named:
        if t.dtype not in FLOATS:
            raise TypeError(f"{op}: {name} dtype {t.dtype} is not supported (fp16, bf16, fp32)")
    if lora_a is None:
        return None
    if lora_a.dim() != 2 or lora_a.shape[1] != K:
        raise ValueError(f"{op}: lora_a {tuple(lora_a.shape)} must be [R, K={K}]")
    R = lora_a.shape[0]
    if tuple(lora_b.shape) != (N, R):
        raise ValueError(f"{op}: lora_b {tuple(lora_b.shape)} must be [N={N}, R={R}] "
                         f"to match lora_a {tuple(lora_a.shape)}")
    if isinstance(scale, torch.Tensor):
        M = x.numel() // K if K else 0
        if not (scale.dim() == 1 and scale.shape[0] == R) and tuple(scale.shape) != (M, R):
            raise ValueError(f"{op}: a scale tensor must hold one factor per rank [R={R}] or per row and "
                             f"rank [M={M}, R={R}], got {tuple(scale.shape)}; pass a float for one factor")
        return scale.to(device=x.device, dtype=torch.float32).contiguous()
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        return float(scale)
    raise TypeError(f"{op}: scale must be a float or an fp32 [R] tensor, got {type(scale).__name__}")


# ---- the measured choice per shape bucket

@dataclass
class MeasuredChoice:
    """Per shape bucket, which of a site's paths runs. `pick(key, paths, device)` with
    `paths` an ordered {name: thunk} (highest priority first): on a device in `devices`
    (CUDA) the first call of a bucket times every path on the real input (`timer(fn, name)`:
    ms, median of 3 after a warm-up) and keeps the fastest for every later call of that bucket;
    elsewhere, or with one path, the first path. `choices`: {key: {"chosen", "ms"}}."""
    devices: tuple = ("cuda",)
    timer: Callable | None = None
    choices: dict = field(default_factory=dict)

    def measures(self, device: torch.device) -> bool:
        return torch.device(device).type in self.devices

    def pick(self, key: tuple, paths: dict[str, Callable], device: torch.device) -> tuple[str, dict | None]:
        names = list(paths)
        if len(names) == 1 or not self.measures(device):
            return names[0], None
        rec = self.choices.get(key)
        if rec is None:
            timer = self.timer or _time_cuda
            ms = {n: round(float(timer(fn, n)), 4) for n, fn in paths.items()}
            rec = self.choices[key] = {"chosen": min(names, key=lambda n: ms[n]), "ms": ms}
            logger.info("measured %s: %s", key, rec)
        return rec["chosen"], rec

    def clear(self) -> None:
        self.choices.clear()


#: The process-wide measured choices (shared by every site of the same shape bucket).
MEASURED = MeasuredChoice()


def _time_cuda(fn, name: str = "", reps: int = 3) -> float:
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
