"""Strength over the steps and per guidance branch, without re-merging.

Contract
- `parse_schedule` reads a per-step list (``"1, 1, 0, 0"``), ``percent:multiplier`` keyframes
  held until the next (``"0:1, 0.5:0"``) or, after the word ``linear``, keyframes interpolated
  linearly over the sampling progress (``"linear 0:1, 0.5:0.3, 1:0"``: step i of n is at i/n);
  `parse_strength_list` a FLOAT list from another node (one multiplier per step); `parse_branch`
  one of ``both``, ``positive only``, ``negative only``.
- An adapter's multiplier at a model call is its runtime scale there (dynamic path only; a unit
  factor is never multiplied); a branch gives a per-row 0/1 mask over a batched CFG call.
- `SamplingSchedules` maps each call's sigma to its step and factors; `model_call_context`
  enters them for one model call. Formats and the step rules: docs/engine.md.
"""
from __future__ import annotations

import bisect
import contextlib
import contextvars
import enum
import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .runtime_context import runtime_context
from ..settings import STRENGTH_MAX, STRENGTH_MIN, in_strength_range


class Branch(str, enum.Enum):
    BOTH = "both"
    POSITIVE = "positive only"
    NEGATIVE = "negative only"


BRANCH_CHOICES = tuple(b.value for b in Branch)
POSITIVE, NEGATIVE = 0, 1  # ComfyUI's cond_or_uncond values


def parse_branch(value, *, where: str = "Load LoRA Adapter") -> Branch:
    if isinstance(value, Branch):
        return value
    try:
        return Branch(str(value).strip())
    except ValueError:
        raise ConfigError(f"{where}: branch {value!r} is not one of {', '.join(BRANCH_CHOICES)}") from None


@dataclass(frozen=True)
class Schedule:
    """A strength multiplier over the denoising: per step, or keyframes over percent.

    Exactly one of `per_step` / `keyframes` is set. `text` is what the user typed.
    `linear`: keyframes interpolated over the progress i/n of step i of n (the first at 0),
    else each held from its percent of the denoising until the next."""

    per_step: tuple[float, ...] = ()
    keyframes: tuple[tuple[float, float], ...] = ()   # (percent, multiplier), percent increasing
    text: str = ""
    linear: bool = False

    def at_progress(self, p: float) -> float:
        """A linear schedule's multiplier at progress `p` (python floats, one formula:
        v0 + (v1 - v0) * ((p - p0) / (p1 - p0)) on the segment holding p; the last value after it)."""
        kf = self.keyframes
        for (p0, v0), (p1, v1) in zip(kf, kf[1:]):
            if p0 <= p < p1:
                return v0 if v1 == v0 else v0 + (v1 - v0) * ((p - p0) / (p1 - p0))
        return kf[-1][1] if p >= kf[-1][0] else kf[0][1]

    @property
    def values(self) -> tuple[float, ...]:
        return self.per_step or tuple(v for _, v in self.keyframes)

    @property
    def is_unit(self) -> bool:
        """Every multiplier is 1.0 from the start: the same as no schedule."""
        return all(v == 1.0 for v in self.values)

    def constant(self) -> float | None:
        """The multiplier when it never changes over the run, else None."""
        vals = set(self.values)
        if self.keyframes and self.keyframes[0][0] > 0.0:
            vals.add(1.0)  # 1.0 before the first keyframe
        return vals.pop() if len(vals) == 1 else None

    def describe(self) -> str:
        if self.per_step:
            return f"per step ({len(self.per_step)} values): {_short(self.per_step)}"
        return ("linear keyframes " if self.linear else "keyframes ") + ", ".join(f"{p:g}:{v:g}" for p, v in self.keyframes)


