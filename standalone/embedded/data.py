"""Glyph images made by the project: coloured digits on black, 64x64 RGB.

Contract
--------
* ``render_glyph(spec) -> uint8 [64, 64, 3]``: one digit drawn with Pillow's
  bundled default font (``ImageFont.load_default(size)``, Aileron Regular,
  CC0) near the centre: offset ``(dx, dy)`` pixels, rotated ``angle`` degrees
  about the glyph centre, ``size`` points, coloured ``COLOURS[colour]`` on black.
  ``outlined=True`` draws only a ``OUTLINE_WIDTH``-pixel stroke around the glyph
  (the interior stays black): the style the outline adapter is trained on.
* ``sample_specs(n, seed, outlined)``: deterministic random specs (digit, colour
  uniform; dx, dy in [-2, 2] px, angle in [-5, 5] deg, size in 44..48 pt).
* ``render_batch(n, seed, outlined) -> (uint8 [n, 64, 64, 3], digits [n], colours [n])``
  (torch tensors). Same seed, same images (on the same Pillow/FreeType build).
* ``prompt_for(digit, colour) -> "red 7"``; digits are ``DIGITS``, colours
  ``COLOUR_NAMES`` (index = class id).
"""
from __future__ import annotations

import functools
import logging
import random
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

IMAGE_SIZE = 64
DIGITS = [str(d) for d in range(10)]
COLOUR_NAMES = ["red", "green", "blue", "white"]
COLOURS = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "white": (255, 255, 255),
}
SIZES = (44, 45, 46, 47, 48)
MAX_OFFSET = 2
MAX_ANGLE = 5.0
OUTLINE_WIDTH = 3


@dataclass(frozen=True)
class GlyphSpec:
    digit: int
    colour: int
    outlined: bool = False
    dx: int = 0
    dy: int = 0
    angle: float = 0.0
    size: int = 46


def prompt_for(digit: int, colour: int) -> str:
    """Prompt text of a glyph: ``"<colour> <digit>"``, e.g. ``"red 7"``."""
    return f"{COLOUR_NAMES[colour]} {DIGITS[digit]}"


@functools.lru_cache(maxsize=None)
def _font(size: int):
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def glyph_mask(spec: GlyphSpec) -> np.ndarray:
    """uint8 [64, 64] coverage mask of the glyph (255 = full colour)."""
    from PIL import Image, ImageDraw

    img = Image.new("L", (IMAGE_SIZE, IMAGE_SIZE), 0)
    draw = ImageDraw.Draw(img)
    cx, cy = IMAGE_SIZE / 2 + spec.dx, IMAGE_SIZE / 2 + spec.dy
    text = DIGITS[spec.digit]
    if spec.outlined:
        draw.text((cx, cy), text, font=_font(spec.size), fill=0, anchor="mm",
                  stroke_width=OUTLINE_WIDTH, stroke_fill=255)
    else:
        draw.text((cx, cy), text, font=_font(spec.size), fill=255, anchor="mm")
    if spec.angle:
        img = img.rotate(spec.angle, resample=Image.BICUBIC, center=(cx, cy))
    return np.asarray(img, dtype=np.uint8)


def render_glyph(spec: GlyphSpec) -> np.ndarray:
    """uint8 [64, 64, 3] RGB image of one glyph."""
    mask = glyph_mask(spec).astype(np.uint16)
    rgb = np.asarray(COLOURS[COLOUR_NAMES[spec.colour]], dtype=np.uint16)
    return ((mask[:, :, None] * rgb[None, None, :] + 127) // 255).astype(np.uint8)


def sample_specs(n: int, seed: int, outlined: bool = False) -> list[GlyphSpec]:
    """n deterministic random glyph specs from ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        out.append(GlyphSpec(
            digit=rng.randrange(10),
            colour=rng.randrange(len(COLOUR_NAMES)),
            outlined=outlined,
            dx=rng.randint(-MAX_OFFSET, MAX_OFFSET),
            dy=rng.randint(-MAX_OFFSET, MAX_OFFSET),
            angle=rng.uniform(-MAX_ANGLE, MAX_ANGLE),
            size=rng.choice(SIZES),
        ))
    return out


def render_specs(specs: list[GlyphSpec]) -> torch.Tensor:
    """uint8 [n, 64, 64, 3] for a list of specs."""
    if not specs:
        return torch.zeros(0, IMAGE_SIZE, IMAGE_SIZE, 3, dtype=torch.uint8)
    return torch.from_numpy(np.stack([render_glyph(s) for s in specs]))


def render_batch(n: int, seed: int, outlined: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(images uint8 [n, 64, 64, 3], digits int64 [n], colours int64 [n])."""
    specs = sample_specs(n, seed, outlined)
    images = render_specs(specs)
    digits = torch.tensor([s.digit for s in specs], dtype=torch.int64)
    colours = torch.tensor([s.colour for s in specs], dtype=torch.int64)
    return images, digits, colours


def to_float(images: torch.Tensor) -> torch.Tensor:
    """uint8 [.., 64, 64, 3] -> float32 0..1 (ComfyUI IMAGE layout)."""
    return images.to(torch.float32) / 255.0
