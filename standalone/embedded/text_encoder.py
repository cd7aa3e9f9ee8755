"""TinyTextEncoder: prompts like ``"red 7"`` -> Wan-shaped conditioning [1, L, 4096].

Contract
--------
* ``VOCAB``: the words it knows, the colours ``red green blue white`` and the
  digits ``0``..``9``. A prompt is split on whitespace and commas,
  case-insensitively; at most ``MAX_TOKENS`` words.
* ``encode(prompt) -> float32 [1, MAX_TOKENS, 4096]``: one fixed embedding row
  per word, in prompt order, then the padding row up to ``MAX_TOKENS``. The empty
  prompt (only padding) is the unconditional (negative) conditioning the model
  was trained with (prompt dropout).
* Unknown words raise ``ValueError`` naming the word and listing the vocabulary.
* The embeddings are fixed seeded Gaussian rows (``make(seed)``), stored as
  safetensors (``save``/``load``): no learned text model is involved.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from .data import COLOUR_NAMES, DIGITS

logger = logging.getLogger(__name__)

TEXT_DIM = 4096
MAX_TOKENS = 4
VOCAB: list[str] = list(COLOUR_NAMES) + list(DIGITS)
PAD = "<pad>"


def tokenize(prompt: str) -> list[str]:
    """Lower-cased words of a prompt (split on whitespace and commas); checked against VOCAB."""
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    words = [w for w in re.split(r"[\s,]+", prompt.strip().lower()) if w]
    unknown = [w for w in words if w not in VOCAB]
    if unknown:
        raise ValueError(
            f"the embedded text encoder does not know {', '.join(repr(w) for w in unknown)} "
            f"in prompt {prompt!r}; its vocabulary is: {' '.join(VOCAB)} "
            f"(a colour and a digit, e.g. 'red 7'; the empty prompt is the negative)"
        )
    if len(words) > MAX_TOKENS:
        raise ValueError(f"prompt {prompt!r} has {len(words)} words; at most {MAX_TOKENS} are supported")
    return words


class TinyTextEncoder:
    """Fixed word embeddings laid out like Wan's T5 output (tokens x 4096)."""

    VOCAB = VOCAB

    def __init__(self, table: torch.Tensor):
        if tuple(table.shape) != (len(VOCAB) + 1, TEXT_DIM):
            raise ValueError(f"embedding table has shape {tuple(table.shape)}; expected ({len(VOCAB) + 1}, {TEXT_DIM})")
        self.table = table.to(torch.float32).contiguous()  # rows: VOCAB..., PAD

    @classmethod
    def make(cls, seed: int = 0) -> "TinyTextEncoder":
        gen = torch.Generator().manual_seed(seed)
        return cls(torch.randn(len(VOCAB) + 1, TEXT_DIM, generator=gen))

    def save(self, path) -> None:
        from safetensors.torch import save_file

        # one metadata key: safetensors writes several in a random order (bytes would differ run to run)
        save_file({"embeddings": self.table}, str(path), metadata={"vocab": " ".join(VOCAB + [PAD])})

    @classmethod
    def load(cls, path) -> "TinyTextEncoder":
        from safetensors import safe_open

        path = Path(path)
        if path.suffix != ".safetensors":
            raise ValueError(f"{path}: the text encoder is stored as .safetensors")
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("vocab") != " ".join(VOCAB + [PAD]):
                raise ValueError(f"{path}: vocabulary {meta.get('vocab')!r} does not match this encoder's")
            return cls(f.get_tensor("embeddings"))

    def token_ids(self, prompt: str) -> list[int]:
        ids = [VOCAB.index(w) for w in tokenize(prompt)]
        return ids + [len(VOCAB)] * (MAX_TOKENS - len(ids))

    def encode(self, prompt: str) -> torch.Tensor:
        """float32 [1, MAX_TOKENS, 4096] conditioning for one prompt."""
        return self.table[self.token_ids(prompt)].unsqueeze(0).clone()

    def encode_batch(self, prompts: list[str]) -> torch.Tensor:
        """float32 [B, MAX_TOKENS, 4096] for several prompts (one row each)."""
        return torch.cat([self.encode(p) for p in prompts], dim=0)
