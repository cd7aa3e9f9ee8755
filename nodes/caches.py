"""Per-process caches the nodes share: parsed adapter files and merge decisions.

Adapter files are keyed by (path, size, mtime), so an edited file is re-read; at most
`MAX_ADAPTERS` are kept. Decision caches are per base model (weakly keyed by the
diffusion model module), so two models never share a measurement.
"""
from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict

from ..lora_runtime import DecisionCache, LoraAdapter, load_adapter

MAX_ADAPTERS = 16


class AdapterFileCache:
    def __init__(self, max_items: int = MAX_ADAPTERS):
        self.max_items = max_items
        self._items: "OrderedDict[tuple, LoraAdapter]" = OrderedDict()
        self._lock = threading.Lock()
        self.loads = 0

    def load(self, path: str) -> LoraAdapter:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        adapter = load_adapter(path)
        with self._lock:
            self.loads += 1
            self._items[key] = adapter
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)
        return adapter


ADAPTERS = AdapterFileCache()
_DECISIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def decision_cache_for(diffusion_model) -> DecisionCache:
    cache = _DECISIONS.get(diffusion_model)
    if cache is None:
        cache = _DECISIONS[diffusion_model] = DecisionCache()
    return cache
