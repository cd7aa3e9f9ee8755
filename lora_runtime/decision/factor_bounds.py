"""Bounds and single elements of low-rank updates, read from their factors (the top's search in
`estimate` screens with them; nothing here forms a whole update).

Contract
- `Factors.of(slot, device)`: a low-rank slot's factors on the CPU in fp32, its scale x strength folded into
  the up factor; None for an update that is not low-rank. `row_norm[i] * col_norm[j]` bounds
  |update[i, j]| (Cauchy-Schwarz, x 1.001 for the fp32 roundings of the update as a merge computes it);
  `terms_bound[i]` bounds row i's largest |value| term by term; `at(rows, cols)` is the update at
  those elements in fp32; `updates_at(factors)(rows, cols)`, several slots' at once (one gather of
  their factors side by side).
"""
from __future__ import annotations

import torch

GATHER_CHUNK = 4096


class Factors:
    """A low-rank slot's factors on the CPU in fp32 (see module doc)."""

    def __init__(self, down: torch.Tensor, up: torch.Tensor, k: float):
        self.up = up.cpu().float() * k
        down = down.cpu()
        # [in, rank]: a column's factors side by side (one copy: cast and transpose)
        self.down_t = torch.empty(down.shape[::-1]).copy_(down.t())
        self.rank = self.up.shape[1]
        self.row_norm = torch.linalg.vector_norm(self.up, dim=1) * 1.001
        self.col_norm = torch.linalg.vector_norm(self.down_t, dim=1)
        low, high = down.amin(dim=1).float(), down.amax(dim=1).float()  # each rank's largest |down|, by rows
        self.terms_bound = (self.up.abs() @ torch.maximum(high, -low)) * 1.001

    @staticmethod
    def of(s, device=None) -> "Factors | None":
        """`device`: where the update's fp32 factors are (or will be) kept for its products."""
        stack = s.update.stack() if device is None else s.update.stack(device, torch.float32)
        if stack is None:
            return None
        down, up, scale = stack
        return Factors(down, up, float(scale) * s.strength)

    def element_bound(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """A bound of |update| at each (row, col): the norms' product (Cauchy-Schwarz)."""
        return self.row_norm[rows] * self.col_norm[cols]

    def at(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """fp32 [m]: the update at each (row, col), in chunks that stay in cache."""
        out = torch.empty(rows.numel())
        for i in range(0, rows.numel(), GATHER_CHUNK):
            r, c = rows[i:i + GATHER_CHUNK], cols[i:i + GATHER_CHUNK]
            out[i:i + GATHER_CHUNK] = (self.up[r] * self.down_t[c]).sum(dim=1)
        return out


def updates_at(factors: list[Factors]):
    """(rows, cols) -> fp32 [len(factors), m]: each slot's update at each (row, col), their factors read
    side by side in one gather (stacked once here), each slot's products summed by one multiply
    with an indicator of its columns."""
    up = torch.cat([f.up for f in factors], dim=1)
    down_t = torch.cat([f.down_t for f in factors], dim=1)
    ranks = torch.tensor([f.rank for f in factors])
    own = torch.zeros(up.shape[1], len(factors))
    own[torch.arange(up.shape[1]), torch.repeat_interleave(torch.arange(len(factors)), ranks)] = 1.0
    step = max(1, GATHER_CHUNK * 32 // up.shape[1])  # a chunk's products stay in cache

    def at(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.numel(), len(factors))
        for i in range(0, rows.numel(), step):
            torch.mm(up[rows[i:i + step]] * down_t[cols[i:i + step]], own, out=out[i:i + step])
        return out.t()
    return at
