"""Low-rank updates read from their factors: single elements equal the whole update there, the bounds
hold. Reference: the layer's own dense update (`delta_rows`, as a merge forms it). Wrong answers: the
update without its scale x strength, and another slot's update."""
from __future__ import annotations

import torch

from comfyui_lora_runtime.lora_runtime import AdaptedLayer
from comfyui_lora_runtime.lora_runtime.decision.factor_bounds import Factors, updates_at
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter

OUT, IN = 96, 80


def _layer() -> AdaptedLayer:
    g = torch.Generator().manual_seed(3)
    w = AdaptedLayer(torch.nn.Linear(IN, OUT).to(torch.bfloat16), "l")
    for i, (rank, alpha, strength) in enumerate([(4, 2.0, 0.7), (8, 8.0, 1.3), (3, 1.0, -0.5)]):
        down = torch.randn(rank, IN, generator=g).to(torch.bfloat16)
        up = torch.randn(OUT, rank, generator=g).to(torch.bfloat16)
        w.add_adapter(f"a{i}", LayerAdapter("l", down=down, up=up, alpha=alpha), strength, content_hash=f"h{i}")
    return w


def test_elements_and_bounds_are_the_whole_updates():
    w = _layer()
    slots = [w.slots[f"a{i}"] for i in range(3)]
    factors = [Factors.of(s, torch.device("cpu")) for s in slots]
    dense = [w.delta_rows(slice(None), [s]) for s in slots]
    g = torch.Generator().manual_seed(4)
    r, c = torch.randint(0, OUT, (500,), generator=g), torch.randint(0, IN, (500,), generator=g)
    together = updates_at(factors)(r, c)
    for f, d, got in zip(factors, dense, together):
        # fp32 sums of 3 to 8 products in another order than the merge's product: a few ulps of the
        # largest term
        tol = 1e-5 * float(d.abs().amax())
        assert torch.allclose(f.at(r, c), d[r, c], rtol=0, atol=tol)
        assert torch.allclose(got, d[r, c], rtol=0, atol=tol)
        assert (f.row_norm[:, None] * f.col_norm[None, :] >= d.abs()).all()
        assert (f.terms_bound >= d.abs().amax(dim=1)).all()
        # term by term: each rank's |up| times its largest |down| (not a looser bound)
        assert torch.allclose(f.terms_bound, 1.001 * (f.up.abs() @ f.down_t.abs().amax(dim=0)), rtol=1e-6, atol=0)
    unscaled = Factors(*slots[1].update.stack()[:2], 1.0)
    assert not torch.allclose(unscaled.at(r, c), dense[1][r, c], atol=1e-3)  # wrong: scale x strength left out
    assert not torch.allclose(together[0], dense[1][r, c], atol=1e-3)        # wrong: another slot's update
