"""The queue-time check of an adapter file: what its header alone tells, cheap enough for
ComfyUI's validation of a prompt."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import LoraRuntimeError
from ..updates.registry import supported
from . import scale_sources, text_encoder_keys
from .key_formats import split_key
from .safetensors_file import read_header

_HEADER_CHECKS: dict[tuple, str] = {}


def check_adapter_file(path: str | os.PathLike, *, text_encoder_only_ok: bool = False) -> str:
    """The checks that need only the header, cheap enough for ComfyUI's validation of a
    prompt (before anything runs): not safetensors (pickle, zip, HTML, GGUF: never
    opened), truncated or corrupt header, no tensor that looks like a LoRA key, a
    non-finite or non-numeric alpha in the header's metadata. '' when it passes, else the
    message (naming the file, the key and the fix). Cached by (path, size, mtime).
    ``text_encoder_only_ok``: a file of text-encoder layers only passes (a model + CLIP loader).
    What needs the tensors or the model (NaN inside a tensor, shapes, layers matched)
    is checked when the node runs."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        return f"adapter file {p.name} cannot be read ({e.strerror or e})"
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns, text_encoder_only_ok)
    if key not in _HEADER_CHECKS:
        _HEADER_CHECKS[key] = _check_header(p, text_encoder_only_ok)
    return _HEADER_CHECKS[key]


def _check_header(p: Path, text_encoder_only_ok: bool = False) -> str:
    try:
        header, _ = read_header(p)
    except LoraRuntimeError as e:
        return str(e)
    names = [k for k in header if k != "__metadata__"]
    if not names:
        return f"{p.name} holds no tensors; it is not a LoRA adapter"
    stems = [parts[0] for parts in map(split_key, names) if parts is not None]
    if not stems:
        return (f"{p.name} has no LoRA weights this loader understands (e.g. {names[:3]}); "
                f"supported: {supported()}")
    if not text_encoder_only_ok and all(text_encoder_keys.is_text_encoder(s) for s in stems):
        te = {}
        for k in names:
            parts = split_key(k)
            if parts is not None:
                te.setdefault(parts[0], _Keys()).keys.append(k)
        return text_encoder_keys.only_text_encoder_message(p.name, te)
    meta = {str(k): str(v) for k, v in (header.get("__metadata__") or {}).items()}
    try:
        scale_sources.find_config(p, meta)
    except LoraRuntimeError as e:
        return str(e)
    return ""


class _Keys:  # the keys of one stem, for counting before the tensors are read
    def __init__(self):
        self.keys: list[str] = []