def parse_schedule(text, *, where: str = "Load LoRA Adapter") -> Schedule | None:
    """Parse a ``strength_schedule`` string (module docstring); None for an empty one.
    Raises ConfigError naming `where`, the bad part and the fix."""
    if text is None:
        return None
    if isinstance(text, (list, tuple)):  # API callers may send a list of numbers
        text = ", ".join(str(v) for v in text)
    src = str(text).strip()
    if not src:
        return None
    head, _, rest = src.partition(" ")
    linear = head.lower() == "linear"
    if linear or head.lower() == "hold":
        src = rest.strip()
        if not src:
            raise ConfigError(f"{where}: strength_schedule {text!r}: '{head}' needs keyframes after it, like "
                              "'linear 0:1, 0.5:0.3, 1:0'")
    src_list = src[1:-1] if src.startswith("[") and src.endswith("]") else src
    parts = [p for p in src_list.replace(";", ",").replace("\n", ",").split(",")]
    parts = [p.strip() for p in parts]
    if any(not p for p in parts):
        parts = [p for p in parts if p]  # trailing commas are harmless
    if len(parts) == 1 and ":" not in parts[0] and " " in parts[0]:
        parts = parts[0].split()  # "1 1 0 0"
    if not parts:
        return None
    has_kf = [":" in p for p in parts]
    fix = ("write one multiplier per step ('1, 1, 0.5, 0') or percent:multiplier keyframes ('0:1, 0.5:0'), "
           "not both")
    if any(has_kf) and not all(has_kf):
        raise ConfigError(f"{where}: strength_schedule {src!r} mixes per-step values and keyframes; {fix}")
    if all(has_kf):
        kfs = []
        for p in parts:
            pct_s, _, val_s = p.partition(":")
            pct = _number(pct_s, where, src, f"keyframe {p!r}: percent")
            val = _number(val_s, where, src, f"keyframe {p!r}: multiplier")
            if not 0.0 <= pct <= 1.0:
                raise ConfigError(f"{where}: strength_schedule keyframe {p!r}: percent {pct:g} is outside [0, 1] "
                                  "(0 = start of denoising, 1 = end)")
            _check_value(val, where, f"keyframe {p!r}")
            if kfs and pct <= kfs[-1][0]:
                raise ConfigError(f"{where}: strength_schedule keyframes must have strictly increasing percents; "
                                  f"{p!r} comes after {kfs[-1][0]:g}. Sort them and drop duplicates")
            kfs.append((pct, val))
        if linear and kfs[0][0] != 0.0:
            raise ConfigError(f"{where}: strength_schedule {text!r}: linear keyframes start at percent 0; add "
                              f"'0:<multiplier>' first (e.g. 'linear 0:1, {src}')")
        return Schedule(keyframes=tuple(kfs), text=str(text).strip(), linear=linear)
    if linear:
        raise ConfigError(f"{where}: strength_schedule {text!r}: 'linear' interpolates percent:multiplier keyframes "
                          "('linear 0:1, 0.5:0.3, 1:0'); a per-step list needs no 'linear'")
    vals = []
    for i, p in enumerate(parts):
        v = _number(p, where, src, f"step {i + 1} value")
        _check_value(v, where, f"step {i + 1} value {p!r}")
        vals.append(v)
    return Schedule(per_step=tuple(vals), text=src)


