"""Why a stem names nothing in the model: a Wan 2.2 expert of a two-expert file, or no such layer."""
from __future__ import annotations

import re

from .resolve import resolve

NO_SUCH_LAYER = "no such layer in the model"
_EXPERT = re.compile(r"^(.*?)transformer_([12])[._](blocks[._].*)$")


def why_unresolved(stem: str, modules: dict, family: str | None = None) -> str:
    """One expert of a file holding both Wan 2.2 experts (``transformer_1.`` = high noise,
    ``transformer_2.`` = low noise, as ai-toolkit writes them together), or `NO_SUCH_LAYER`."""
    m = _EXPERT.match(stem)
    if m and resolve(m.group(1) + m.group(3), modules, family=family) is not None:
        which = "high-noise" if m.group(2) == "1" else "low-noise"
        return (f"names transformer_{m.group(2)}, the {which} expert of a file holding both Wan 2.2 experts; this "
                "model is one expert: load the file saved for it (ai-toolkit saves one per expert unless "
                "split_multistage_loras is off)")
    return NO_SUCH_LAYER
