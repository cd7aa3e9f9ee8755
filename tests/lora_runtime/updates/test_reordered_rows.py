"""Updates on a layer whose rows the model stores in the other half order (diffusers' Flux
``norm_out.linear`` is [scale, shift], ComfyUI's ``final_layer.adaLN_modulation.1`` is
[shift, scale]): LoHa, LoKr and DoRA (per-row and per-column magnitude, around LoRA / LoHa /
LoKr) are applied as the file's layer would be, then its rows exchanged.

The maths (`DoRA.swapped_halves`): DoRA(P·W) must be P·DoRA(W). Per-row norms follow their
rows (the magnitude is swapped with them); per-column norms sum over all rows, so the magnitude
stays. References: (1) by hand in fp64 from the factors, in the file's row order, then swapped
(tolerances below say why); (2) the library's own un-reordered update on the weight in the
file's order, then swapped: the exact tier promises those bits (torch.equal). Wrong answers:
the base layer, and the rows left in the file's order. Where the maths does not allow it (a
LoKr whose w1 has an odd row count > 1) the error names the file, the key and why, and no
weight is left modified. Files built here at test time."""
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from comfyui_lora_runtime.lora_runtime import (AdapterMatchError, AdapterSpec, applied, load_adapter, match_adapter,
                                               plan)
from comfyui_lora_runtime.lora_runtime.updates import DoRA, LoHa, LoKr, LoRA

from testkit.dialect_models import TinyFlux

EPS = torch.finfo(torch.float32).eps   # the DoRA eps the loader uses (docs/engine.md)
NATIVE = "final_layer.adaLN_modulation.1"


def swap(t):
    n = t.shape[0] // 2
    return torch.cat([t[n:], t[:n]])


def _g(seed):
    return torch.Generator().manual_seed(seed)


# --- the update types on their own ---------------------------------------------------------


