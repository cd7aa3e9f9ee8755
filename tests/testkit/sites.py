"""Models with each kind of fusion site, for the site and registry tests."""
import torch
from torch import nn


class DiffusersGELU(nn.Module):
    """Shape of diffusers' activations.GELU (proj + approximate)."""

    def __init__(self, d, f, approximate="tanh"):
        super().__init__()
        self.proj = nn.Linear(d, f)
        self.approximate = approximate

    def forward(self, x):
        return nn.functional.gelu(self.proj(x), approximate=self.approximate)


DiffusersGELU.__name__ = "GELU"


class FeedForward(nn.Module):  # diffusers: ff.net = [GELU(proj), Dropout, Linear]
    def __init__(self, d, f):
        super().__init__()
        self.net = nn.ModuleList([DiffusersGELU(d, f), nn.Dropout(0.0), nn.Linear(f, d)])

    def forward(self, x):
        for m in self.net:
            x = m(x)
        return x


class Mlp(nn.Module):  # timm / PixArt
    def __init__(self, d, f):
        super().__init__()
        self.fc1, self.act, self.drop1 = nn.Linear(d, f), nn.GELU(approximate="tanh"), nn.Dropout(0.0)
        self.norm, self.fc2, self.drop2 = nn.Identity(), nn.Linear(f, d), nn.Dropout(0.0)

    def forward(self, x):
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class SiteZoo(nn.Module):
    """blocks.0.ffn (Wan), ff (LTX/Qwen), mlp (PixArt), plus a non-site (exact GELU)."""

    def __init__(self, d=24, f=40, dtype=torch.float32, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.blocks = nn.ModuleList([nn.Module()])
        self.blocks[0].ffn = nn.Sequential(nn.Linear(d, f), nn.GELU(approximate="tanh"), nn.Linear(f, d))
        self.ff = FeedForward(d, f)
        self.mlp = Mlp(d, f)
        self.not_a_site = nn.Sequential(nn.Linear(d, f), nn.GELU(), nn.Linear(f, d))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 5))
        self.to(dtype)

    def forward(self, x):
        x = x + self.blocks[0].ffn(x)
        x = x + self.ff(x)
        x = x + self.mlp(x)
        return x + self.not_a_site(x)


FC1 = ["blocks.0.ffn.0", "ff.net.0.proj", "mlp.fc1"]


def routes_of(mounted) -> dict:
    """Calls per route, summed over the mounted sites."""
    out: dict = {}
    for s in mounted.sites:
        for k, v in s.routes.items():
            out[k] = out.get(k, 0) + v
    return out
