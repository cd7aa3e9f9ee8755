"""One shrink GEMM for sibling projections (q/k/v), and one for the row slices of a fused weight.

Sharing: after the first call teaches a group which members read the same input, the first
member computes every partner's h; the values are the lossless contract against fp64 (the
exact path is the reference), never the base output, and a partner takes its columns only for
the very same, unchanged input tensor in the same context with the same A (each guard is
tested against the stale answer it prevents). `exact` never shares. A rerun (a fresh apply, as
each sampling does) gives the same bits. Sliced updates run one shrink GEMM and a per-slice
addmm_ in lossless/high, within the same contract."""
import gc

import pytest
import torch
from torch import nn

from comfyui_lora_runtime.lora_runtime import AdapterSpec, LoraInjector, AdaptedLayer, plan, runtime_context
from comfyui_lora_runtime.lora_runtime import updates as U
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
from comfyui_lora_runtime.lora_runtime.layer.shared_shrink import group_siblings

from testkit.fixtures import TinyWanLike, assert_lossless, lora_pair, make_adapter_tensors, write_kohya

D = 32


class QKV(nn.Module):
    """q/k/v reading one input; with `cross`, k and v read a second one (Wan cross-attention)."""

    def __init__(self, dtype, cross=False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.q, self.k, self.v = (nn.Linear(D, 24) for _ in range(3))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / 4)
        self.to(dtype)
        self.cross = cross

    def forward(self, x, c=None):
        c = x if not self.cross else c
        return self.q(x), self.k(c), self.v(c)


def _wrapped(dtype, cross=False, ranks=(4, 6, 8)):
    m = QKV(dtype, cross)
    ws = {}
    for i, (name, r) in enumerate(zip("qkv", ranks)):
        w = AdaptedLayer(getattr(m, name), name)
        w.attach()
        down, up = lora_pair(24, D, r, seed=10 + i, scale=0.3, dtype=dtype)
        w.add_adapter("a", LayerAdapter(name, down, up, alpha=float(r) / 2), 0.8)
        ws[name] = w
    return m, ws


def _inputs(dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    # 256 rows: enough elements that the contract's max-error ratio is not one element's luck
    return torch.randn(4, 64, D, generator=g).to(dtype), torch.randn(4, 16, D, generator=g).to(dtype)


def _truth(m, ws, x, c):
    """fp64 truth per projection: x W^T + b + (x A^T) B^T * a/r * strength."""
    out = []
    for name, inp in zip("qkv", (x, c, c)):
        lin, s = getattr(m, name), ws[name].slots["a"]
        a, b, scale = s.update.stack()
        xd = inp.double()
        out.append(xd @ lin.weight.double().T + lin.bias.double() + (xd @ a.double().T) @ b.double().T * scale * 0.8)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tier", ["lossless", "high"])
def test_siblings_share_one_shrink_gemm_within_the_lossless_contract(dtype, tier):
    m, ws = _wrapped(dtype)
    (g,) = group_siblings(ws)
    x, _ = _inputs(dtype)
    with torch.no_grad():
        base = [torch.nn.functional.linear(x, ws[n].weight, ws[n].bias) for n in "qkv"]
        with runtime_context(tier="exact"):
            ref = m(x)
        with runtime_context(tier=tier):
            first = m(x)  # learns: k and v read q's input
            assert g.shared == 0 and g.partners == [{0, 1, 2}] * 3
            got = m(x)
            assert g.shared == 2  # k and v took their columns from q's GEMM
    truth = _truth(m, ws, x, x)
    for name, o, r, t, b in zip("qkv", got, ref, truth, base):
        assert_lossless(o, r, t, name)
        assert not torch.equal(o, b)  # the adapter is there
    for o, f in zip(got, first):  # same maths as the unshared first call
        torch.testing.assert_close(o, f, rtol=0, atol=1e-5 if dtype == torch.float32 else 0.02)


def test_exact_never_shares_and_keeps_its_bits():
    m, ws = _wrapped(torch.bfloat16)
    (g,) = group_siblings(ws)
    x, _ = _inputs(torch.bfloat16)
    with torch.no_grad(), runtime_context(tier="exact"):
        outs = [m(x) for _ in range(3)]
    assert g.shared == 0
    for o in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(o, outs[0]))


