"""Launch configurations for the tiled GEMM kernels, chosen per shape bucket.

Contract
- A launch is keyed by (op, dtype, N, K, m_bucket(M)): M (the token count) is
  rounded up to a power of two between 16 and 65536, so a new resolution or frame
  count inside a bucket reuses the bucket's config instead of re-tuning mid-sampling
  (Triton's autotuner keyed on the exact M re-tuned for every new token count).
- Lookup order: this process's cache -> the committed table for this GPU family
  (`kernels/tuned/<family>.json`, family = the device name in lower case with
  non-alphanumerics as '-', e.g. `nvidia-h200`; then `sm<major><minor>.json`) ->
  tune now: every candidate in `CANDIDATES` is compiled and timed once for the
  bucket on the real arguments (a candidate that cannot compile or launch on this
  device is skipped), and the fastest is cached for the rest of the process; a bucket
  of less than SMALL_WORK multiply-adds takes SMALL_DEFAULT untuned (its launch is a
  few microseconds, tuning it would cost seconds of compiles).
  Where no candidate runs, `KernelLaunchError` says which op and shape.
- `bench/device_check.py` refreshes a table with `tune_bucket` and `write_table`;
  the table records the GPU, driver, torch and Triton versions it was tuned with.

Nothing here runs under TRITON_INTERPRET=1: the interpreter path launches one fixed
small config (see _triton_utils.INTERPRET_META).
"""
from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

TABLE_DIR = Path(__file__).resolve().parent / "tuned"
M_MIN, M_MAX = 16, 65536


class KernelLaunchError(RuntimeError):
    """No launch configuration of a kernel compiles and runs on this device for a shape."""


@dataclass(frozen=True)
class LaunchConfig:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    GROUP_M: int = 8

    def meta(self) -> dict:
        """Keyword arguments for `kernel[grid](...)`."""
        return asdict(self)

    def label(self) -> str:
        return (f"{self.BLOCK_M}x{self.BLOCK_N}x{self.BLOCK_K} w{self.num_warps} s{self.num_stages} "
                f"g{self.GROUP_M}")


# Hopper/Ampere-friendly tiles (BLOCK_M >= 64 lets Triton use wgmma on sm90).
CANDIDATES: tuple[LaunchConfig, ...] = (
    LaunchConfig(128, 256, 64, 8, 3),
    LaunchConfig(256, 128, 64, 8, 3),
    LaunchConfig(128, 128, 64, 8, 4),
    LaunchConfig(128, 128, 64, 4, 4),
    LaunchConfig(128, 64, 64, 4, 4),
    LaunchConfig(64, 128, 64, 4, 4),
    LaunchConfig(128, 128, 32, 4, 4),
    LaunchConfig(64, 64, 64, 4, 4),
    LaunchConfig(64, 64, 32, 2, 5),
)


# Below this many multiply-adds (M_bucket * N * K) a launch is a few microseconds and
# tuning cannot pay for its compiles: such buckets take SMALL_DEFAULT without tuning.
SMALL_WORK = 2 ** 31
SMALL_DEFAULT = LaunchConfig(64, 64, 64, 4, 4)


@dataclass(frozen=True)
class BucketKey:
    op: str
    dtype: str
    N: int
    K: int
    M_bucket: int

    def as_dict(self) -> dict:
        return asdict(self)


def m_bucket(m: int) -> int:
    """M rounded up to a power of two in [M_MIN, M_MAX]."""
    b = M_MIN
    while b < m and b < M_MAX:
        b *= 2
    return b


