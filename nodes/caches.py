"""Per-process caches the nodes share: parsed adapter files and merge decisions.

Adapter files are keyed by (path, size, mtime), so an edited file is re-read, and by
content hash, so a sampler gets exactly the content its loader node read: while that
adapter is cached the file is not touched again (it may have been rewritten, truncated
or deleted since). At most `MAX_ADAPTERS` are kept. Decision caches are per base model
(weakly keyed by the diffusion model module), so two models never share a measurement; each
has the disk level ``LORA_RUNTIME_DECISION_CACHE_DIR`` names (read when the cache is made),
shared with every process that names the same folder.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections import OrderedDict

from ..lora_runtime import DecisionCache, LoraAdapter, load_adapter
from ..lora_runtime.decision import disk_cache
from ..lora_runtime.errors import AdapterFileError

MAX_ADAPTERS = 16


class AdapterFileCache:
    def __init__(self, max_items: int = MAX_ADAPTERS):
        self.max_items = max_items
        self._items: "OrderedDict[tuple, LoraAdapter]" = OrderedDict()
        self._lock = threading.Lock()
        self.loads = 0

    def load(self, path: str, content_hash: str = "") -> LoraAdapter:
        """The adapter in `path`. With `content_hash` (what a loader node read): that content
        when it is still cached, without reading the file; else the file as it is now, with
        a report note when its content changed since the loader node read it."""
        if content_hash:
            with self._lock:
                for key, adapter in self._items.items():
                    if adapter.content_hash == content_hash and key[0] == os.path.realpath(path):
                        self._items.move_to_end(key)
                        return adapter
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise AdapterFileError(
                f"adapter file {os.path.basename(path)} was removed or renamed after its loader node read it "
                f"({path}); put it back or pick the file again in the node") from None
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        with self._lock:
            adapter = self._items.get(key)
            if adapter is not None:
                self._items.move_to_end(key)
        if adapter is None:
            adapter = load_adapter(path)
            with self._lock:
                self.loads += 1
                self._items[key] = adapter
                while len(self._items) > self.max_items:
                    self._items.popitem(last=False)
        if content_hash and adapter.content_hash != content_hash:
            adapter = dataclasses.replace(adapter, notes=adapter.notes + [
                "the file changed on disk after its loader node read it; this run used its current content"])
        return adapter


ADAPTERS = AdapterFileCache()
_DECISIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def share_decisions(source, clone) -> None:
    """Let the diffusion model `clone` (a fresh load of the same weights for another device) use the
    decisions measured on `source`: their keys carry the content measured, so they hold for it too."""
    if clone is not source:
        _DECISIONS[clone] = decision_cache_for(source)


def decision_cache_for(diffusion_model) -> DecisionCache:
    cache = _DECISIONS.get(diffusion_model)
    if cache is None:
        cache = _DECISIONS[diffusion_model] = DecisionCache(disk=disk_cache.from_env())
    return cache