def test_cross_attention_learns_that_only_k_and_v_share():
    m, ws = _wrapped(torch.float32, cross=True)
    (g,) = group_siblings(ws)
    x, c = _inputs(torch.float32)
    with torch.no_grad(), runtime_context(tier="lossless"):
        m(x, c)
        got = m(x, c)
        with runtime_context(tier="exact"):
            ref = m(x, c)
    idx = {n: g.names.index(n) for n in "qkv"}  # members are kept in name order
    assert g.partners[idx["q"]] == {idx["q"]}
    assert g.partners[idx["k"]] == g.partners[idx["v"]] == {idx["k"], idx["v"]}
    assert g.shared == 1  # v from k's GEMM; q alone (nothing computed for k and v on x)
    for name, o, r, t in zip("qkv", got, ref, _truth(m, ws, x, c)):
        assert_lossless(o, r, t, name)


def _first_then(m, ws, between):
    """q on x (computes k's and v's columns too), then `between(x)` gives k's and v's input."""
    x, _ = _inputs(torch.float32)
    with torch.no_grad(), runtime_context(tier="lossless"):
        m(x)  # learn
        q = m.q(x)
        x2 = between(x)
        return x2, q, m.k(x2), m.v(x2)


def _expected_kv(m, ws, x2):
    with torch.no_grad(), runtime_context(tier="exact"):
        return m.k(x2), m.v(x2)


