"""Reading adapter files: safetensors only, never unpickled, never memory-mapped.

- `read_header(path)` reads only the header (cheap: prompt validation) and checks it.
- `load_safetensors(path)` reads the whole file ONCE into memory the process owns, checks
  the header and every tensor entry against those bytes, hashes those same bytes
  (`content_digest`) and builds the tensors as views of them. Nothing stays mapped to the
  file: rewriting, truncating or deleting it afterwards changes no loaded tensor and cannot fault.

Every malformed value (a pickle, an HTML page, a truncated file, a header that is not a
JSON object or is nested too deep, ``__metadata__`` that is not a string map, a tensor
entry with a bad dtype, shape or offsets) is an `AdapterFileError` naming the file (and
the key) and the fix.
"""
from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import torch

from ..errors import AdapterFileError
from . import content_digest

_MAX_HEADER = 100 * 1024 * 1024
_REDOWNLOAD = "the file is corrupt or was written by a broken tool — re-download or re-save it"

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)


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


def _header_length(name: str, head: bytes, size: int) -> int:
    """The declared header length, after refusing files that are not safetensors at all."""
    # A safetensors file starts with its header length (u64 LE) and then "{"; only a
    # file that is not that shape is sniffed (a header length can start with 0x80).
    looks_safetensors = len(head) >= 9 and head[8:9] == b"{"
    kind = None if looks_safetensors else _sniff_non_safetensors(bytes(head[:9]))
    if kind is not None:
        if "HTML" in kind:
            raise AdapterFileError(f"{name} is {kind}, not a .safetensors file: the download saved a web "
                                   "page instead of the adapter. Download the file again (the direct file link)")
        if "GGUF" in kind:
            raise AdapterFileError(f"{name} is {kind}, not a .safetensors file; this loader reads safetensors "
                                   "LoRA files only. Get the adapter's .safetensors version")
        raise AdapterFileError(
            f"{name} is {kind}, not a .safetensors file. It was not opened "
            f"(pickled files can run code). Convert it to safetensors and load that."
        )
    if len(head) < 8:
        raise AdapterFileError(f"{name} is too short ({size} bytes) to be a safetensors file; re-download it")
    (n,) = struct.unpack("<Q", bytes(head[:8]))
    if n <= 1 or n > _MAX_HEADER or 8 + n > size:
        raise AdapterFileError(
            f"{name} has no valid safetensors header (declared header length {n}, "
            f"file size {size}); the file is corrupt, truncated or not safetensors — re-download it"
        )
    return n


def _parse_header(name: str, raw: bytes, n: int, size: int) -> dict:
    """The header JSON, with every tensor entry and the metadata checked against `size`."""
    try:
        header = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterFileError(f"{name}: the safetensors header is not valid JSON ({e}); re-download the file") from None
    except RecursionError:
        raise AdapterFileError(f"{name}: the safetensors header nests JSON too deep to be a safetensors "
                               f"header; {_REDOWNLOAD}") from None
    if not isinstance(header, dict):
        raise AdapterFileError(f"{name}: the safetensors header is not a JSON object; re-download the file")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise AdapterFileError(f"{name}: header key '__metadata__' must map names to strings (it is "
                               f"{_describe(meta)}); {_REDOWNLOAD}")
    data_size = size - 8 - n
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        begin, end = _check_entry(name, key, info)
        if end > data_size:
            raise AdapterFileError(
                f"{name} is truncated: its header describes {8 + n + end} bytes but the file has {size}; re-download it"
            )
        spans.append((begin, end, key))
    spans.sort()
    for (_, prev_end, prev_key), (begin, _, key) in zip(spans, spans[1:]):
        if begin < prev_end:
            raise AdapterFileError(f"{name}: tensors {prev_key!r} and {key!r} overlap in the file; {_REDOWNLOAD}")
    return header


def _describe(value) -> str:
    if isinstance(value, dict):
        bad = next(k for k, v in value.items() if not isinstance(v, str))
        return f"a map whose value for {bad!r} is a {type(value[bad]).__name__}"
    return f"a JSON {type(value).__name__}"


def _check_entry(name: str, key: str, info) -> tuple[int, int]:
    """(begin, end) of a tensor entry whose dtype, shape and offsets agree."""
    def bad(what: str) -> AdapterFileError:
        return AdapterFileError(f"{name}: tensor entry {key!r} in the header is malformed ({what}); re-download the file")

    if not isinstance(info, dict):
        raise bad(f"a JSON {type(info).__name__}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPES:
        raise bad(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets {offsets!r} are not two increasing non-negative integers")
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=DTYPES[dtype]).element_size()
    if offsets[1] - offsets[0] != nbytes:
        raise bad(f"shape {shape} of {dtype} needs {nbytes} bytes, its offsets span {offsets[1] - offsets[0]}")
    return offsets[0], offsets[1]


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """Return (header dict, header length) after checking the file is whole safetensors.
    Reads the first 8 + header-length bytes only."""
    p = Path(path)
    if not p.is_file():
        raise AdapterFileError(f"adapter file not found: {p}")
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(9)
        n = _header_length(p.name, head, size)
        f.seek(8)
        raw = f.read(n)
    if len(raw) < n:
        raise AdapterFileError(f"{p.name} is truncated (it changed while being read); re-download it")
    return _parse_header(p.name, raw, n, size), n


def read_owned(path: str | os.PathLike) -> bytearray:
    """The whole file in one buffer the process owns (read, never mapped)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf = bytearray(size)
            view, got = memoryview(buf), 0
            while got < size:
                k = f.readinto(view[got:])
                if not k:
                    break
                got += k
    except FileNotFoundError:
        raise AdapterFileError(f"adapter file not found: {p}") from None
    except OSError as e:
        raise AdapterFileError(f"adapter file {p.name} cannot be read ({e.strerror or e})") from None
    if got < size:  # shrank while being read: check what was read (the header check says truncated)
        del buf[got:]
    return buf


def load_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
    """Every tensor (CPU, in memory the process owns), the string metadata and the content
    hash of exactly the bytes the tensors were built from."""
    p = Path(path)
    try:
        before = content_digest.stat_key(p)
    except OSError:
        before = None  # read_owned names the problem
    buf = read_owned(p)
    size = len(buf)
    n = _header_length(p.name, buf[:9], size)
    header = _parse_header(p.name, memoryview(buf)[8:8 + n], n, size)
    if sys.byteorder != "little":
        raise AdapterFileError(f"{p.name}: safetensors data is little-endian; this loader runs on "
                               "little-endian machines only")
    base = 8 + n
    tensors: dict[str, torch.Tensor] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype, shape = DTYPES[info["dtype"]], info["shape"]
        if begin == end:
            tensors[key] = torch.empty(shape, dtype=dtype)
            continue
        start = base + begin
        if start % torch.empty((), dtype=dtype).element_size():  # unaligned in the file: an aligned copy
            tensors[key] = torch.frombuffer(bytearray(buf[start:base + end]), dtype=dtype).reshape(shape)
        else:
            tensors[key] = torch.frombuffer(buf, dtype=dtype, count=(end - begin) // torch.empty(
                (), dtype=dtype).element_size(), offset=start).reshape(shape)
    meta = header.get("__metadata__") or {}
    digest = content_digest.digest_bytes(buf)
    if before is not None and before[1] == size:  # the loader node's IS_CHANGED need not hash it again
        content_digest.remember(before, digest)
    return tensors, dict(meta), digest

