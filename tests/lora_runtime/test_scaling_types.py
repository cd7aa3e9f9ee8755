"""Scaling contract for every update type: the aten.mul count of one layer call per tier.

Each type multiplies its own scale, the strength and the runtime scale through `scaling`: in
`exact` (and without a context) every non-unit factor once, in order; in `lossless`/`high` their
product once (plain LoRA, and sliced updates whose parts are all plain LoRA: none, the product
is the addmm's alpha). Structural multiplies (DoRA's
g) are counted per type. A unit factor is never multiplied.
"""
import itertools

import pytest
import torch

from comfyui_lora_runtime.lora_runtime import AdaptedLayer, runtime_context
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
from comfyui_lora_runtime.lora_runtime import updates as U
from testkit.compare import MulCounter

OUT, IN = 40, 48



def rnd(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.2


def _lora(alpha, seed=1, out=OUT):
    return U.LoRA(rnd(2, IN, seed=seed), rnd(out, 2, seed=seed + 1), alpha)


# type -> (build(alpha), per-call scale multiplies: [scale, ...] applied inside the type's forward,
#          structural multiplies per call)
TYPES = {
    "lora": (lambda a: _lora(a), None, 0),
    "loha_khatri_rao": (lambda a: U.LoHa(rnd(OUT, 2, seed=3), rnd(2, IN, seed=4), rnd(OUT, 2, seed=5),
                                         rnd(2, IN, seed=6), a), "own", 0),
    "loha_dense": (lambda a: U.LoHa(rnd(OUT, 8, seed=3), rnd(8, IN, seed=4), rnd(OUT, 8, seed=5),
                                    rnd(8, IN, seed=6), a), "baked", 0),
    "lokr": (lambda a: U.LoKr(w1=rnd(4, 4, seed=7), w2_a=rnd(10, 2, seed=8), w2_b=rnd(2, 12, seed=9), alpha=a),
             "own", 0),
    "full": (lambda a: U.Full(rnd(OUT, IN, seed=10), a), "own", 0),
    "dora_out": (lambda a: U.DoRA(_lora(a, 11), rnd(OUT, seed=13).abs() + 1), "inner", 2),
    "dora_in": (lambda a: U.DoRA(_lora(a, 11), rnd(1, IN, seed=14).abs() + 1), "baked", 0),
    "sliced": (lambda a: U.Sliced([(0, 20, _lora(a, 15, 20)), (20, 40, _lora(None, 17, 20))], OUT), "parts", 0),
    "bias_only": (lambda a: U.BiasOnly(rnd(OUT, seed=19)), "own", 0),
}

CASES = list(itertools.product(TYPES, ["exact", "lossless", None], [1.0, 0.7], [1.0, 0.6], [None, 4.0]))


def _nonunit(*fs):
    return sum(1 for f in fs if f != 1.0)


def _expected(kind, v, tier, strength, rs):
    _, own, structural = TYPES[kind]
    scales = ([] if own in ("baked", None) and kind != "lora" else
              [p.scale for _, _, p in v.parts] if own == "parts" else
              [v.inner.scale] if own == "inner" else [v.scale])
    if kind == "lora":
        return _nonunit(v.scale, strength, rs) if tier in ("exact", None) else 0
    if tier in ("exact", None):
        return structural + sum(_nonunit(s) for s in scales) + _nonunit(strength, rs)
    f = strength * rs
    if own == "own" and kind not in ("full", "bias_only"):
        return structural + _nonunit(v.scale * f)
    if own == "parts":  # every part a plain pair: the segmented plan's addmm_ alpha per part
        return structural
    if own == "inner":
        return structural + sum(_nonunit(s) for s in scales) + _nonunit(f)
    return structural + _nonunit(f)


@pytest.mark.parametrize("kind,tier,strength,rs,alpha", CASES)
def test_mul_count_per_type_and_tier(kind, tier, strength, rs, alpha):
    torch.manual_seed(0)
    lin = torch.nn.Linear(IN, OUT)
    v = TYPES[kind][0](alpha)
    v.check_module(OUT, IN)
    w = AdaptedLayer(lin, "l")
    w.add_adapter("a", LayerAdapter("l", update=v), strength)
    x = torch.randn(5, IN)
    ctx = runtime_context(tier=tier, scale=rs) if tier else runtime_context(scale=rs)
    with ctx, torch.no_grad():
        y = w(x)  # warm the caches (stacked weights, dense deltas, DoRA norms)
        with MulCounter() as c:
            w(x)
    assert not torch.equal(y, lin(x))  # the update is there
    assert c.muls == _expected(kind, v, tier, strength, rs), (kind, tier, strength, rs, alpha, c.muls)