def _inners(out_f, in_f, g):
    """(name, update, dense delta float64 in the file's row order)."""
    down, up = torch.randn(2, in_f, generator=g) * 0.2, torch.randn(out_f, 2, generator=g) * 0.2
    lora = LoRA(down, up, 1.0)
    h = [torch.randn(*s, generator=g) * 0.3 for s in ((out_f, 2), (2, in_f), (out_f, 2), (2, in_f))]
    loha = LoHa(*h, alpha=1.0)
    loha_d = 0.5 * (h[0].double() @ h[1].double()) * (h[2].double() @ h[3].double())
    a, c = 8, out_f // 8
    w1, w2a, w2b = torch.randn(a, 4, generator=g), torch.randn(c, 2, generator=g) * .3, torch.randn(2, in_f // 4, generator=g)
    lokr = LoKr(w1=w1, w2_a=w2a, w2_b=w2b, alpha=1.0)
    lokr_d = 0.5 * torch.kron(w1.double(), w2a.double() @ w2b.double())
    return [("LoRA", lora, 0.5 * up.double() @ down.double()), ("LoHa", loha, loha_d), ("LoKr", lokr, lokr_d)]


def _dora_ref(w_file, dw, m, axis):
    """DoRA's W' - W in fp64 from the weight and inner delta in the file's row order."""
    v = w_file.double() + dw
    if axis == "out":
        return m.double().reshape(-1, 1) * v / (v.norm(dim=1, keepdim=True) + EPS) - w_file.double()
    return v * m.double().reshape(1, -1) / (v.norm(dim=0, keepdim=True) + EPS) - w_file.double()


@pytest.mark.parametrize("axis", ["out", "in"])
def test_swapped_updates_are_the_file_rows_exchanged_bit_for_bit(axis):
    g = _g(0)
    out_f, in_f = 64, 32
    w_file = torch.randn(out_f, in_f, generator=g)
    w_native = swap(w_file)
    x = torch.randn(5, in_f, generator=g)
    for name, inner, dense in _inners(out_f, in_f, g):
        s = inner.swapped_halves()
        assert torch.equal(s.delta(), swap(inner.delta())), name
        assert torch.allclose(s.delta().double(), swap(dense), rtol=1e-5, atol=1e-6), name  # fp32 products
        assert torch.equal(s.forward(x), inner.forward(x)[:, swap(torch.arange(out_f))]), name
        m = torch.rand(out_f if axis == "out" else in_f, generator=g) + 0.5
        m = m if axis == "out" else m.reshape(1, -1)
        d = DoRA(inner, m)
        ds = d.swapped_halves()
        assert ds.axis == axis
        want = swap(d.delta(weight=w_file))
        assert torch.equal(ds.delta(weight=w_native), want), (name, axis)    # the un-reordered bits
        ref = swap(_dora_ref(w_file, dense, m, axis))
        # fp32 norms and products of O(1) values: a few ulps
        assert (ds.delta(weight=w_native).double() - ref).abs().max().item() < 2e-5, (name, axis)
        wrong = _dora_ref(w_native, dense, m, axis)   # rows left in the file's order
        assert (wrong - ref).abs().max().item() > 1e-3, (name, axis)   # 50x the tolerance above
        assert torch.equal(ds.forward(x, weight=w_native), d.forward(x, weight=w_file)[:, swap(torch.arange(out_f))])
        assert torch.equal(ds.swapped_halves().delta(weight=w_file), d.delta(weight=w_file))   # twice: back


def test_per_column_norms_are_summed_in_the_file_row_order():
    """A column norm sums over every row: the same maths in any order, but other bits in another
    order (on some shapes and machines). The swapped DoRA reads the rows in the file's order, so
    its sums are the un-reordered ones, bit for bit."""
    g = _g(3)
    w_file = torch.randn(384, 192, generator=g)
    inner = LoRA(torch.randn(4, 192, generator=g) * .1, torch.randn(384, 4, generator=g) * .1, 2.0)
    d = DoRA(inner, torch.rand(1, 192, generator=g) + .5)
    ds = d.swapped_halves()
    seen = []
    real = ds.inner._delta

    def spy(device, ct, rows, weight):
        seen.append(rows if isinstance(rows, torch.Tensor) else torch.arange(384)[rows])
        return real(device, ct, rows, weight)

    ds.inner._delta = spy
    ds.norm_of(swap(w_file))
    assert torch.equal(torch.cat(seen), swap(torch.arange(384)))   # native rows, in the file's order
    assert torch.equal(ds.delta(weight=swap(w_file)), swap(d.delta(weight=w_file)))


def test_lokr_reorders_by_w1_when_even_and_by_w2_when_w1_has_one_row_and_cp_loha_by_columns():
    g = _g(1)
    even = LoKr(w1=torch.randn(4, 2, generator=g), w2=torch.randn(6, 3, generator=g))
    one = LoKr(w1=torch.randn(1, 2, generator=g), w2_a=torch.randn(24, 2, generator=g), w2_b=torch.randn(2, 3, generator=g))
    tucker = LoKr(w1=torch.randn(1, 2, generator=g), w2_a=torch.randn(2, 24, generator=g),
                  w2_b=torch.randn(3, 3, generator=g), t2=torch.randn(2, 3, generator=g))
    cp = LoHa(torch.randn(2, 24, generator=g), torch.randn(3, 5, generator=g), torch.randn(2, 24, generator=g),
              torch.randn(3, 5, generator=g), 1.0, t1=torch.randn(2, 3, generator=g), t2=torch.randn(2, 3, generator=g))
    for u in (even, one, tucker, cp):
        assert torch.equal(u.swapped_halves().delta(), swap(u.delta()))
        assert not torch.equal(u.swapped_halves().delta(), u.delta())
    odd = LoKr(w1=torch.randn(3, 2, generator=g), w2=torch.randn(8, 3, generator=g))
    assert odd.swapped_halves() is None and DoRA(odd, torch.ones(24)).swapped_halves() is None
    assert "odd number of rows (3, > 1)" in odd.why_not_swapped()
    assert DoRA(odd, torch.ones(24)).why_not_swapped().startswith("DoRA around a LoKr update whose w1")


# --- through the loader, on the Flux layer ---------------------------------------------------


def _dora_file(path, kind, axis, out_f, in_f, seed, stem_style="lycoris", lokr_rows=8):
    """A one-layer DoRA file on diffusers' norm_out.linear; returns the magnitude and the inner's
    dense delta (float64, file row order)."""
    g = _g(seed)
    stem = "transformer.norm_out.linear" if stem_style == "peft" else "lycoris_norm_out_linear"
    t = {}
    if kind == "LoRA":
        down, up = torch.randn(4, in_f, generator=g) * 0.1, torch.randn(out_f, 4, generator=g) * 0.1
        if stem_style == "peft":
            t.update({f"{stem}.lora_A.weight": down, f"{stem}.lora_B.weight": up})
            dense = up.double() @ down.double()
        else:
            t.update({f"{stem}.lora_down.weight": down, f"{stem}.lora_up.weight": up, f"{stem}.alpha": torch.tensor(2.0)})
            dense = 0.5 * up.double() @ down.double()
    elif kind == "LoHa":
        h = [torch.randn(*s, generator=g) * 0.3 for s in ((out_f, 2), (2, in_f), (out_f, 2), (2, in_f))]
        t.update({f"{stem}.hada_w1_a": h[0], f"{stem}.hada_w1_b": h[1], f"{stem}.hada_w2_a": h[2],
                  f"{stem}.hada_w2_b": h[3], f"{stem}.alpha": torch.tensor(1.0)})
        dense = 0.5 * (h[0].double() @ h[1].double()) * (h[2].double() @ h[3].double())
    else:   # LoKr: w1 [a, 4]
        a = lokr_rows
        w1 = torch.randn(a, 4, generator=g)
        w2 = torch.randn(out_f // a, in_f // 4, generator=g) * 0.05
        t.update({f"{stem}.lokr_w1": w1, f"{stem}.lokr_w2": w2})
        dense = torch.kron(w1.double(), w2.double())
    m = torch.rand(out_f if axis == "out" else in_f, generator=g) + 0.5
    if stem_style == "peft":
        t[f"{stem}.lora_magnitude_vector"] = m
    else:
        t[f"{stem}.dora_scale"] = m.reshape(-1, 1) if axis == "out" else m.reshape(1, -1)
    save_file(t, str(path))
    return m, dense


CASES = [("LoRA", "out", "peft"), ("LoRA", "in", "lycoris"), ("LoKr", "out", "lycoris"), ("LoHa", "in", "lycoris"),
         ("LoKr", "in", "lycoris"), ("LoHa", "out", "lycoris")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,axis,style", CASES)
def test_dora_on_flux_norm_out_applies_as_on_the_file_layer(tmp_path, kind, axis, style, dtype):
    model = TinyFlux().to(dtype)
    mod = model.get_submodule(NATIVE)
    out_f, in_f = mod.weight.shape
    path = tmp_path / "dora.safetensors"
    m, dense = _dora_file(path, kind, axis, out_f, in_f, seed=5, stem_style=style)
    base_w, bias = mod.weight.detach().clone(), mod.bias.detach().clone()
    w_file = swap(base_w)                                   # the layer as the file was trained on
    file_update = next(iter(load_adapter(path).layers.values())).update   # the file's own order
    assert isinstance(file_update, DoRA) and file_update.axis == axis
    ref = swap(_dora_ref(w_file.float(), dense, m, axis))   # fp64 maths, then the rows swapped
    wrong = _dora_ref(base_w.float(), dense, m, axis)       # rows left in the file's order
    assert (wrong - ref).abs().max().item() > 1e-3          # far above the tolerances below

    layers, cov = match_adapter(load_adapter(path), model)
    assert list(layers) == [NATIVE] and cov.unmatched == {} and cov.kinds == {"dora": 1}

    # merge, exact: round(W + P·DoRA_file(P·W)) bit for bit, and close to the fp64 maths
    with torch.no_grad(), applied(model, plan(model, [AdapterSpec(str(path))], "merge", "exact"), fusion_backend=None):
        merged = mod.weight.detach().clone()
    assert torch.equal(mod.weight, base_w)                  # restored bit for bit
    frozen = file_update.delta(weight=w_file)
    assert torch.equal(merged, torch.add(base_w, swap(frozen)).to(dtype))
    ulp = torch.finfo(dtype).eps * base_w.float().abs().max().item()
    assert (merged.double() - base_w.double() - ref).abs().max().item() <= 2 * ulp + 1e-4 * ref.abs().max().item()
    assert not torch.equal(merged, base_w)

    # dynamic, exact: x W^T + b + P·(the file layer's DoRA output delta), bit for bit
    x = torch.randn(4, in_f, generator=_g(9)).to(dtype)
    with torch.no_grad(), applied(model, plan(model, [AdapterSpec(str(path))], "dynamic", "exact"),
                                  fusion_backend=None):
        y = mod(x)
        y_file = file_update.forward(x, 1.0, weight=w_file, include_bias=False)
        assert torch.equal(y, F.linear(x, base_w, bias) + y_file[:, swap(torch.arange(out_f))])
    with torch.no_grad(), applied(model, plan(model, [AdapterSpec(str(path))], "dynamic", "lossless"),
                                  fusion_backend=None):
        y_lossless = mod(x)
    y0 = F.linear(x, base_w, bias).double()
    want = x.double() @ ref.T
    for got in (y, y_lossless):   # fp32: a few ulps of O(1) outputs; bf16: the layer's own rounding
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert ((got.double() - y0 - want).norm() / want.norm()).item() < tol
        assert ((got.double() - y0).norm() / want.norm()).item() > 0.5
    assert torch.equal(mod.weight, base_w)


@pytest.mark.parametrize("mode", ["merge", "dynamic", "auto"])
def test_dora_around_an_unreorderable_lokr_is_refused_saying_why(tmp_path, mode):
    model = TinyFlux(hidden=24, heads=2)                   # norm_out: 48 rows = 3 x 16
    mod = model.get_submodule(NATIVE)
    path = tmp_path / "odd.safetensors"
    _dora_file(path, "LoKr", "out", *mod.weight.shape, seed=2, lokr_rows=3)
    snap = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(AdapterMatchError, match=r"odd\.safetensors.*lycoris_norm_out_linear \(the model stores this "
                                                r"\[scale, shift\] layer's rows in the other order, and DoRA around a "
                                                r"LoKr update whose w1 has an odd number of rows \(3, > 1\)"):
        with applied(model, plan(model, [AdapterSpec(str(path))], mode, "exact"), fusion_backend=None):
            pass
    for k, v in model.state_dict().items():
        assert torch.equal(v, snap[k]), k