def parse_strength_list(value, *, where: str = "Load LoRA Adapter", what: str = "strength_list"
                        ) -> Schedule | None:
    """A FLOAT list from another node (a list/tuple of numbers, or a 1-D tensor) as a per-step
    schedule; None when nothing is connected. A lone number is an error: it is what a node whose
    output is a list of separate values sends, and this node would then run once per value."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise ConfigError(f"{where}: {what} is a tensor of shape {tuple(value.shape)}; connect a 1-D list of "
                              "floats (one multiplier per step)")
        value = value.tolist()
    elif hasattr(value, "tolist") and not isinstance(value, (list, tuple)):  # numpy arrays
        value = value.tolist()
    if isinstance(value, bool) or isinstance(value, (int, float)):
        raise ConfigError(f"{where}: {what} got the single number {value!r}, not a list. Connect an output that "
                          "carries the whole list as one FLOAT value (e.g. KJNodes' float lists); an output marked "
                          "as a list of separate values runs this node once per value. For one multiplier use "
                          "strength")
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{where}: {what} must be a non-empty list of floats (one multiplier per step), got "
                          f"{value!r:.80}")
    vals = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"{where}: {what} value {i + 1} ({v!r}) is not a finite number")
        if not in_strength_range(v):
            raise ConfigError(f"{where}: {what} value {i + 1} ({v:g}) is out of range; use multipliers in "
                              f"[{STRENGTH_MIN:g}, {STRENGTH_MAX:g}]")
        vals.append(float(v))
    return Schedule(per_step=tuple(vals), text=f"FLOAT list ({len(vals)} values): {_short(vals)}")


class SamplingSchedules:
    """The schedules of one sampling run, resolved against the sigmas it samples.

    Built by the SAMPLER_SAMPLE wrapper; `call_scales(sigma, cond_or_uncond, rows, device)`
    is asked once per model call and returns {adapter name: (multiplier, row mask or None)}
    for every adapter that has a schedule or a branch (others are absent: factor 1)."""

    def __init__(self, entries: dict, sigmas, percent_to_sigma=None, *, where=None):
        # entries: name -> (Schedule | None, Branch); where: name -> node label for errors
        sig = [float(s) for s in (sigmas.tolist() if hasattr(sigmas, "tolist") else sigmas)]
        self.steps = max(1, len(sig) - 1)
        self._inner = sorted(sig[1:self.steps])  # sigmas[1:steps], ascending for bisect
        self.entries = {}
        where = where or {}
        for name, (sched, branch) in entries.items():
            thresholds = None
            if sched is not None and sched.per_step and len(sched.per_step) != self.steps:
                raise ConfigError(
                    f"{where.get(name, 'Load LoRA Adapter')} ({name}): strength_schedule has {len(sched.per_step)} "
                    f"values but this sampler runs {self.steps} steps. Give one value per step, or use keyframes "
                    "over the denoising percentage ('0:1, 0.5:0'), which fit any step count")
            if sched is not None and sched.keyframes and not sched.linear:
                if percent_to_sigma is None:
                    raise ConfigError(f"{where.get(name, 'Load LoRA Adapter')} ({name}): keyframes need the model's "
                                      "percent_to_sigma, which this model does not have; use a per-step list")
                # compared in float32, the dtype of the sigmas (ComfyUI compares its float start sigma
                # with the fp32 sigma tensor, which rounds the float to fp32 first): percent 0.5 at shift 8
                # is 0.888...89 in fp64 but the schedule's fp32 sigma 0.88888890 must still match it
                thresholds = [float(torch.tensor(float(percent_to_sigma(p)), dtype=torch.float32))
                              for p, _ in sched.keyframes]
            if not isinstance(branch, Branch):
                raise TypeError(f"{name}: branch {branch!r} is not a Branch; parse it once with parse_branch")
            self.entries[name] = (sched, branch, thresholds)
        self._cache_key = None
        self._cache_val = None
        self._masks: dict = {}        # (branch, cond_or_uncond, rows, device) -> (0.0 or 1.0, mask or None)
        self._by_content: dict = {}   # factors of a call -> the one mapping object for them
        self.calls = 0
        self.seen: dict[str, dict[int, float]] = {n: {} for n in self.entries}  # step -> multiplier used

    def step_of(self, sigma: float) -> int:
        """The step a model call at `sigma` belongs to (module docstring)."""
        return len(self._inner) - bisect.bisect_left(self._inner, sigma)

    def multiplier(self, name: str, sigma: float) -> float:
        sched, _, thresholds = self.entries[name]
        if sched is None:
            return 1.0
        if sched.per_step:
            return sched.per_step[self.step_of(sigma)]
        if sched.linear:  # the progress of the call's step: step i of n at i/n
            return sched.at_progress(self.step_of(sigma) / self.steps)
        value = 1.0  # before the first keyframe: ComfyUI's 1.0
        for (_, v), start_sigma in zip(sched.keyframes, thresholds):
            if start_sigma >= sigma:
                value = v
            else:
                break
        return value

    def call_scales(self, sigma: float, cond_or_uncond, rows: int, device) -> dict:
        """{name: (multiplier, row mask [rows] fp32 on `device` or None)} for one model call."""
        key = (sigma, tuple(cond_or_uncond) if cond_or_uncond is not None else None, rows, str(device))
        self.calls += 1
        if key == self._cache_key:  # the cond and uncond calls of one step, or repeated layers' lookups
            return self._cache_val
        out = {}
        step = self.step_of(sigma)
        for name, (_, branch, _) in self.entries.items():
            m = self.multiplier(name, sigma)
            self.seen[name].setdefault(step, m)
            mask = None
            if branch is not Branch.BOTH and m != 0.0:
                mkey = (branch, key[1], rows, key[3])
                if mkey not in self._masks:
                    self._masks[mkey] = _branch_rows(branch, cond_or_uncond, rows, 1.0, device)
                if self._masks[mkey][0] == 0.0:  # the branch has no row in this call
                    m = 0.0
                mask = self._masks[mkey][1]
            out[name] = (m, mask)
        # the same factors as an earlier call give the same mapping object (the layers' call plans,
        # keyed by the context built from it, are then reused)
        content = tuple((n, m, id(mask)) for n, (m, mask) in out.items())
        out = self._by_content.setdefault(content, out)
        self._cache_key, self._cache_val = key, out
        return out

    def applied(self, name: str) -> str:
        """The multipliers the run's model calls used, by step: 'steps 1-4 x1, 5-8 x0' (1-based)."""
        runs, out = [], []
        for step in sorted(self.seen[name]):
            m = self.seen[name][step]
            if runs and runs[-1][2] == m and runs[-1][1] == step - 1:
                runs[-1][1] = step
            else:
                runs.append([step, step, m])
        for a, b, m in runs:
            out.append(f"{'step' if a == b else 'steps'} {a + 1}{'' if a == b else f'-{b + 1}'} x{m:g}")
        return ", ".join(out)

    def describe(self, name: str) -> str:
        sched, branch, _ = self.entries[name]
        parts = []
        if sched is not None:
            parts.append(sched.describe())
        if branch is not Branch.BOTH:
            parts.append(f"{branch.value} branch")
        return "; ".join(parts)


