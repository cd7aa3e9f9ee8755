"""`DecisionCache`: measured rounding-loss shares and passed overflow checks, by content key.

Two levels: a bounded dict in memory (one cache per base model, held by the caller), and
optionally a `DiskDecisionStore` (`disk`) in a folder several processes share. A lookup
tries memory, then the disk (a disk hit is copied into memory); a measurement is stored in
both. The keys carry the content of what was measured (see `policy._adapter_key`'s
contract), so a changed weight, adapter file, strength or dtype is measured afresh,
never served an old answer. What the disk level could not use or write comes back as a
note for the report.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .disk_cache import DiskDecisionStore

SHARE, CHECK = "share", "check"
MEMORY, SHARED = "memory", "shared"


@dataclass
class DecisionCache:
    shares: dict = field(default_factory=dict)
    measurements: int = 0
    checks: dict = field(default_factory=dict)   # overflow checks passed (dynamic mode)
    check_measurements: int = 0
    max_entries: int = 512
    disk: DiskDecisionStore | None = None
    disk_hits: int = 0

    def clear(self) -> None:
        """Empty the memory level (the disk level is shared: it stays)."""
        self.shares.clear()
        self.checks.clear()

    def _put(self, table: dict, key, value) -> None:
        if len(table) >= self.max_entries:
            table.pop(next(iter(table)))  # the oldest entry
        table[key] = value

    def _table(self, table: str) -> dict:
        return self.shares if table == SHARE else self.checks

    def lookup(self, table: str, key) -> tuple[object | None, str, str]:
        """(value, where it came from: MEMORY / SHARED / '' on a miss, a note for the report or '')."""
        mem = self._table(table)
        if key in mem:
            return mem[key], MEMORY, ""
        if self.disk is None:
            return None, "", ""
        value, note = self.disk.get(table, key)
        if value is None:
            return None, "", note
        self._put(mem, key, value)
        self.disk_hits += 1
        return value, SHARED, note

    def store(self, table: str, key, value) -> str:
        """Keep a fresh measurement (counted) in memory and on disk; a note when the disk refused it."""
        self._put(self._table(table), key, value)
        if table == SHARE:
            self.measurements += 1
        else:
            self.check_measurements += 1
        return self.disk.put(table, key, value) if self.disk is not None else ""
