"""Update types (lora_runtime/updates/) against fp64 references written here.

Every numeric check also shows that the reference tells the right answer from a
wrong one: the variant misread (as plain LoRA, kron in the wrong order, the wrong
DoRA norm, alpha ignored) or the adapter off must miss the reference by far more than
the tolerance.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from comfyui_lora_runtime.lora_runtime import updates as V
from comfyui_lora_runtime.lora_runtime.updates import dora as dora_module
from comfyui_lora_runtime.lora_runtime.errors import AdapterFormatError
from comfyui_lora_runtime.lora_runtime.updates import (DoRA, Full, BiasOnly, LoHa, LoKr, LoRA, Update,
                                                        detect)

D64 = torch.float64
EPS32 = torch.finfo(torch.float32).eps
DELTA_TOL = 1e-6   # delta() in fp32 vs the fp64 formula
FWD_TOL = 1e-5     # forward in fp32 vs F.linear(x, dense delta) in fp64


def rnd(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=D64) * scale).float()


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def check(got, ref, tol, wrongs=()):
    """got matches ref within tol, and every wrong answer misses it by > max(1e-2, 1000*tol)."""
    r = rel(got, ref)
    assert r <= tol, f"rel error {r:.3g} > {tol:g}"
    for name, w in wrongs:
        rw = rel(w, ref)
        assert rw > max(1e-2, 1000 * tol), f"the wrong answer '{name}' is too close ({rw:.3g}): the check is blind"


def x_in(n_in, seed=99):
    return rnd(3, 5, n_in, seed=seed)


def check_forward(v, ref_delta64, strengths=(1.0, 0.5), wrongs_delta=()):
    """forward(x, st) vs F.linear(x, st * dense ref) in fp64."""
    x = x_in(ref_delta64.shape[1])
    for st in strengths:
        got = v.forward(x, st)
        assert got.dtype == torch.float32 and got.shape == (3, 5, ref_delta64.shape[0])
        ref = F.linear(x.double(), ref_delta64 * st)
        wr = [(n, F.linear(x.double(), w.double() * st)) for n, w in wrongs_delta]
        check(got, ref, FWD_TOL, wr + [("adapter off", torch.zeros_like(ref))])


# --- LoRA -------------------------------------------------------------------------------
OUT, IN, R = 24, 20, 4


def lora_parts(names=("lora_down.weight", "lora_up.weight"), seed=0):
    down, up = rnd(R, IN, seed=seed, scale=0.3), rnd(OUT, R, seed=seed + 1, scale=0.3)
    return {names[0]: down, names[1]: up}, down, up


@pytest.mark.parametrize("names", [
    ("lora_down.weight", "lora_up.weight"), ("lora_A.weight", "lora_B.weight"),
    ("lora_A.default.weight", "lora_B.default.weight"), ("lora.down.weight", "lora.up.weight"),
    ("lora_linear_layer.down.weight", "lora_linear_layer.up.weight"), ("lora_A", "lora_B"), ("down", "up")])
def test_lora_key_names(names):
    parts, down, up = lora_parts(names)
    v = detect(parts, None, stem="blocks.0.q")
    assert isinstance(v, LoRA) and v.rank == R and (v.out_features, v.in_features) == (OUT, IN)


@pytest.mark.parametrize("alpha,scale", [(None, 1.0), (2.0, 2.0 / R), (8.0, 8.0 / R)])
def test_lora_scale_delta_forward(alpha, scale):
    parts, down, up = lora_parts()
    v = detect(parts, alpha, stem="l")
    assert v.scale == pytest.approx(scale, rel=1e-12)
    ref = (up.double() @ down.double()) * (1.0 if alpha is None else alpha / R)  # alpha / rows of down
    wrongs = [("adapter off", torch.zeros_like(ref))]
    if alpha is not None:
        wrongs.append(("alpha ignored", up.double() @ down.double()))
    got = v.delta("cpu")
    assert got.dtype == torch.float32 and got.shape == (OUT, IN)
    check(got, ref, DELTA_TOL, wrongs)
    check_forward(v, ref, wrongs_delta=wrongs[1:])
    # rows: a slice and an index tensor
    check(v.delta("cpu", rows=slice(5, 17)), ref[5:17], DELTA_TOL)
    idx = torch.tensor([23, 0, 7, 7, 12])
    check(v.delta("cpu", rows=idx), ref[idx], DELTA_TOL)
    assert v.delta("cpu", torch.float64).dtype == torch.float64


def test_lora_alpha_part_and_rslora():
    parts, down, up = lora_parts()
    parts["alpha"] = torch.tensor(6.0)
    assert detect(parts, stem="l").scale == pytest.approx(6.0 / R)
    assert detect(parts, 2.0, stem="l").scale == pytest.approx(2.0 / R)  # the argument wins
    assert detect(parts, stem="l", rslora=True).scale == pytest.approx(6.0 / R ** 0.5)


def test_lora_stack_nbytes_and_conv_1x1():
    parts, down, up = lora_parts()
    v = detect(parts, 4.0, stem="l")
    assert v.stack() is not None and v.nbytes == (down.numel() + up.numel()) * 4
    v2 = detect({"lora_down.weight": down[:, :, None, None], "lora_up.weight": up[:, :, None, None]}, 4.0)
    check(v2.delta(), v.delta().double(), 1e-7)
    a, b = v.factors("cpu", torch.float16)
    assert a.dtype == b.dtype == torch.float16 and a.shape == (R, IN)


# --- Full / diff_b --------------------------------------------------------------------------
def test_full_diff_and_bias_offset():
    diff, db = rnd(OUT, IN, seed=3), rnd(OUT, seed=4)
    v = detect({"diff": diff, "diff_b": db}, 5.0, stem="l")  # alpha is ignored by a full diff
    assert isinstance(v, Full) and v.scale == 1.0 and v.stack() is None
    check(v.delta(), diff.double(), DELTA_TOL, [("alpha applied", diff.double() * 5)])
    x = x_in(IN)
    for st in (1.0, 0.5):
        ref = F.linear(x.double(), diff.double() * st, db.double() * st)
        check(v.forward(x, st), ref, FWD_TOL, [("bias offset dropped", F.linear(x.double(), diff.double() * st))])
        check(v.forward(x, st, include_bias=False), F.linear(x.double(), diff.double() * st), FWD_TOL)
    check(v.bias_delta(), db.double(), 0.0)
    check(v.delta(rows=torch.tensor([3, 1])), diff.double()[[3, 1]], 0.0)


def test_bias_only_and_lora_with_diff_b():
    db = rnd(OUT, seed=5)
    b = detect({"diff_b": db}, stem="l")
    assert isinstance(b, BiasOnly) and not b.has_weight_delta and b.in_features is None
    with pytest.raises(AdapterFormatError, match="l: .*check_module"):
        b.delta()
    b.check_module(OUT, IN)
    assert b.delta(rows=slice(0, 3)).shape == (3, IN) and not b.delta().any()
    x = x_in(IN)
    check(b.forward(x, 0.5), (db.double() * 0.5).expand(3, 5, OUT), 1e-7)

    parts, down, up = lora_parts()
    parts["diff_b"] = db
    v = detect(parts, 2.0, stem="l")
    assert isinstance(v, LoRA) and v.stack() is not None and "diff_b" in v.tensors()
    ref = F.linear(x.double(), (up.double() @ down.double()) * (2.0 / R) * 0.7, db.double() * 0.7)
    check(v.forward(x, 0.7), ref, FWD_TOL)


# --- LoHa -----------------------------------------------------------------------------------
R1, R2 = 3, 2


def loha_parts(cp: bool, seed=10):
    if not cp:
        return {"hada_w1_a": rnd(OUT, R1, seed=seed, scale=0.5), "hada_w1_b": rnd(R1, IN, seed=seed + 1, scale=0.5),
                "hada_w2_a": rnd(OUT, R2, seed=seed + 2, scale=0.5), "hada_w2_b": rnd(R2, IN, seed=seed + 3, scale=0.5)}
    # CP: w_a [ra, out], t [ra, rb], w_b [rb, in]; ra == rb so "t ignored" is a comparable wrong answer
    return {"hada_w1_a": rnd(R1, OUT, seed=seed, scale=0.5), "hada_w1_b": rnd(R1, IN, seed=seed + 1, scale=0.5),
            "hada_t1": rnd(R1, R1, seed=seed + 4),
            "hada_w2_a": rnd(R2, OUT, seed=seed + 2, scale=0.5), "hada_w2_b": rnd(R2, IN, seed=seed + 3, scale=0.5),
            "hada_t2": rnd(R2, R2, seed=seed + 5)}


def loha_ref(p, alpha):
    d = {k: t.double() for k, t in p.items()}
    if "hada_t1" in d:  # rebuild[p, r] = sum_ij t[i, j] w_b[j, r] w_a[i, p]
        m1 = torch.einsum("ij,jr,ip->pr", d["hada_t1"], d["hada_w1_b"], d["hada_w1_a"])
        m2 = torch.einsum("ij,jr,ip->pr", d["hada_t2"], d["hada_w2_b"], d["hada_w2_a"])
    else:
        m1, m2 = d["hada_w1_a"] @ d["hada_w1_b"], d["hada_w2_a"] @ d["hada_w2_b"]
    scale = 1.0 if alpha is None else alpha / p["hada_w1_b"].shape[0]
    return m1 * m2 * scale


@pytest.mark.parametrize("cp", [False, True])
@pytest.mark.parametrize("alpha", [None, 1.5])
def test_loha(cp, alpha):
    p = loha_parts(cp)
    v = detect(p, alpha, stem="blk.ffn.0")
    assert isinstance(v, LoHa) and v.cp == cp and v.stack() is None
    assert v.scale == pytest.approx(1.0 if alpha is None else alpha / R1)
    assert (v.out_features, v.in_features) == (OUT, IN)
    ref = loha_ref(p, alpha)
    d = {k: t.double() for k, t in p.items()}
    s = v.scale
    if cp:
        misread = (d["hada_w1_a"].t() @ d["hada_w1_b"]) * (d["hada_w2_a"].t() @ d["hada_w2_b"]) * s
        wrongs = [("CP core ignored", misread)]
    else:
        wrongs = [("read as LoRA up=w1_a down=w1_b", d["hada_w1_a"] @ d["hada_w1_b"] * s),
                  ("read as the sum of two LoRAs", (d["hada_w1_a"] @ d["hada_w1_b"] + d["hada_w2_a"] @ d["hada_w2_b"]) * s)]
    check(v.delta(), ref, DELTA_TOL, wrongs + [("adapter off", torch.zeros_like(ref))])
    check(v.delta(rows=slice(2, 19)), ref[2:19], DELTA_TOL)
    idx = torch.tensor([0, 23, 11])
    check(v.delta(rows=idx), ref[idx], DELTA_TOL)
    check_forward(v, ref, wrongs_delta=wrongs)
    assert v.cached_nbytes() >= OUT * IN * 4  # the documented dense cache
    v.clear_cache()
    assert v.cached_nbytes() == 0


# --- LoKr ------------------------------------------------------------------------------------
A, B, C, D = 4, 5, 6, 4   # w1 [A, B], w2 [C, D]: out = 24, in = 20
RK1, RK2 = 3, 2


def lokr_parts(w1: str, w2: str, seed=20):
    p = {}
    if w1 == "full":
        p["lokr_w1"] = rnd(A, B, seed=seed)
    else:
        p["lokr_w1_a"], p["lokr_w1_b"] = rnd(A, RK1, seed=seed), rnd(RK1, B, seed=seed + 1)
    if w2 == "full":
        p["lokr_w2"] = rnd(C, D, seed=seed + 2, scale=0.3)
    elif w2 == "fact":
        p["lokr_w2_a"], p["lokr_w2_b"] = rnd(C, RK2, seed=seed + 2, scale=0.3), rnd(RK2, D, seed=seed + 3, scale=0.3)
    else:  # tucker: w2_a [ra, c], t2 [ra, rb], w2_b [rb, d]
        p["lokr_w2_a"], p["lokr_w2_b"] = rnd(RK2, C, seed=seed + 2, scale=0.3), rnd(RK2 + 1, D, seed=seed + 3, scale=0.3)
        p["lokr_t2"] = rnd(RK2, RK2 + 1, seed=seed + 4)
    return p


def lokr_ref(p, alpha):
    d = {k: t.double() for k, t in p.items()}
    w1 = d["lokr_w1"] if "lokr_w1" in d else d["lokr_w1_a"] @ d["lokr_w1_b"]
    if "lokr_w2" in d:
        w2 = d["lokr_w2"]
    elif "lokr_t2" in d:
        w2 = torch.einsum("ij,jr,ip->pr", d["lokr_t2"], d["lokr_w2_b"], d["lokr_w2_a"]).contiguous()  # kron needs it
    else:
        w2 = d["lokr_w2_a"] @ d["lokr_w2_b"]
    # ComfyUI's rule: dim from w1_b if w1 factorised, overridden by w2_b; alpha only with a factorised side
    dim = None
    if "lokr_w1_b" in d:
        dim = d["lokr_w1_b"].shape[0]
    if "lokr_w2_b" in d:
        dim = d["lokr_w2_b"].shape[0]
    scale = alpha / dim if (alpha is not None and dim is not None) else 1.0
    return w1, w2, scale


LOKR_CASES = [("full", "full"), ("fact", "full"), ("full", "fact"), ("fact", "fact"),
              ("full", "tucker"), ("fact", "tucker")]


@pytest.mark.parametrize("w1,w2", LOKR_CASES)
@pytest.mark.parametrize("alpha", [None, 3.0])
def test_lokr(w1, w2, alpha):
    p = lokr_parts(w1, w2)
    v = detect(p, alpha, stem="blk.attn.o")
    assert isinstance(v, LoKr) and v.stack() is None and (v.out_features, v.in_features) == (A * C, B * D)
    k1, k2, scale = lokr_ref(p, alpha)
    assert v.scale == pytest.approx(scale, rel=1e-12)
    ref = torch.kron(k1, k2) * scale
    # an element of the kron written out: W[p*C+q, j*D+k] = w1[p, j] w2[q, k]
    assert ref[2 * C + 5, 3 * D + 1].item() == pytest.approx((k1[2, 3] * k2[5, 1] * scale).item(), rel=1e-12)
    wrongs = [("kron in the other order", torch.kron(k2, k1) * scale), ("adapter off", torch.zeros_like(ref))]
    if scale != 1.0:
        wrongs.append(("alpha ignored", torch.kron(k1, k2)))
    check(v.delta(), ref, DELTA_TOL, wrongs)
    check(v.delta(rows=slice(3, 22)), ref[3:22], DELTA_TOL)
    idx = torch.tensor([23, 0, 6, 7, 13, 13])
    check(v.delta(rows=idx), ref[idx], DELTA_TOL)
    check_forward(v, ref, wrongs_delta=wrongs[:1])


def test_lokr_scale_rules():
    """LoKr alpha: ignored when both sides are full; w2_b's rank wins over w1_b's."""
    assert detect(lokr_parts("full", "full"), 7.0).scale == 1.0
    assert detect(lokr_parts("fact", "full"), 6.0).scale == pytest.approx(6.0 / RK1)
    assert detect(lokr_parts("full", "fact"), 6.0).scale == pytest.approx(6.0 / RK2)
    assert detect(lokr_parts("fact", "fact"), 6.0).scale == pytest.approx(6.0 / RK2)  # not / RK1
    assert detect(lokr_parts("full", "tucker"), 6.0).scale == pytest.approx(6.0 / (RK2 + 1))  # w2_b rows
    assert detect(lokr_parts("fact", "fact"), None).scale == 1.0


def test_lokr_forward_never_builds_the_dense_delta(monkeypatch):
    v = detect(lokr_parts("fact", "fact"), 3.0)
    monkeypatch.setattr(torch, "kron", lambda *a: (_ for _ in ()).throw(AssertionError("dense kron built")))
    v.forward(x_in(IN), 0.8)


def test_lokr_with_a_factorised_w2_worth_keeping_never_forms_the_dense_w2():
    """w2 = w2_a w2_b at rank 1 ([6, 8]): the forward and the trace form run the two thin GEMMs;
    the dense w2 is not built (nor cached), and the output is still kron(w1, w2) x."""
    w1, w2a, w2b = rnd(4, 2, seed=80), rnd(6, 1, seed=81), rnd(1, 8, seed=82)
    v = LoKr(w1=w1, w2_a=w2a, w2_b=w2b, alpha=None, stem="l")
    x = x_in(16)
    ref = F.linear(x.double(), torch.kron(w1.double(), w2a.double() @ w2b.double()) * 0.8)
    check(v.forward(x, 0.8), ref, FWD_TOL, [("w2 left out", F.linear(x.double(), torch.kron(w1.double(),
                                                                                          torch.ones(6, 8).double())))])
    assert v.trace_form("cpu", torch.float32)[0].kind == "kron2"
    assert not any(k[:2] == ("cast", "w2") for k in v._cache), "the dense w2 was formed"


# --- DoRA ------------------------------------------------------------------------------------
def dora_setup(seed=30):
    w = rnd(OUT, IN, seed=seed) / IN ** 0.5
    parts, down, up = lora_parts(("lora_A.weight", "lora_B.weight"), seed=seed + 1)
    return w, parts, down, up


def dora_ref(w, inner_delta, m, axis, quirk, eps=EPS32):
    """fp64 W' - W: W' = m * Wc / ||.||, Wc = W + s dW."""
    w, dw, m = w.double(), inner_delta.double(), m.double()
    wc = w + dw
    if axis == "out":
        n = (w if quirk else wc).norm(dim=1) + eps
        wp = wc * (m.reshape(-1) / n)[:, None]
    else:
        n = wc.norm(dim=0) + eps
        wp = wc * (m.reshape(-1) / n)[None, :]
    return wp - w


def magnitude(w, axis, seed):
    g = 1 + 0.2 * rnd(OUT if axis == "out" else IN, seed=seed)
    return (w.norm(dim=1) if axis == "out" else w.norm(dim=0)) * g


@pytest.mark.parametrize("layout", ["peft [out]", "lycoris [out,1]", "lycoris [1,in]"])
@pytest.mark.parametrize("quirk", [False, True])
@pytest.mark.parametrize("st", [1.0, 0.5])
def test_dora(layout, quirk, st, monkeypatch):
    monkeypatch.setattr(dora_module, "CHUNK_ELEMS", 7 * IN)  # norms from several row chunks
    w, parts, down, up = dora_setup()
    axis = "in" if "in]" in layout else "out"
    m = magnitude(w, axis, seed=40)
    key = "lora_magnitude_vector.default.weight" if layout.startswith("peft") else "dora_scale"
    parts[key] = {"peft [out]": m, "lycoris [out,1]": m[:, None], "lycoris [1,in]": m[None, :]}[layout]
    alpha = 2.0
    v = detect(parts, alpha, stem="blocks.3.self_attn.v", comfy_quirk=quirk)
    assert isinstance(v, DoRA) and v.axis == axis and v.stack() is None and v.needs_weight
    s = alpha / R
    assert v.scale == pytest.approx(s)
    lora = (up.double() @ down.double()) * s
    ref = dora_ref(w, lora, m, axis, quirk)            # W' - W (strength multiplies it)
    other = dora_ref(w, lora, m, axis, not quirk)      # the other norm convention
    wrongs = [("read as plain LoRA", lora), ("adapter off", torch.zeros_like(ref))]
    if axis == "out":  # the quirk only matters for the per-row norm
        wrongs.append(("the other norm (merged vs original W)", other))
    else:
        check(other, ref, 1e-12)
    check(v.delta(weight=w), ref, DELTA_TOL, wrongs)
    check(v.delta(weight=w, rows=slice(4, 15)), ref[4:15], DELTA_TOL)
    idx = torch.tensor([20, 1, 9])
    check(v.delta(weight=w, rows=idx), ref[idx], DELTA_TOL)

    x = x_in(IN)
    ref_y = F.linear(x.double(), ref * st)
    wrong_y = [(n, F.linear(x.double(), t * st)) for n, t in wrongs]
    y0 = F.linear(x, w)
    check(v.forward(x, st, y0, w), ref_y, FWD_TOL, wrong_y)
    check(v.forward(x, st, weight=w), ref_y, FWD_TOL)  # base output computed inside
    # the whole layer: W_final = W + st * (W' - W)
    full = F.linear(x.double(), w.double() + st * ref)
    check(y0 + v.forward(x, st, y0, w), full, FWD_TOL)
    if axis == "out":
        r = v.dora_row_scale(w, st)
        y_lora = F.linear(F.linear(x, down), up) * s
        check(r * y0 + (r - 1 + st) * y_lora, full, FWD_TOL)
    else:
        with pytest.raises(AdapterFormatError, match="blocks.3.self_attn.v"):
            v.dora_row_scale(w, st)


def test_dora_row_path_needs_no_dense_delta_per_call():
    w, parts, down, up = dora_setup()
    parts["dora_scale"] = magnitude(w, "out", seed=41)[:, None]
    v = detect(parts, 2.0, stem="l")
    x = x_in(IN)
    v.forward(x, 1.0, F.linear(x, w), w)
    dense = [k for k in v._cache if k[0] == "dense"] + [k for k in v.inner._cache if k[0] == "dense"]
    assert not dense
    g1 = v.magnitude_over_norm(w)
    assert v.magnitude_over_norm(w) is g1  # cached per base weight
    with torch.no_grad():
        w.add_(0.01)                      # an in-place change of the base weight invalidates it
    assert v.magnitude_over_norm(w) is not g1


@pytest.mark.parametrize("axis", ["out", "in"])
def test_dora_chunked_inplace_merge(axis, monkeypatch):
    """The documented merge recipe: norms first, then row chunks written in place."""
    monkeypatch.setattr(dora_module, "CHUNK_ELEMS", 5 * IN)
    w, parts, down, up = dora_setup(seed=50)
    m = magnitude(w, axis, seed=51)
    parts["dora_scale"] = m[:, None] if axis == "out" else m[None, :]
    v = detect(parts, 4.0, stem="l")
    st = 0.5
    ref = w.double() + st * dora_ref(w, (up.double() @ down.double()) * (4.0 / R), m, axis, False)
    merged = w.clone()
    norm = v.norm_of(merged)
    for r0 in range(0, OUT, 5):
        rows = slice(r0, min(OUT, r0 + 5))
        merged[rows] += st * v.delta(weight=merged, rows=rows, norm=norm)
    check(merged, ref, DELTA_TOL, [("plain LoRA merge", w.double() + st * (up.double() @ down.double()))])


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_dora_on_loha_and_lokr(kind):
    w = rnd(OUT, IN, seed=60) / IN ** 0.5
    p = loha_parts(False) if kind == "loha" else lokr_parts("full", "fact")
    inner = detect(p, 1.5)
    ref_inner = loha_ref(p, 1.5) if kind == "loha" else (lambda a, b, s: torch.kron(a, b) * s)(*lokr_ref(p, 1.5))
    m = magnitude(w, "out", seed=61)
    v = detect({**p, "dora_scale": m[:, None]}, 1.5, stem="l")
    assert isinstance(v, DoRA) and type(v.inner) is type(inner)
    ref = dora_ref(w, ref_inner, m, "out", False)
    check(v.delta(weight=w), ref, DELTA_TOL, [("no DoRA", ref_inner)])
    x = x_in(IN)
    check(v.forward(x, 0.5, F.linear(x, w), w), F.linear(x.double(), ref * 0.5), FWD_TOL,
          [("no DoRA", F.linear(x.double(), ref_inner * 0.5))])


def test_dora_eps_zero_is_peft():
    w, parts, down, up = dora_setup()
    m = magnitude(w, "out", seed=42)
    parts["lora_magnitude_vector"] = m
    v = detect(parts, 2.0, eps=0.0)
    check(v.delta(weight=w), dora_ref(w, (up.double() @ down.double()) * 0.5, m, "out", False, eps=0.0), DELTA_TOL)


# --- detection and errors ------------------------------------------------------------------------
def test_from_keys_on_classes():
    parts, _, _ = lora_parts()
    assert isinstance(detect(parts, 1.0, stem="l", expect=Update), LoRA)
    assert isinstance(detect(parts, 1.0, stem="l", expect=LoRA), LoRA)
    with pytest.raises(AdapterFormatError, match="describe a LoRA, not a LoHa"):
        detect(parts, 1.0, stem="l", expect=LoHa)


def test_nbytes_and_stack_per_type():
    lo = detect(loha_parts(True), 1.0)
    assert lo.stack() is None and lo.nbytes == sum(t.numel() * 4 for t in loha_parts(True).values())
    kr = detect(lokr_parts("fact", "tucker"), 1.0)
    assert kr.stack() is None and kr.nbytes == sum(t.numel() * 4 for t in lokr_parts("fact", "tucker").values())
    assert detect({"diff": rnd(3, 2, seed=0)}).stack() is None


def test_check_module_names_the_stem():
    v = detect(lora_parts()[0], 1.0, stem="blocks.7.ffn.2")
    v.check_module(OUT, IN)
    with pytest.raises(AdapterFormatError, match=r"blocks\.7\.ffn\.2: .*\[24, 20\].*\[24, 32\]"):
        v.check_module(OUT, 32)
    k = detect(lokr_parts("full", "full"), None, stem="k.stem")
    with pytest.raises(AdapterFormatError, match="k.stem"):
        k.check_module(20, 24)


@pytest.mark.parametrize("parts,match", [
    ({"lora_down.weight": rnd(4, 20, seed=0), "lora_up.weight": rnd(24, 3, seed=1)}, "rank"),
    ({"hada_w1_a": rnd(24, 3, seed=0), "hada_w1_b": rnd(2, 20, seed=1),
      "hada_w2_a": rnd(24, 2, seed=2), "hada_w2_b": rnd(2, 20, seed=3)}, "hada_w1_a"),
    ({"hada_w1_a": rnd(24, 3, seed=0), "hada_w1_b": rnd(3, 20, seed=1),
      "hada_w2_a": rnd(22, 2, seed=2), "hada_w2_b": rnd(2, 20, seed=3)}, "Hadamard factors differ"),
    ({"hada_w1_a": rnd(3, 24, seed=0), "hada_w1_b": rnd(3, 20, seed=1), "hada_t1": rnd(2, 3, seed=4),
      "hada_w2_a": rnd(2, 24, seed=2), "hada_w2_b": rnd(2, 20, seed=3), "hada_t2": rnd(2, 2, seed=5)}, "hada_t1"),
    ({"lokr_w1_a": rnd(4, 3, seed=0), "lokr_w1_b": rnd(2, 5, seed=1), "lokr_w2": rnd(6, 4, seed=2)}, "lokr_w1_a"),
    ({"lokr_w1": rnd(4, 5, seed=0), "lokr_w2_a": rnd(2, 6, seed=1), "lokr_w2_b": rnd(3, 4, seed=2),
      "lokr_t2": rnd(3, 3, seed=3)}, "lokr_t2"),
    ({"lokr_w1": rnd(4, 5, seed=0)}, "lokr_w2"),
    ({"lokr_w1": rnd(4, 5, seed=0), "lokr_w1_a": rnd(4, 2, seed=0), "lokr_w1_b": rnd(2, 5, seed=0),
      "lokr_w2": rnd(6, 4, seed=2)}, "keep one form"),
    ({"lora_down.weight": rnd(4, 20, seed=0)}, "without its up"),
    ({"lora_down.weight": rnd(4, 20, seed=0), "lora_A.weight": rnd(4, 20, seed=0),
      "lora_up.weight": rnd(24, 4, seed=1)}, "both give"),
    ({"lora_down.weight": rnd(4, 20, seed=0), "lora_up.weight": rnd(24, 4, seed=1), "diff": rnd(24, 20, seed=2)},
     "several adapter types"),
    ({"lora_down.weight": rnd(4, 20, seed=0), "lora_up.weight": rnd(24, 4, seed=1),
      "dora_scale": rnd(1, 24, seed=2)}, "DoRA magnitude has shape"),
    ({"lora_down.weight": rnd(4, 20, seed=0), "lora_up.weight": rnd(24, 4, seed=1), "diff_b": rnd(20, seed=2)},
     "diff_b has 20 values"),
    ({"dora_scale": rnd(24, 1, seed=0)}, "without LoRA"),
    ({"lora_down.weight": rnd(4, 20, seed=0), "lora_up.weight": rnd(24, 4, seed=1), "foo": rnd(1, seed=0)},
     "unknown adapter key part"),
])
def test_format_errors_name_the_stem(parts, match):
    with pytest.raises(AdapterFormatError, match=match) as e:
        detect(parts, 1.0, stem="blocks.1.cross_attn.k")
    assert str(e.value).startswith("blocks.1.cross_attn.k")


@pytest.mark.parametrize("parts,key", [
    ({"lora_down.weight": rnd(4, 20, seed=0), "lora_up.weight": rnd(24, 4, seed=1),
      "lora_mid.weight": rnd(4, 4, 3, 3, seed=2)}, "lora_mid.weight"),
    ({"oft_blocks": rnd(4, 6, 6, seed=0)}, "oft_blocks"),
    ({"a1.weight": rnd(4, 20, seed=0)}, "a1.weight"),
    ({"lora_down.weight": rnd(4, 20, 3, 3, seed=0), "lora_up.weight": rnd(24, 4, 1, 1, seed=1)}, "down"),
    ({"lokr_w1": rnd(4, 5, seed=0), "lokr_w2_a": rnd(2, 6, seed=1), "lokr_w2_b": rnd(2, 4, seed=2),
      "lokr_t2": rnd(2, 2, 3, 3, seed=3)}, "lokr_t2"),
])
def test_unsupported_raise_not_implemented_naming_the_key(parts, key):
    with pytest.raises(NotImplementedError, match=rf"blocks\.2\.q\.{key}"):
        detect(parts, 1.0, stem="blocks.2.q")


def test_tucker_with_singleton_kernel_dims_is_linear():
    p = lokr_parts("full", "tucker")
    p4 = dict(p, lokr_t2=p["lokr_t2"][:, :, None, None])
    check(detect(p4, 2.0).delta(), detect(p, 2.0).delta().double(), 1e-7)
    q = loha_parts(True)
    q4 = dict(q, hada_t1=q["hada_t1"][:, :, None, None], hada_t2=q["hada_t2"][:, :, None, None])
    check(detect(q4, 2.0).delta(), detect(q, 2.0).delta().double(), 1e-7)


# --- the merge's scratch -------------------------------------------------------------------------
def _every_type():
    parts, _, _ = lora_parts()
    w = rnd(OUT, IN, seed=70) / IN ** 0.5
    yield "lora", detect(parts, 2.0, stem="l"), None
    yield "full", detect({"diff": rnd(OUT, IN, seed=71)}, None, stem="l"), None
    yield "bias only", detect({"diff_b": rnd(OUT, seed=72)}, None, stem="l"), w
    yield "loha", detect(loha_parts(False), 1.5, stem="l"), None
    yield "lokr", detect(lokr_parts("fact", "fact"), 3.0, stem="l"), None
    yield "dora", detect({**parts, "dora_scale": magnitude(w, "out", seed=73)[:, None]}, 2.0, stem="l"), w
    half = detect(lora_parts(seed=74)[0], None, stem="l")
    yield "sliced", V.Sliced([(0, OUT, half)], OUT, stem="l"), None


@pytest.mark.parametrize("kind", ["lora", "full", "bias only", "loha", "lokr", "dora", "sliced"])
@pytest.mark.parametrize("rows", [None, slice(3, 11), "index"])
def test_delta_and_folded_delta_are_fresh_tensors_the_caller_may_write(kind, rows):
    """A merge adds the weight into each chunk's delta in place (restore memory copy): every
    type's delta(rows) / folded_delta(rows) must be a new tensor, never a cached one or a view
    of one, so a second call gives the same values after the first was overwritten."""
    _, v, w = next(t for t in _every_type() if t[0] == kind)
    rows = torch.tensor([5, 0, 9]) if rows == "index" else rows
    for make in (lambda: v.delta(rows=rows, weight=w), lambda: v.folded_delta("cpu", 0.7, rows, weight=w)):
        first = make()
        ref = first.clone()
        first.add_(1000.0)
        again = make()
        assert torch.equal(again, ref)
