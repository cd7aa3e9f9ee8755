"""PNG text chunks as ComfyUI writes them.

SaveImage stores the API-format prompt as a tEXt chunk "prompt" (JSON) and each
entry of extra_pnginfo (normally {"workflow": <UI-format workflow>}) as a tEXt
chunk named after its key (JSON). Dragging such a PNG into ComfyUI restores the
workflow.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Mapping

import numpy as np
from PIL import Image
from PIL.PngImagePlugin import PngInfo

log = logging.getLogger(__name__)


def build_pnginfo(prompt: Mapping[str, Any] | None = None,
                  extra_pnginfo: Mapping[str, Any] | None = None) -> PngInfo:
    info = PngInfo()
    if prompt is not None:
        info.add_text("prompt", json.dumps(prompt))
    for key, value in (extra_pnginfo or {}).items():
        info.add_text(key, json.dumps(value))
    return info


def to_uint8_image(image) -> Image.Image:
    """[H,W,C] float in 0..1 (torch or numpy) -> PIL image, as ComfyUI: clip(255*x) then truncate."""
    if hasattr(image, "detach"):
        image = image.detach().to("cpu").float().numpy()
    arr = np.asarray(image, dtype=np.float32)
    if arr.ndim == 3 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[-1] not in (3, 4)):
        raise ValueError(f"image must be [H,W], [H,W,1], [H,W,3] or [H,W,4], got shape {arr.shape}")
    return Image.fromarray(np.clip(255.0 * arr, 0, 255).astype(np.uint8))


def save_png(path: str | os.PathLike, image, prompt: Mapping[str, Any] | None = None,
             extra_pnginfo: Mapping[str, Any] | None = None, compress_level: int = 4) -> None:
    img = image if isinstance(image, Image.Image) else to_uint8_image(image)
    img.save(path, pnginfo=build_pnginfo(prompt, extra_pnginfo), compress_level=compress_level)


def read_png_text(path: str | os.PathLike) -> dict[str, str]:
    """All text chunks of a PNG, raw."""
    with Image.open(path) as img:
        img.load()
        return dict(getattr(img, "text", {}) or {})


def read_png_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Text chunks of a PNG, JSON-decoded where they parse (prompt, workflow, ...)."""
    out: dict[str, Any] = {}
    for key, raw in read_png_text(path).items():
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out
