"""The decision cache's second level: one JSON file per entry in a folder several processes share.

`DiskDecisionStore(folder)` keeps `DecisionCache` entries (a measured share, a passed overflow
check) under names that depend on the entry's key only (`entry_name`: a digest of the key's
canonical JSON), so every process on every machine that shares the folder finds the same
entry for the same key. An entry is self-describing: the format name and version, the
table, the full key, the value and a checksum over all of them.

- Writes are atomic: a temp file in the folder, flushed, then ``os.replace`` over the entry.
  Writers of the same entry race harmlessly (each replace puts a whole file; same key,
  same value); a reader never sees half a file.
- A read returns the value only when everything checks: readable JSON, this format and
  version, the same table and key, the checksum, a value of the right type. Anything else
  is a miss with a note saying why (the caller measures again and writes a good entry over
  it). A missing entry is a plain miss. Nothing is ever unpickled.
- A key that has no canonical JSON form (a value other than str, int, float, bool, None or
  tuples/lists of them; a non-finite float) is not stored.

The folder is named by the ``LORA_RUNTIME_DECISION_CACHE_DIR`` environment variable
(`from_env`); unset or empty: no disk level.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile

from ..settings import DECISION_CACHE_DIR_ENV

log = logging.getLogger(__name__)

FORMAT = "comfyui-lora-runtime decision cache entry"
VERSION = 1
TABLES = ("share", "check")
MAX_ENTRY_BYTES = 64 * 2**20


def _plain(x):
    """`x` as JSON values (tuples as lists), or raise TypeError/ValueError."""
    if x is None or isinstance(x, (bool, str, int)):
        return x
    if isinstance(x, float):
        if not math.isfinite(x):
            raise ValueError("non-finite float in a key")
        return x
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    raise TypeError(f"{type(x).__name__} in a key")


def canonical(obj) -> str | None:
    """The canonical JSON text of `obj`, or None when it has none."""
    try:
        return json.dumps(_plain(obj), separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError):
        return None


def _checksum(table: str, key_json: str, value) -> str:
    text = json.dumps([FORMAT, VERSION, table, key_json, value], separators=(",", ":"), allow_nan=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def entry_name(table: str, key) -> str | None:
    """The file name of `key`'s entry in `table`: the same in every process; None when the key
    cannot be stored."""
    text = canonical(key)
    if text is None:
        return None
    return f"{table}-{hashlib.blake2b(text.encode(), digest_size=20).hexdigest()}.json"


def _valid_value(table: str, value) -> bool:
    if table == "check":
        return value is True
    return isinstance(value, float) and math.isfinite(value) and value >= 0.0


class DiskDecisionStore:
    """Entries in `folder` (created on the first write). `get` and `put` never raise for the
    folder's content or an I/O error: they return a note instead."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        self.reads = self.hits = self.writes = 0

    def __repr__(self) -> str:
        return f"DiskDecisionStore({self.folder!r})"

    def get(self, table: str, key) -> tuple[object | None, str]:
        """(value, '') on a good entry; (None, '') when there is none; (None, note) when an entry
        is there but cannot be used (the note says which file and why)."""
        name = entry_name(table, key)
        if name is None:
            return None, ""
        path = os.path.join(self.folder, name)
        self.reads += 1
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_ENTRY_BYTES + 1)
        except (FileNotFoundError, NotADirectoryError):  # no entry (a write says what is wrong with the folder)
            return None, ""
        except OSError as e:
            return None, self._note(name, f"cannot be read ({e.strerror or e})")
        if len(raw) > MAX_ENTRY_BYTES:
            return None, self._note(name, "is larger than any entry this runtime writes")
        try:
            e = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None, self._note(name, "is not complete JSON (truncated or corrupt)")
        why = self._problem(e, table, canonical(key))
        if why:
            return None, self._note(name, why)
        self.hits += 1
        return e["value"], ""

    @staticmethod
    def _problem(e, table: str, key_json: str) -> str:
        """Why the parsed entry `e` is not usable for (table, key), or ''."""
        if not isinstance(e, dict):
            return "is not a JSON object"
        if e.get("format") != FORMAT:
            return f"is not a decision cache entry (format {str(e.get('format'))[:60]!r})"
        if e.get("version") != VERSION:
            return f"has format version {str(e.get('version'))[:20]}; this runtime reads version {VERSION}"
        if e.get("table") != table:
            return f"holds a {str(e.get('table'))[:20]!r} entry, not {table!r}"
        if canonical(e.get("key")) != key_json:
            return "holds another key (a foreign entry under this name)"
        value = e.get("value")
        if e.get("checksum") != (_checksum(table, key_json, value) if _valid_value(table, value) else None):
            return "fails its checksum or holds an invalid value (corrupt)"
        return ""

    def _note(self, name: str, why: str) -> str:
        note = f"shared decision cache entry {name} in {self.folder} {why}: ignored, measured again"
        log.warning("LoRA runtime: %s", note)
        return note

    def put(self, table: str, key, value) -> str:
        """Write the entry atomically; '' when written or not storable, else a note saying why not."""
        key_json = canonical(key)
        name = entry_name(table, key)
        if name is None or key_json is None or not _valid_value(table, value):
            return ""
        entry = {"format": FORMAT, "version": VERSION, "table": table, "key": json.loads(key_json),
                 "value": value, "checksum": _checksum(table, key_json, value)}
        data = json.dumps(entry, separators=(",", ":"), allow_nan=False).encode()
        tmp = None
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=self.folder)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.folder, name))
            tmp = None
        except OSError as e:
            note = f"shared decision cache entry {name} could not be written to {self.folder} ({e.strerror or e})"
            log.warning("LoRA runtime: %s", note)
            return note
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        self.writes += 1
        return ""


def from_env() -> DiskDecisionStore | None:
    """The store in the folder ``LORA_RUNTIME_DECISION_CACHE_DIR`` names, or None when it is unset."""
    folder = os.environ.get(DECISION_CACHE_DIR_ENV, "").strip()
    return DiskDecisionStore(os.path.expanduser(folder)) if folder else None