_ACTIVE: contextvars.ContextVar[SamplingSchedules | None] = contextvars.ContextVar(
    "lora_runtime_schedules", default=None)


@contextlib.contextmanager
def sampling_schedules(schedules: SamplingSchedules | None):
    """For the duration of one sampling: the schedules model calls resolve against (None: none)."""
    token = _ACTIVE.set(schedules)
    try:
        yield schedules
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def model_call_context(x, sigma, cond_or_uncond):
    """Around one model call (x: its input, batch on dim 0; sigma: a float or a tensor of the
    call's sigma per row): a runtime context with each scheduled adapter's factor for this call.
    Outside `sampling_schedules`, or without a sigma, it adds nothing."""
    sched = _ACTIVE.get()
    if sched is None or sigma is None:
        yield None
        return
    # one host sync per model call (not per layer); every row of a call has the same sigma
    s = float(sigma.reshape(-1)[0]) if isinstance(sigma, torch.Tensor) else float(sigma)
    rows = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() else 1
    scales = sched.call_scales(s, cond_or_uncond, rows, x.device if isinstance(x, torch.Tensor) else "cpu")
    with runtime_context(adapters=scales) as ctx:
        yield ctx


def varies(schedule: Schedule | None, branch: Branch) -> str:
    """Why an adapter's strength is not one number for the whole run ('' when it is)."""
    reasons = []
    if schedule is not None and not schedule.is_unit:
        reasons.append(f"its strength follows a schedule ({schedule.describe()})")
    if branch is not Branch.BOTH:
        reasons.append(f"it applies to the {branch.value.replace(' only', '')} branch only")
    if not reasons:
        return ""
    return "stays unmerged: " + " and ".join(reasons) + "; a merge would need a re-merge at every change"


def _branch_rows(branch: Branch, cond_or_uncond, rows: int, m: float, device):
    want = POSITIVE if branch is Branch.POSITIVE else NEGATIVE
    if not cond_or_uncond:  # a caller that does not say: every row is the positive (a cfg 1 call)
        layout = [POSITIVE]
    else:
        layout = [int(c) for c in cond_or_uncond]
    if all(c == want for c in layout):
        return m, None
    if all(c != want for c in layout):
        return 0.0, None
    if rows % len(layout):
        raise ConfigError(f"a model call of {rows} rows cannot be split into {len(layout)} equal cond/uncond "
                          "chunks; set the adapter's branch to 'both'")
    chunk = rows // len(layout)
    mask = torch.tensor([1.0 if c == want else 0.0 for c in layout], dtype=torch.float32)
    return m, mask.repeat_interleave(chunk).to(device)


def _number(s: str, where: str, src: str, what: str) -> float:
    try:
        v = float(s.strip())
    except ValueError:
        raise ConfigError(f"{where}: strength_schedule {src!r}: {what} {s.strip()!r} is not a number; write "
                          "numbers separated by commas ('1, 1, 0.5, 0') or percent:multiplier keyframes "
                          "('0:1, 0.5:0')") from None
    if not math.isfinite(v):
        raise ConfigError(f"{where}: strength_schedule {src!r}: {what} {s.strip()!r} is not finite")
    return v


def _check_value(v: float, where: str, what: str) -> None:
    if not in_strength_range(v):
        raise ConfigError(f"{where}: strength_schedule {what}: {v:g} is out of range; use multipliers in "
                          f"[{STRENGTH_MIN:g}, {STRENGTH_MAX:g}]")


def _short(vals) -> str:
    s = ", ".join(f"{v:g}" for v in vals)
    return s if len(s) <= 60 else s[:57] + "..."