def dtype_key(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def family_names(device_name: str, capability: tuple[int, int]) -> list[str]:
    """Table file stems for a device, most specific first."""
    name = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return [name, f"sm{capability[0]}{capability[1]}"]


_lock = threading.Lock()
_pinned = threading.local()
_cache: dict[tuple[str, BucketKey], LaunchConfig] = {}
_tables: dict[str, dict[BucketKey, LaunchConfig]] = {}


def _parse_table(data: dict, source: str) -> dict[BucketKey, LaunchConfig]:
    out = {}
    for e in data.get("entries", []):
        try:
            key = BucketKey(e["op"], e["dtype"], int(e["N"]), int(e["K"]), int(e["M_bucket"]))
            out[key] = LaunchConfig(**e["config"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: bad entry {e!r} ({exc}); refresh the table with "
                             "bench/device_check.py or delete the file") from exc
    return out


def load_table(family: str, table_dir: Path | None = None) -> dict[BucketKey, LaunchConfig]:
    """The committed table for one family stem ({} when there is none)."""
    if family not in _tables:
        path = (table_dir or TABLE_DIR) / f"{family}.json"
        _tables[family] = _parse_table(json.loads(path.read_text()), str(path)) if path.is_file() else {}
    return _tables[family]


def _device_families(device) -> list[str]:
    import torch
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return family_names(torch.cuda.get_device_name(idx), torch.cuda.get_device_capability(idx))


def tune_bucket(launch: Callable[[LaunchConfig], None], *, candidates=CANDIDATES,
                warmup_ms: int = 5, rep_ms: int = 25) -> tuple[LaunchConfig, dict[str, float]]:
    """Time every candidate (one compile + `triton.testing.do_bench` each); return the
    fastest and {label: ms} (inf for one that did not compile or launch)."""
    from triton.testing import do_bench
    timings: dict[str, float] = {}
    best, best_ms = None, float("inf")
    for cfg in candidates:
        try:
            ms = float(do_bench(lambda: launch(cfg), warmup=warmup_ms, rep=rep_ms))
        except Exception as exc:  # compile or launch failure of one candidate (e.g. out of shared memory)
            logger.debug("candidate %s failed: %r", cfg.label(), exc)
            timings[cfg.label()] = float("inf")
            continue
        timings[cfg.label()] = ms
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise KernelLaunchError("no launch configuration compiled and ran: " + ", ".join(timings))
    return best, timings


def choose(key: BucketKey, device, launch: Callable[[LaunchConfig], None]) -> LaunchConfig:
    """The config for `key` on `device`: cache, then table, then tuned now (see module doc)."""
    forced = getattr(_pinned, "config", None)
    if forced is not None:
        return forced
    dev = str(device)
    hit = _cache.get((dev, key))
    if hit is not None:
        return hit
    with _lock:
        hit = _cache.get((dev, key))
        if hit is not None:
            return hit
        for fam in _device_families(device):
            cfg = load_table(fam).get(key)
            if cfg is not None:
                _cache[(dev, key)] = cfg
                return cfg
        if key.M_bucket * key.N * key.K < SMALL_WORK:
            _cache[(dev, key)] = SMALL_DEFAULT
            return SMALL_DEFAULT
        try:
            cfg, _ = tune_bucket(launch)
        except KernelLaunchError as exc:
            raise KernelLaunchError(f"{key.op} ({key.dtype}, N={key.N}, K={key.K}, M<={key.M_bucket}): {exc}") \
                from None
        logger.info("tuned %s %s N=%d K=%d M<=%d on %s: %s (not in the committed table)",
                    key.op, key.dtype, key.N, key.K, key.M_bucket, dev, cfg.label())
        _cache[(dev, key)] = cfg
        return cfg


@contextlib.contextmanager
def pinned(cfg: LaunchConfig):
    """Every launch in this thread uses `cfg` (tests run each candidate; benchmarks sweep)."""
    prev = getattr(_pinned, "config", None)
    _pinned.config = cfg
    try:
        yield cfg
    finally:
        _pinned.config = prev


def cached_entries() -> list[tuple[str, BucketKey, LaunchConfig]]:
    """(device, key, config) of every bucket chosen in this process."""
    return [(d, k, c) for (d, k), c in sorted(_cache.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))]


def forget(key: BucketKey | None = None) -> None:
    """Drop cached choices (all, or one key on every device) and reloaded tables."""
    with _lock:
        if key is None:
            _cache.clear()
            _tables.clear()
        else:
            for ck in [ck for ck in _cache if ck[1] == key]:
                del _cache[ck]


def write_table(path: Path, entries: list[dict], meta: dict) -> None:
    """Write a table: `meta` (device, driver, torch, triton, date) + entries
    [{op, dtype, N, K, M_bucket, config: {...}, ms, candidates_ms}]."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "entries": entries}, indent=1, sort_keys=False) + "\n")