def _check_fresh(m, ws, x2, k, v, stale_from):
    ek, ev = _expected_kv(m, ws, x2)
    sk, sv = _expected_kv(m, ws, stale_from)
    for got, want, stale in ((k, ek, sk), (v, ev, sv)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert (got - stale).abs().max() > 1e-3  # what a stale h would have given


def test_an_equal_but_different_tensor_is_not_served_from_the_entry():
    m, ws = _wrapped(torch.float32)
    (g,) = group_siblings(ws)
    x2, q, k, v = _first_then(m, ws, lambda x: (x * 1.5).clone())
    assert g.shared == 1  # k missed q's entry and computed its own partners' columns: v took them
    _check_fresh(m, ws, x2, k, v, _inputs(torch.float32)[0])


def test_an_input_changed_in_place_is_recomputed():
    m, ws = _wrapped(torch.float32)
    (g,) = group_siblings(ws)
    x0 = _inputs(torch.float32)[0].clone()

    def change(x):
        x.mul_(-2.0)  # same object, new version
        return x
    x2, q, k, v = _first_then(m, ws, change)
    assert g.shared == 1  # k missed q's entry (new version): k's GEMM served v
    _check_fresh(m, ws, x2, k, v, x0)


def test_a_freed_input_never_matches_a_new_one():
    m, ws = _wrapped(torch.float32)
    (g,) = group_siblings(ws)
    with torch.no_grad(), runtime_context(tier="lossless"):
        x = _inputs(torch.float32)[0]
        m(x)
        m.q(x)
        del x
        gc.collect()
        x2 = _inputs(torch.float32, seed=7)[0]
        k = m.k(x2)
    with torch.no_grad(), runtime_context(tier="exact"):
        want = m.k(x2)
    torch.testing.assert_close(k, want, rtol=0, atol=1e-5)


def test_a_strength_change_between_siblings_uses_the_new_a():
    m, ws = _wrapped(torch.float32)
    (g,) = group_siblings(ws)
    x = _inputs(torch.float32)[0]
    with torch.no_grad(), runtime_context(tier="lossless"):
        m(x)
        m.q(x)
        ws["k"].set_strength("a", -0.5)  # k's plan and stacked A change: the group forgets
        k = m.k(x)
    with torch.no_grad(), runtime_context(tier="exact"):
        want = m.k(x)
        ws["k"].set_strength("a", 0.8)
        old = m.k(x)
    torch.testing.assert_close(k, want, rtol=0, atol=1e-5)
    assert (k - old).abs().max() > 1e-3


def test_inference_mode_inputs_share_and_stay_correct():
    """Inference tensors keep no version counter; identity still guards."""
    m, ws = _wrapped(torch.bfloat16)
    (g,) = group_siblings(ws)
    x, _ = _inputs(torch.bfloat16)
    with torch.inference_mode(), runtime_context(tier="lossless"):
        xi = x.clone()
        m(xi)
        got = m(xi)
        other = m(xi * 2)
    assert g.shared == 4
    with torch.no_grad(), runtime_context(tier="exact"):
        ref, ref2 = m(x), m(x * 2)
    for a, b, t in zip(got, ref, _truth(m, ws, x, x)):
        assert_lossless(a, b, t)
    for a, b, t in zip(other, ref2, _truth(m, ws, x * 2, x * 2)):
        assert_lossless(a, b, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rerun_after_a_fresh_apply_gives_the_same_bits(tmp_path, dtype):
    """Each sampling applies afresh: the first call learns again, so reruns are bit-identical
    (and the groups are the model's q/k/v of each attention)."""
    m = TinyWanLike(dtype=dtype)
    f = write_kohya(tmp_path / "a.safetensors", make_adapter_tensors(m, dtype=dtype), alpha=2)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    runs = []
    for _ in range(2):
        inj = LoraInjector(m)
        inj.apply(plan(m, [AdapterSpec(str(f), 0.8)], "dynamic", "lossless"))
        assert sorted(g.names for g in inj.sibling_groups)[0] == (
            "blocks.0.cross_attn.k", "blocks.0.cross_attn.q", "blocks.0.cross_attn.v")
        assert len(inj.sibling_groups) == 4
        with torch.no_grad(), runtime_context(tier="lossless"):
            runs.append([m(x) for _ in range(3)])
        assert sum(g.shared for g in inj.sibling_groups) == 4 * 2 * 2
        inj.clear()
        assert inj.sibling_groups == []
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# --- sliced updates: one shrink GEMM, per-slice addmm_ -------------------------------------
def _sliced_layer(dtype, extra=False):
    torch.manual_seed(0)
    lin = nn.Linear(D, 60).to(dtype)
    g = torch.Generator().manual_seed(5)

    def lora(out, r, alpha):
        return U.LoRA((torch.randn(r, D, generator=g) * 0.3).to(dtype),
                      (torch.randn(out, r, generator=g) * 0.3).to(dtype), alpha)
    parts = [(0, 20, lora(20, 4, 2.0)), (20, 40, lora(20, 8, None)), (44, 60, lora(16, 2, 1.0))]
    v = U.Sliced(parts, 60)
    v.check_module(60, D)
    w = AdaptedLayer(lin, "l")
    w.add_adapter("s", LayerAdapter("l", update=v), 0.7)
    if extra:
        down, up = lora_pair(60, D, 4, seed=9, scale=0.3, dtype=dtype)
        w.add_adapter("p", LayerAdapter("l", down, up, alpha=3.0), -0.4)
    return w, lin, v


def _sliced_truth(w, lin, v, x, rs):
    xd = x.double()
    y = xd @ lin.weight.double().T + lin.bias.double()
    d = torch.zeros_like(y)
    for lo, hi, p in v.parts:
        a, b, scale = p.stack()
        d[..., lo:hi] += (xd @ a.double().T) @ b.double().T * scale * 0.7
    if "p" in w.slots:
        a, b, scale = w.slots["p"].update.stack()
        d += (xd @ a.double().T) @ b.double().T * scale * -0.4
    return y + d * rs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("rs", [1.0, 0.6])
def test_sliced_update_runs_one_shrink_gemm_within_the_lossless_contract(dtype, extra, rs):
    w, lin, v = _sliced_layer(dtype, extra)
    x = torch.randn(3, 9, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        with runtime_context(tier="exact", scale=rs):
            ref = w(x)
        with runtime_context(tier="lossless", scale=rs):
            got = w(x)
            assert "_segmented" in w._last_plan.run.__qualname__
            assert torch.equal(w(x), got)
    assert_lossless(got, ref, _sliced_truth(w, lin, v, x, rs))
    base = lin(x)
    assert not torch.equal(got[..., 40:44], base[..., 40:44]) is extra  # rows no slice covers
    assert not torch.equal(got[..., :40], base[..., :40])
