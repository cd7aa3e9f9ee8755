"""GlyphJudge: a small CNN that reads a glyph image back (digit, colour, outlined).

Contract
--------
* Input: ComfyUI IMAGE ``[B, 64, 64, 3]`` float 0..1.
* ``judge(images) -> Verdict`` with ``digit`` int64 [B] (0..9), ``colour`` int64 [B]
  (index into ``data.COLOUR_NAMES``), ``outlined`` bool [B].
* Trained by ``tools/train_embedded.py`` on rendered glyphs (plain and outlined),
  half of them passed through the codec so decoded samples look familiar.
  ``save``/``load`` use safetensors (float32). Used by the tests to check that
  sampled images show what the prompt asked for.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

N_DIGITS, N_COLOURS, N_OUTLINE = 10, 4, 2
N_OUT = N_DIGITS + N_COLOURS + N_OUTLINE


@dataclass
class Verdict:
    digit: torch.Tensor     # int64 [B]
    colour: torch.Tensor    # int64 [B]
    outlined: torch.Tensor  # bool [B]


class JudgeNet(nn.Module):
    """4 strided 3x3 convs (64 -> 4 px) and one linear layer to 16 logits."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList([
            nn.Conv2d(3, 16, 3, stride=2, padding=1),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.Conv2d(64, 64, 3, stride=2, padding=1),
        ])
        self.fc = nn.Linear(64 * 4 * 4, N_OUT)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # images: [B, 64, 64, 3] float 0..1 -> logits [B, 16]
        x = images.permute(0, 3, 1, 2).to(torch.float32) * 2.0 - 1.0  # [B, 3, 64, 64]
        for conv in self.convs:
            x = F.gelu(conv(x))
        return self.fc(x.flatten(1))

    @staticmethod
    def split(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return logits[:, :N_DIGITS], logits[:, N_DIGITS:N_DIGITS + N_COLOURS], logits[:, N_DIGITS + N_COLOURS:]


class GlyphJudge:
    """Loads a trained JudgeNet and classifies images."""

    def __init__(self, net: JudgeNet):
        self.net = net.eval()
        self.net.requires_grad_(False)

    @classmethod
    def load(cls, path) -> "GlyphJudge":
        from safetensors.torch import load_file

        path = Path(path)
        if path.suffix != ".safetensors":
            raise ValueError(f"{path}: the judge is stored as .safetensors")
        net = JudgeNet()
        net.load_state_dict({k: v.to(torch.float32) for k, v in load_file(str(path)).items()}, strict=True)
        return cls(net)

    def save(self, path) -> None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in self.net.state_dict().items()}, str(path),
                  metadata={"format": "glyph_judge"})

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, batch_size: int = 256) -> Verdict:
        if images.ndim != 4 or tuple(images.shape[1:]) != (64, 64, 3):
            raise ValueError(f"images must be [B, 64, 64, 3], got {tuple(images.shape)}")
        digits, colours, outlined = [], [], []
        for chunk in images.split(batch_size):
            d, c, o = JudgeNet.split(self.net(chunk))
            digits.append(d.argmax(1))
            colours.append(c.argmax(1))
            outlined.append(o.argmax(1) == 1)
        return Verdict(torch.cat(digits), torch.cat(colours), torch.cat(outlined))
