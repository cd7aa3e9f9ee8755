"""Reading adapter files: safetensors only, never unpickled.

The header is checked by hand before the safetensors library sees the file, so a
pickled checkpoint, a truncated download or an HTML error page gets an error that
names the file and the fix instead of a library traceback.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from ..errors import AdapterFileError

_MAX_HEADER = 100 * 1024 * 1024


def _sniff_non_safetensors(head: bytes) -> str | None:
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive (a pickled PyTorch checkpoint, .pt/.ckpt/.bin)"
    if head[:1] == b"\x80":
        return "a raw pickle"
    if head.lstrip()[:1] == b"<":
        return "an HTML/XML page (a failed download?)"
    if head.startswith(b"GGUF"):
        return "a GGUF file"
    return None


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """Return (header dict, header length) after checking the file is whole safetensors."""
    p = Path(path)
    if not p.is_file():
        raise AdapterFileError(f"adapter file not found: {p}")
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(9)
        # A safetensors file starts with its header length (u64 LE) and then "{"; only a
        # file that is not that shape is sniffed (a header length can start with 0x80).
        looks_safetensors = len(head) == 9 and head[8:9] == b"{"
        kind = None if looks_safetensors else _sniff_non_safetensors(head)
        if kind is not None:
            if "HTML" in kind:
                raise AdapterFileError(f"{p.name} is {kind}, not a .safetensors file: the download saved a web "
                                       "page instead of the adapter. Download the file again (the direct file link)")
            if "GGUF" in kind:
                raise AdapterFileError(f"{p.name} is {kind}, not a .safetensors file; this loader reads safetensors "
                                       "LoRA files only. Get the adapter's .safetensors version")
            raise AdapterFileError(
                f"{p.name} is {kind}, not a .safetensors file. It was not opened "
                f"(pickled files can run code). Convert it to safetensors and load that."
            )
        head = head[:8]
        f.seek(8)
        if len(head) < 8:
            raise AdapterFileError(f"{p.name} is too short ({size} bytes) to be a safetensors file; re-download it")
        (n,) = struct.unpack("<Q", head)
        if n <= 1 or n > _MAX_HEADER or 8 + n > size:
            raise AdapterFileError(
                f"{p.name} has no valid safetensors header (declared header length {n}, "
                f"file size {size}); the file is corrupt, truncated or not safetensors — re-download it"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterFileError(f"{p.name}: the safetensors header is not valid JSON ({e}); re-download the file") from None
    if not isinstance(header, dict):
        raise AdapterFileError(f"{p.name}: the safetensors header is not a JSON object; re-download the file")
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, IndexError, TypeError, ValueError):
            raise AdapterFileError(f"{p.name}: tensor entry {key!r} in the header is malformed; re-download the file") from None
    if 8 + n + end > size:
        raise AdapterFileError(
            f"{p.name} is truncated: its header describes {8 + n + end} bytes but the file has {size}; re-download it"
        )
    return header, n


def load_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
    """Load every tensor (on CPU), the string metadata and a content hash of the file."""
    header, _ = read_header(path)
    p = Path(path)
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(p), device="cpu")
    except Exception as e:  # safetensors raises its own error types
        raise AdapterFileError(f"{p.name} could not be read as safetensors ({e}); the file is corrupt — re-download it") from None
    meta = header.get("__metadata__") or {}
    return tensors, {str(k): str(v) for k, v in meta.items()}, file_digest(p)


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
