"""The update types, as one plain list, and what loading reads off them.

`UPDATE_TYPES` is the registry: a type takes part in key splitting, detection, format labels
and the list of supported keys by being in it (a wrapping type, ``wraps = True``, wraps the one
type a layer's keys describe). Beside the types: the parts every layer may carry (alpha,
diff_b), the parts of parameter deltas (not updates: the matcher makes them `ParamDelta`) and
the parts recognised only to be refused by name.
"""
from __future__ import annotations

import re
from typing import Iterator

from .base import Update
from .dora import DoRA
from .full import Full
from .loha import LoHa
from .lokr import LoKr
from .lora import LoRA

UPDATE_TYPES: list[type[Update]] = [LoRA, LoHa, LoKr, DoRA, Full]

# Parts every layer may carry beside its type's: alpha (scale source), diff_b (output offset;
# also PEFT lora_bias / BFL control LoRA ``.lora_B.bias``, which ComfyUI maps to diff_b).
COMMON_FILE_KEYS = (
    (re.compile(r"\.alpha$"), "alpha"),
    (re.compile(r"\.diff_b$"), "diff_b"),
    (re.compile(r"\.lora_B(?:\.(?P<slot>[A-Za-z0-9_\-]+))?\.bias$"), "diff_b"),
)
COMMON_PARTS = ((re.compile(r"^(?:alpha|diff_b)$"), ""),)
# Deltas of parameters that have no matrix product (`ParamDelta`): bare parameters, norm weights/biases.
PARAM_FILE_KEYS = (
    (re.compile(r"\.diff_m$"), "diff_m"),
    (re.compile(r"\.w_norm$"), "w_norm"),
    (re.compile(r"\.b_norm$"), "b_norm"),
)
_OTHER_FORMATS = ((2, re.compile(r"\.alpha$"), "kohya"), (3, re.compile(r"\.(?:diff_b|diff_m|w_norm|b_norm)$"), "diff"))
_OTHER_SUPPORTED = ("diff_b", "diff_m, w_norm/b_norm")

# (part, what it is, whether file keys ending in it are recognised so the error can name them)
REFUSED: tuple[tuple[str, str, bool], ...] = (
    ("lora_mid.weight", "LoCon Tucker mid factor (convolutions only)", True),
    ("oft_blocks", "OFT/BOFT", True), ("oft_diag", "OFT", True), ("rescale", "OFT/BOFT", True),
    ("a1.weight", "GLoRA", False), ("a2.weight", "GLoRA", False), ("b1.weight", "GLoRA", False),
    ("b2.weight", "GLoRA", False),
    ("reshape_weight", "weight reshaping", True), ("w_norm", "norm-layer diff", False),
    ("b_norm", "norm-layer diff", False), ("set_weight", "weight replacement ('set')", True),
)
REFUSED_WHY: dict[str, str] = {part: why for part, why, _ in REFUSED}
_REFUSED_FILE_KEY = re.compile(r"\.(?P<name>" + "|".join(re.escape(p) for p, _, named in REFUSED if named) + r")$")


def file_keys() -> Iterator[tuple[re.Pattern, str]]:
    """(pattern on a file key's end, part) of every registered type, then the common, parameter
    and refused parts; the first that matches splits a key."""
    for cls in UPDATE_TYPES:
        yield from cls.FILE_KEYS
    yield from COMMON_FILE_KEYS
    yield from PARAM_FILE_KEYS
    yield _REFUSED_FILE_KEY, "{name}"


def classify_part(part: str) -> str | None:
    """The role of a key part: 'down', 'up', 'dora', or the canonical name (alpha,
    hada_*, lokr_*, diff, diff_b); None when unknown."""
    for cls in UPDATE_TYPES:
        for pattern, role in cls.KEY_PARTS:
            if pattern.match(part):
                return role or part
    for pattern, role in COMMON_PARTS:
        if pattern.match(part):
            return role or part
    return None


def format_of(key: str) -> str:
    """The format label of a file key (peft, kohya, lycoris-*, diff), 'other' when none fits."""
    best = None
    for cls in UPDATE_TYPES:
        for rank, pattern, label in cls.FORMATS:
            if (best is None or rank < best[0]) and pattern.search(key):
                best = (rank, label)
    for rank, pattern, label in _OTHER_FORMATS:
        if (best is None or rank < best[0]) and pattern.search(key):
            best = (rank, label)
    return best[1] if best else "other"


def supported() -> str:
    """The keys this loader understands, for errors."""
    return ", ".join([cls.SUPPORTED for cls in UPDATE_TYPES if cls.SUPPORTED] + list(_OTHER_SUPPORTED))


def scaled_by_alpha(parts) -> bool:
    """Whether one of these key parts belongs to a (non-wrapping) type whose scale reads alpha."""
    return any(not cls.wraps and cls.scaled_by_alpha and any(cls.claims(classify_part(p) or "") for p in parts)
               for cls in UPDATE_TYPES)


def to_matrices(parts: dict, stem: str) -> tuple[dict, tuple[int, ...]]:
    """(the parts with every type's convolution factors rewritten as matrices, the conv kernel or ())."""
    out = dict(parts)
    kernel: tuple[int, ...] = ()
    for cls in UPDATE_TYPES:
        kernel = cls.to_matrices(out, stem) or kernel
    return out, kernel
