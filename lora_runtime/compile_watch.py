"""Notices when torch.compile gives up on a function: its recompile limit was hit, and from then
on that function runs uncompiled (torch only logs a warning). The report names them.

Contract
- `install()` (idempotent) listens on torch's dynamo frame-conversion logger for the
  recompile-limit warning; `fallbacks()` lists every function it saw give up in this process
  (it stays uncompiled for the rest of the process), oldest first; `reset()` forgets them.
- `graphs_compiled()`: how many graphs torch.compile has compiled in this process so far (a
  sampling's difference says whether it compiled or recompiled anything).
- `report_entry(graphs=0)` is what a runtime report carries: None while nothing gave up and
  the run compiled no graph.
"""
from __future__ import annotations

import logging
import threading

_LOGGER = "torch._dynamo.convert_frame"
_PREFIX = "torch._dynamo hit config."

_lock = threading.Lock()
_seen: dict[str, dict] = {}


class _Handler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if not isinstance(record.msg, str) or not record.msg.startswith(_PREFIX):
            return
        args = record.args if isinstance(record.args, tuple) else ()
        limit_type = str(args[0]) if len(args) > 0 else "recompile_limit"
        limit = args[1] if len(args) > 1 else None
        function = str(args[2]) if len(args) > 2 else "?"
        reason = str(args[3]) if len(args) > 3 else ""
        with _lock:
            _seen.setdefault(function, {"function": function, "limit": limit_type,
                                        "value": limit if isinstance(limit, int) else None,
                                        "last_reason": reason[:300]})


_HANDLER = _Handler(level=logging.WARNING)


def install() -> None:
    logger = logging.getLogger(_LOGGER)
    if _HANDLER not in logger.handlers:
        logger.addHandler(_HANDLER)


def fallbacks() -> list[dict]:
    with _lock:
        return [dict(v) for v in _seen.values()]


def reset() -> None:
    with _lock:
        _seen.clear()


def graphs_compiled() -> int:
    try:
        from torch._dynamo.utils import counters
    except Exception:  # no dynamo in this torch build: nothing is ever compiled
        return 0
    return int(counters["stats"]["unique_graphs"])


def report_entry(graphs: int = 0) -> dict | None:
    fb = fallbacks()
    if not fb and not graphs:
        return None
    out = {"graphs_compiled": int(graphs), "fallbacks": fb}
    if fb:
        out["message"] = (f"torch.compile hit its {fb[0]['limit']} on {len(fb)} function"
                          f"{'' if len(fb) == 1 else 's'}; they run uncompiled for the rest of this process "
                          "(restart to compile them again): " + ", ".join(f["function"] for f in fb))
    return out
