"""One shrink GEMM for sibling projections that read the same input (q/k/v and the like).

Contract
- `group_siblings(wrappers)` puts the wrapped projections of one module whose leaf names are
  q/k/v-style (`q`, `to_k`, `add_v_proj`, `k_img`, ...) and whose inputs have the same width
  into one `SiblingGroup`, and sets `layer.sibling = (group, index)` on each (None elsewhere).
- A member's stacked lossless/high call plan takes its ``h = x A^T`` from `group.shrink`: the
  first member called on an input computes h for itself and for every partner (one GEMM over
  their concatenated A's, each partner's A read from its own current plan); a partner then
  takes its columns when it is called on the same tensor object (alive; same version counter
  when the tensor has one) in the same context with the same A, once. Anything else: the
  member's own GEMM. `exact` never shares (its plans compute each layer alone).
- Partners are learned from the calls, never assumed: a member called on the input another
  member's call saw becomes its partner (Wan's cross-attention: q reads x, k and v the text).
- The window is one module's projections on one input: a model that changed that input in
  place between them under inference mode (no version counter) would be read stale; no model
  the pack targets does.
Numerics: a column block of one GEMM is the same maths as its own GEMM; the bits may differ in
the last place (blocking), inside lossless/high's contract (tests compare with fp64).
"""
from __future__ import annotations

import re
import weakref

import torch
import torch.nn.functional as F

from .base_weight import real_shape

_SIBLING_LEAF = re.compile(r"(?:to_|add_)?[qkv](?:_proj|_img)?")


def _version(x: torch.Tensor):
    return None if x.is_inference() else x._version


class _Entry:
    """h columns of one input, waiting for the partners that have not taken theirs."""
    __slots__ = ("ref", "version", "ctx", "owner", "a", "h")

    def __init__(self, x, ctx, owner, a, h):
        self.ref, self.version, self.ctx = weakref.ref(x), _version(x), ctx
        self.owner, self.a, self.h = owner, a, h   # a: {index: A}, h: {index: columns not taken}


class SiblingGroup:
    def __init__(self, members: list):
        self.members = tuple(members)
        self.partners = [frozenset((i,)) for i in range(len(members))]
        self._entry: _Entry | None = None
        self._classes: dict = {}  # (member, ctx, dtype) -> what its shared GEMM computes
        self.shared = 0           # calls served from a sibling's GEMM (tests, benchmarks)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.layer_name for m in self.members)

    def reset(self) -> None:
        """A member's slot state changed: its A may be another tensor now."""
        self._entry = None
        self._classes.clear()

    def _link(self, i: int, j: int) -> None:
        joined = self.partners[i] | self.partners[j]
        for k in joined:
            self.partners[k] = joined
        self._classes.clear()

    def shrink(self, i: int, x: torch.Tensor, ctx, a: torch.Tensor) -> torch.Tensor:
        """h = x A^T for member `i` (A its plan's stacked A): from the pending entry when it
        was computed for this very input, context and A, else computed here (for the partners
        too)."""
        e = self._entry
        if e is not None and e.ref() is x and e.ctx is ctx and e.version == _version(x):
            h = e.h.pop(i, None)
            if h is not None and e.a[i] is a:
                if not e.h:
                    self._entry = None
                self.shared += 1
                return h
            if i not in e.a:  # called on the input a sibling just read: a partner from now on
                self._link(e.owner, i)
                return F.linear(x, a)
        return self._compute(i, x, ctx, a)

    def _class(self, i, x, ctx, a):
        """(members, {member: A}, A's concatenated or None when alone, rank sizes) of member i's
        shared GEMM in this context: its partners whose current plan is a stacked one."""
        idx, mats = [i], [a]
        for j in sorted(self.partners[i] - {i}):
            aj = getattr(self.members[j].plan_for(ctx, x.device, x.dtype).run, "shrink_a", None)
            if aj is not None and aj.shape[1] == a.shape[1] and aj.dtype == a.dtype and aj.device == a.device:
                idx.append(j)
                mats.append(aj)
        cat = torch.cat(mats, 0) if len(idx) > 1 else None
        return tuple(idx), dict(zip(idx, mats)), cat, [int(m.shape[0]) for m in mats]

    def _compute(self, i, x, ctx, a):
        key = (i, ctx, x.dtype)
        c = self._classes.get(key)
        if c is None or c[1][i] is not a:  # (another device: another A)
            if len(self._classes) >= 64:  # contexts of past steps (a schedule makes one per factor set)
                self._classes.clear()
            c = self._classes[key] = self._class(i, x, ctx, a)
        idx, mats, cat, sizes = c
        if cat is None:
            self._entry = _Entry(x, ctx, i, mats, {})
            return F.linear(x, a)
        cols = F.linear(x.reshape(-1, cat.shape[1]), cat).split_with_sizes(sizes, 1)  # one C++ call
        self._entry = _Entry(x, ctx, i, mats, dict(zip(idx[1:], cols[1:])))
        return cols[0]


def group_siblings(wrappers: dict, enabled: bool = True) -> "list[SiblingGroup]":
    """Group the q/k/v-style projections of each module (see the module contract); with
    `enabled` False, ungroup them all (each its own shrink GEMM)."""
    by_parent: dict[tuple, list] = {}
    for name, w in wrappers.items():
        w.sibling = None
        w.drop_plans()  # a plan captures its group: none may outlive a regrouping
        if not enabled:
            continue
        parent, _, leaf = name.rpartition(".")
        if w.is_conv or not _SIBLING_LEAF.fullmatch(leaf):
            continue
        wt = w.weight
        if wt is None:
            continue
        width = real_shape(wt)[1]
        by_parent.setdefault((parent, width), []).append(w)
    groups = []
    for members in by_parent.values():
        if len(members) < 2:
            continue
        g = SiblingGroup(sorted(members, key=lambda m: m.layer_name))
        for k, m in enumerate(g.members):
            m.sibling = (g, k)
        groups.append(g)
    return groups
