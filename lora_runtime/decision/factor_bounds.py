"""Bounds and single elements of low-rank updates, read from their factors (the top's search in
`estimate` screens with them; nothing here forms a whole update).

Contract
- `Factors.of(slot)`: a low-rank slot's factors on the CPU in fp32, its scale x strength folded into
  the up factor; None for an update that is not low-rank. `row_norm[i] * col_norm[j]` bounds
  |update[i, j]| (Cauchy-Schwarz, x 1.001 for the fp32 roundings of the update as a merge computes it);
  `terms_bound[i]` bounds row i's largest |value| term by term; `at(rows, cols)` is the update at
  those elements in fp32.
"""
from __future__ import annotations

import torch

GATHER_CHUNK = 4096


class Factors:
    """A low-rank slot's factors on the CPU in fp32 (see module doc)."""

    def __init__(self, down: torch.Tensor, up: torch.Tensor, k: float):
        self.up = up.float().cpu() * k
        self.down_t = down.float().cpu().t().contiguous()  # [in, rank]: a column's factors side by side
        self.rank = self.up.shape[1]
        self.row_norm = torch.linalg.vector_norm(self.up, dim=1) * 1.001
        self.col_norm = torch.linalg.vector_norm(self.down_t, dim=1)
        self.terms_bound = (self.up.abs() @ self.down_t.abs().amax(dim=0)) * 1.001

    @staticmethod
    def of(s) -> "Factors | None":
        stack = s.update.stack()
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
