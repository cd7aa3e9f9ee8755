"""The one content digest of an adapter file, and a process-wide memo of it.

- `digest_bytes(buf)`: the digest of bytes in memory (what `load_safetensors` hashes while
  it builds the tensors: `LoraAdapter.content_hash`).
- `hash_file(path)`: the same digest of a file, streamed in chunks (never the whole file in
  memory). Reads the file every time.
- `file_digest(path)`: `hash_file` memoized per (real path, size, mtime_ns, inode): a file
  that has not changed is hashed once per process, however often it is asked for (a
  loader node's ``IS_CHANGED`` asks on every queue). A rewrite changes the size, the
  modification time or the inode, and is hashed again. `remember` files a digest of bytes
  already read (the loader's own read) under the stat taken before that read.

The digest follows the bytes only: the same file under another name has the same digest.
"""
from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict

DIGEST_SIZE = 16
CHUNK_BYTES = 8 * 2**20
MAX_MEMO = 4096

_memo: "OrderedDict[tuple, str]" = OrderedDict()
_lock = threading.Lock()


def _new():
    return hashlib.blake2b(digest_size=DIGEST_SIZE)


def digest_bytes(buf) -> str:
    """The content digest of `buf` (bytes, bytearray or memoryview)."""
    h = _new()
    h.update(buf)
    return h.hexdigest()


def hash_file(path: str | os.PathLike) -> str:
    """The content digest of the file at `path`, read now in chunks (equal to `digest_bytes`
    of its whole content). OSError when it cannot be read."""
    h = _new()
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while True:
            k = f.readinto(buf)
            if not k:
                break
            h.update(view[:k])
    return h.hexdigest()


def stat_key(path: str | os.PathLike, st: os.stat_result | None = None) -> tuple:
    """What the memo is keyed by: (real path, size, mtime_ns, inode)."""
    st = st if st is not None else os.stat(path)
    return (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)


def _file(key: tuple, digest: str) -> None:
    with _lock:
        _memo[key] = digest
        _memo.move_to_end(key)
        while len(_memo) > MAX_MEMO:
            _memo.popitem(last=False)


def file_digest(path: str | os.PathLike) -> str:
    """The content digest of the file at `path`, hashed at most once per (path, size, mtime_ns,
    inode) in this process. A file that changed while it was hashed is not memoized (its next
    request hashes it again). OSError when it cannot be read."""
    before = stat_key(path)
    with _lock:
        hit = _memo.get(before)
        if hit is not None:
            _memo.move_to_end(before)
            return hit
    digest = hash_file(path)
    if stat_key(path) == before:
        _file(before, digest)
    return digest


def remember(key: tuple, digest: str) -> None:
    """File `digest` (of bytes read after `stat_key` gave `key`) when the file still has that key."""
    try:
        now = stat_key(key[0])
    except OSError:
        return
    if now == key:
        _file(key, digest)


def forget() -> None:
    """Drop every memoized digest (tests; a host that wants a fresh start)."""
    with _lock:
        _memo.clear()
