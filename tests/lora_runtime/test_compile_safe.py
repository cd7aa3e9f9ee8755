"""Adapters under torch.compile (inductor, CPU): changing strength, schedule, or switching between
two same-shaped adapters (dynamic mode) re-uses the compiled graph; compiled outputs equal the
uncompiled ones and differ from the adapter-off output; a recompile-limit fallback is named on the
report. One tiny model is compiled once for the module (inductor's C++ build dominates the time)."""
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from comfyui_lora_runtime.lora_runtime import compile_watch
from comfyui_lora_runtime.lora_runtime import AdapterSpec, applied, plan
from comfyui_lora_runtime.lora_runtime.layer.runtime_context import runtime_context
from comfyui_lora_runtime.nodes import report

# fp32: a compiled call multiplies the small h = x A^T by the fp32 factor tensors (k * cell) and
# adds (h B^T) out of place; eager folds the fp64 factor product into addmm_'s alpha (lossless) or
# multiplies the delta factor by factor (exact). A few fp32 roundings apart on outputs of O(1).
RTOL, ATOL = 1e-5, 2e-6


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = torch.nn.Linear(16, 32)
        self.proj_out = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.proj_out(F.gelu(self.proj_in(x)))


COMPILES = []


def _counting_inductor(gm, example_inputs):
    from torch._inductor.compile_fx import compile_fx
    COMPILES.append(gm)
    return compile_fx(gm, example_inputs)


def _graph_counter():
    """(graphs, backend): a torch.compile backend that runs each graph as traced and keeps it."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return graphs, counting


def _write(path, model, seed):
    g = torch.Generator().manual_seed(seed)
    t = {}
    for n in ("proj_in", "proj_out"):
        lin = model.get_submodule(n)
        t[f"diffusion_model.{n}.lora_down.weight"] = torch.randn(4, lin.in_features, generator=g) * 0.3
        t[f"diffusion_model.{n}.lora_up.weight"] = torch.randn(lin.out_features, 4, generator=g) * 0.3
        t[f"diffusion_model.{n}.alpha"] = torch.tensor(4.0)
    save_file(t, str(path))
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    model = Tiny().eval().requires_grad_(False)
    d = tmp_path_factory.mktemp("compile")
    a, b = _write(d / "a.safetensors", model, 1), _write(d / "b.safetensors", model, 2)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(model, backend=_counting_inductor, dynamic=False)
    with torch.no_grad():
        base = model(x)
    return model, compiled, x, base, a, b


def _run(model, compiled, x, path, strength, tier="lossless", name="a", adapters=None):
    p = plan(model, [AdapterSpec(path, strength, name=name)], mode="dynamic", tier=tier)
    with torch.no_grad(), applied(model, p, fusion_backend=None), runtime_context(adapters=adapters):
        return compiled(x), model(x)


def _check(got, want, base):
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert (got - base).abs().max() > 1e-2  # the adapter is in the compiled output


def test_compile_strength_changes_do_not_recompile(setup):
    model, compiled, x, base, a, _ = setup
    got, want = _run(model, compiled, x, a, 0.8)
    _check(got, want, base)
    first = len(COMPILES)
    assert first == 1, "the model broke into several graphs: traced code read Python state (a context)"
    for s in (0.5, 1.3, -0.7, 0.25, 2.0, 0.9, 1.1, 0.05, 1.7, 0.6):
        got, want = _run(model, compiled, x, a, s)
        _check(got, want, base)
    got, want = _run(model, compiled, x, a, 0.6, tier="exact")  # the tier is not read in traced code
    _check(got, want, base)
    assert len(COMPILES) == first, "a strength change recompiled"
    with torch.no_grad():
        assert torch.equal(model(x), base)  # restored after each run


def test_compile_schedule_and_same_shape_switch_do_not_recompile(setup):
    model, compiled, x, base, a, b = setup
    _run(model, compiled, x, a, 0.8)
    first = len(COMPILES)
    outs = {}
    for m in (1.0, 0.5, 0.0, 2.0, 0.3):  # a strength schedule's per-call multiplier
        got, want = _run(model, compiled, x, a, 0.8, adapters={"a": (m, None)})
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        outs[m] = got
    assert torch.equal(outs[0.0], base) or torch.allclose(outs[0.0], base, rtol=RTOL, atol=ATOL)
    assert (outs[2.0] - outs[1.0]).abs().max() > 1e-2  # the multiplier reaches the compiled graph
    for path, name in ((b, "b"), (a, "a"), (b, "b")):  # A <-> B: same shapes, other numbers, other name
        got, want = _run(model, compiled, x, path, 0.8, name=name)
        _check(got, want, base)
        outs[name] = got
    assert (outs["a"] - outs["b"]).abs().max() > 1e-2
    assert len(COMPILES) == first, "a schedule change or an adapter switch recompiled"


def test_compile_branch_mask_reaches_the_compiled_call(setup):
    model, compiled, x, base, a, _ = setup
    mask = torch.tensor([0.0, 1.0])  # the adapter on the second row (one CFG branch) only
    got, want = _run(model, compiled, x, a, 0.8, adapters={"a": (1.0, mask)})
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got[0], base[0], rtol=RTOL, atol=ATOL)
    assert (got[1] - base[1]).abs().max() > 1e-2


def test_compile_factor_tensor_has_the_float_bits():
    """One multiply by a python float and by the fp32 0-d tensor holding it give the same bits
    (CPU scalar path), in every dtype the runtime runs."""
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        d = torch.randn(64, 64, generator=g).to(dt)
        for f in (0.8, 1 / 3, 1.4, -2.5):
            assert torch.equal(d * f, d * torch.tensor(f, dtype=torch.float32)), (dt, f)
    d = torch.randn(64, 64, generator=g)
    assert not torch.equal(d * 0.8, d * torch.tensor(0.8).to(torch.bfloat16))  # a factor rounded first differs


def test_compile_recompile_limit_fallback_is_reported():
    compile_watch.install()
    compile_watch.reset()
    r0 = report.build(None, mode="dynamic", tier="lossless", host="bundled", sample_seconds=0.1, steps=1)
    assert "compile" not in r0 and "uncompiled" not in report.text(r0)

    def shapes_vary(t):
        return t * 2 + 1

    f = torch.compile(shapes_vary, backend="eager", dynamic=False)
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            f(torch.randn(2))
            f(torch.randn(2, 3))   # over the limit: torch runs it uncompiled from now on, with a warning
        r = report.build(None, mode="dynamic", tier="lossless", host="bundled", sample_seconds=0.1, steps=1)
        fb = r["compile"]["fallbacks"]
        assert len(fb) == 1 and "shapes_vary" in fb[0]["function"] and fb[0]["limit"] == "recompile_limit"
        assert fb[0]["value"] == 1
        try:
            import jsonschema
        except ImportError:
            jsonschema = None
        if jsonschema is not None:
            import json
            schema = json.loads(report.SCHEMA_PATH.read_text())
            assert [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(r)] == []
        line = [ln for ln in report.text(r).splitlines() if "uncompiled" in ln]
        assert line and "shapes_vary" in line[0] and "recompile_limit" in line[0]
    finally:
        compile_watch.reset()


def test_compile_output_offsets_ride_in_the_trace_plan():
    """An output offset (diff_b), on a merged slot and on a dynamic one, is in the trace plan:
    one graph for the layer, the offsets in the compiled output (a wrong answer without them),
    strength, runtime-scale and branch-mask changes of the offset slots without a recompile."""
    from comfyui_lora_runtime.lora_runtime import AdaptedLayer
    from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
    from testkit.fixtures import lora_pair

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 24)
    w = AdaptedLayer(lin, "l")
    down, up = lora_pair(24, 16, 4, 1, scale=0.3)
    db = torch.randn(24, generator=torch.Generator().manual_seed(2))
    w.add_adapter("a", LayerAdapter("l", down, up, alpha=4.0, diff_b=db), 0.8)
    down2, up2 = lora_pair(24, 16, 4, 3, scale=0.3)
    db2 = torch.randn(24, generator=torch.Generator().manual_seed(4))
    w.add_adapter("b", LayerAdapter("l", down2, up2, alpha=2.0, diff_b=db2), -0.6)
    w.attach()
    graphs, counting = _graph_counter()

    try:
        x = torch.randn(2, 3, 16)
        with torch.no_grad():
            base = F.linear(x, lin.weight, lin.bias)
            w.merge(only={"a"})
            w.prepare_trace()
            assert w.traced_factors is not None and len(w.traced_factors.offsets) == 2
            cf = torch.compile(lin, backend=counting, dynamic=False)

            def check(adapters, fa):
                with runtime_context(tier="lossless", adapters=adapters):
                    got, want = cf(x), lin(x)
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
                assert (got - (want - db * 0.8 * fa)).abs().max() > 1e-2  # slot a's offset is there
                assert (got - base).abs().max() > 1e-2

            for adapters, fa in ((None, 1.0), ({"a": (0.5, None), "b": (2.0, None)}, 0.5)):
                check(adapters, fa)  # a merged: its offset per call
            assert len(graphs) == 1, f"{len(graphs)} graphs: a runtime factor change recompiled"
            for mask in ([0.0, 1.0], [1.0, 0.0]):  # a mask appearing: one more graph (documented)
                check({"b": (1.0, torch.tensor(mask))}, 1.0)
            assert len(graphs) == 2, f"{len(graphs)} graphs: a mask change recompiled"
            w.unmerge()
            w.prepare_trace()  # a merged -> dynamic: another structure, one more graph
            for sb in (-0.6, 0.4, 0.0, 1.5):
                w.set_strength("b", sb)
                check(None, 1.0)
        assert len(graphs) == 3, f"{len(graphs)} graphs: a strength change of an offset slot recompiled"
    finally:
        w.detach()


def _attached(lin, v, strength=0.8):
    """`lin` wrapped and attached, with update `v` as slot "a" (its shapes checked first)."""
    from comfyui_lora_runtime.lora_runtime import AdaptedLayer
    from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter

    v.check_module(lin.out_features, lin.in_features)
    w = AdaptedLayer(lin, "l")
    w.add_adapter("a", LayerAdapter("l", update=v), strength)
    w.attach()
    return w


def _far(got, base):
    assert (got - base).abs().max() > 1e-2


def _strengths_and_tiers(w, lin, cf, x, differs):
    """Slot "a" at three strengths, each under lossless and exact: the compiled call `cf` equals the
    eager one, and `differs(got, base)` asserts it is not the adapter-off output. Returns that."""
    with runtime_context(scale=0.0):
        base = lin(x)
    for st in (0.8, -0.4, 1.7):
        w.set_strength("a", st)
        for tier in ("lossless", "exact"):
            with runtime_context(tier=tier):
                got, want = cf(x), lin(x)
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
            differs(got, base)
    return base


def test_compile_sliced_updates_ride_in_the_trace_plan():
    """A sliced update (Flux to_q/to_k/to_v onto one qkv weight) traces as one pair: its parts'
    A's stacked, their B's in their row blocks, a per-rank factor; one graph over strength changes,
    the compiled output equal to eager and the uncovered rows left at base."""
    from comfyui_lora_runtime.lora_runtime import updates as U

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 30)
    g = torch.Generator().manual_seed(5)

    def lora(out, r, alpha):
        return U.LoRA(torch.randn(r, 16, generator=g) * 0.3, torch.randn(out, r, generator=g) * 0.3, alpha)
    v = U.Sliced([(0, 10, lora(10, 4, 2.0)), (10, 20, lora(10, 2, None)), (24, 30, lora(6, 3, 1.5))], 30)
    w = _attached(lin, v)
    graphs, counting = _graph_counter()

    try:
        w.prepare_trace()
        assert w.traced_factors is not None and w.traced_factors.slots[0][2].shape == (9,)
        cf = torch.compile(lin, backend=counting, dynamic=False)
        x = torch.randn(2, 3, 16)
        with torch.no_grad():
            def far_where_covered(got, base):
                assert (got[..., :20] - base[..., :20]).abs().max() > 1e-2
                assert (got[..., 24:] - base[..., 24:]).abs().max() > 1e-2
                torch.testing.assert_close(got[..., 20:24], base[..., 20:24], rtol=0, atol=0)
            _strengths_and_tiers(w, lin, cf, x, far_where_covered)
        assert len(graphs) == 1, f"{len(graphs)} graphs for 3 strengths and 2 tiers"
    finally:
        w.detach()


def _other_update(kind, weight):
    """An update of a Linear with `weight` [out, in] (out a multiple of 4, in of 2) that is not a
    stack() pair, by the trace form it takes (for [24, 16]: FORM_OF)."""
    from comfyui_lora_runtime.lora_runtime import updates as U
    from testkit.fixtures import lora_pair

    out_f, in_f = weight.shape
    c, d = out_f // 4, in_f // 2     # LoKr: w1 [4, 2] x w2 [c, d]
    g = torch.Generator().manual_seed(11)

    def r(*shape, s=0.3):
        return torch.randn(*shape, generator=g) * s
    if kind == "lokr (kron)":
        return U.LoKr(w1=r(4, 2, s=1.0), w2=r(c, d), alpha=None)
    if kind == "lokr (kron2)":      # w2 = w2_a w2_b kept factorised (rank 1)
        return U.LoKr(w1=r(4, 2, s=1.0), w2_a=r(c, 1), w2_b=r(1, d), alpha=0.5)
    if kind == "loha (pair)":       # rank 2 x 2: the Khatri-Rao pair
        return U.LoHa(r(out_f, 2), r(2, in_f), r(out_f, 2), r(2, in_f), alpha=1.5)
    if kind == "loha (dense)":      # rank 4 x 3 = 12: the dense delta is cheaper at [24, 16]
        return U.LoHa(r(out_f, 4), r(4, in_f), r(out_f, 3), r(3, in_f), alpha=6.0)
    if kind == "full":
        return U.Full(r(out_f, in_f, s=0.1))
    down, up = lora_pair(out_f, in_f, 4, 1, scale=0.3)
    if kind == "dora out (lora)":
        return U.DoRA(U.LoRA(down, up, 4.0), weight.norm(dim=1) * 1.2)
    if kind == "dora out (lokr)":
        return U.DoRA(U.LoKr(w1=r(4, 2, s=1.0), w2=r(c, d), alpha=None), weight.norm(dim=1) * 0.9)
    if kind == "dora in (lora)":
        return U.DoRA(U.LoRA(down, up, 4.0), weight.norm(dim=0)[None, :] * 1.1)
    if kind == "sliced (lokr + lora)":  # rows [0, out/2) a LoKr, [3 out/4, out) a LoRA, none between
        q = out_f // 4
        v = U.Sliced([(0, 2 * q, U.LoKr(w1=r(2, 2, s=1.0), w2=r(q, d), alpha=None)),
                      (3 * q, out_f, U.LoRA(*lora_pair(q, in_f, 2, 7, scale=0.3), 2.0))], out_f)
        v.check_module(out_f, in_f)
        return v
    raise AssertionError(kind)


FORM_OF = {"lokr (kron)": "kron", "lokr (kron2)": "kron2", "loha (pair)": "pair", "loha (dense)": "dense",
           "full": "dense", "dora out (lora)": "dora", "dora out (lokr)": "dora", "dora in (lora)": "dense",
           "sliced (lokr + lora)": "sliced"}
OTHER = list(FORM_OF)


@pytest.mark.parametrize("kind", OTHER)
def test_compile_other_update_types_ride_in_the_trace_plan(kind):
    """LoKr, LoHa, full deltas and DoRA trace as their forms (updates/trace_forms.py): one graph over
    strength changes, both tiers and a CFG row mask's values; the compiled output equals eager's and
    is far from the adapter-off output (a dropped form fails)."""
    torch._dynamo.reset()   # eight kinds x two graphs on one code object: past dynamo's recompile limit
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 24)
    v = _other_update(kind, lin.weight.detach())
    w = _attached(lin, v)
    graphs, counting = _graph_counter()
    try:
        w.prepare_trace()
        tp = w.traced_factors
        assert tp is not None and not tp.slots and len(tp.forms) == 1
        assert tp.forms[0][0].kind == FORM_OF[kind]
        cf = torch.compile(lin, backend=counting, dynamic=False)
        x = torch.randn(2, 3, 16)
        with torch.no_grad():
            base = _strengths_and_tiers(w, lin, cf, x, _far)
            assert len(graphs) == 1, f"{len(graphs)} graphs for 3 strengths and 2 tiers"
            for mask in ([0.0, 1.0], [1.0, 0.0]):   # a mask appearing: one more graph (documented)
                with runtime_context(tier="lossless", adapters={"a": (0.5, torch.tensor(mask))}):
                    got, want = cf(x), lin(x)
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
                off = 0 if mask[0] == 0.0 else 1     # the masked-off batch row is base
                torch.testing.assert_close(got[off], base[off], rtol=0, atol=0)
                assert (got[1 - off] - base[1 - off]).abs().max() > 1e-2
            assert len(graphs) == 2, f"{len(graphs)} graphs: a mask value change recompiled"
    finally:
        w.detach()


def test_compile_trace_forms_match_eager_in_bf16():
    """bf16 (the usual weight dtype): every form within bf16 rounding of the eager output."""
    for kind in OTHER:
        torch._dynamo.reset()
        torch.manual_seed(0)
        lin = torch.nn.Linear(16, 24).to(torch.bfloat16)
        v = _other_update(kind, lin.weight.detach().float())
        w = _attached(lin, v)
        try:
            w.prepare_trace()
            form = w.traced_factors.forms[0][0]
            assert form.dtype == torch.bfloat16
            cf = torch.compile(lin, backend="eager", dynamic=False)
            x = torch.randn(2, 3, 16).to(torch.bfloat16)
            with torch.no_grad(), runtime_context(tier="lossless"):
                got, want = cf(x), lin(x)
                base = F.linear(x, lin.weight, lin.bias)
            # a few bf16 roundings apart (the factor lands on another intermediate) on outputs of O(1)
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=kind)
            assert (got.float() - base.float()).abs().max() > 5e-2, kind
        finally:
            w.detach()


def test_compile_a_model_of_every_update_type_is_one_graph_without_breaks():
    """Every Linear of a Wan-shaped model carries another update type (with plain LoRA beside
    some): the compiled model is one graph (fullgraph: a graph break raises), equal to eager, far
    from the adapter-off model, and strength changes on every layer build no second graph."""
    from testkit.fixtures import TinyWanLike, linear_names, lora_pair
    from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter

    torch._dynamo.reset()
    model = TinyWanLike(d=32, f=64, n=2)
    wrappers = []
    for i, name in enumerate(linear_names(model)):
        lin = model.get_submodule(name)
        w = _attached(lin, _other_update(OTHER[i % len(OTHER)], lin.weight.detach()))
        if i % 3 == 0:  # a plain pair beside it: the pair and the form in one trace plan
            down, up = lora_pair(lin.out_features, lin.in_features, 2, 50 + i, scale=0.3)
            w.add_adapter("b", LayerAdapter(name, down, up, alpha=2.0), 0.5)
        w.prepare_trace()
        assert w.traced_factors is not None and w.traced_factors.forms, name
        wrappers.append(w)
    graphs, counting = _graph_counter()
    cm = torch.compile(model, backend=counting, fullgraph=True, dynamic=False)
    x = torch.randn(2, 5, 32)
    try:
        with torch.no_grad():
            with runtime_context(tier="lossless", scale=0.0):
                base = model(x)
            for st in (0.8, -0.5, 1.3):
                for w in wrappers:
                    w.set_strength("a", st)
                with runtime_context(tier="lossless"):
                    got, want = cm(x), model(x)
                # fp32, the per-layer rounding differences (RTOL/ATOL above) carried through 21
                # adapted layers in 2 residual blocks: 1e-4, a hundredth of the adapters' effect
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
                assert (got - base).abs().max() > 1e-2
        assert len(graphs) == 1, f"{len(graphs)} graphs over 3 strengths"
    finally:
        for w in wrappers:
            w.detach()


@pytest.mark.parametrize("dims", [2, 3])
def test_compile_convolutions_ride_in_the_trace_plan(dims):
    """A patch embedding (Conv2d, Wan's Conv3d) with a LoCon-style LoRA and an output offset: its
    kernel delta and offset ride in the trace plan; one graph over strengths and tiers, one more
    for a mask; the compiled output equals eager's, the masked-off batch row is base."""
    from comfyui_lora_runtime.lora_runtime import AdaptedLayer
    from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
    from testkit.fixtures import lora_pair

    torch._dynamo.reset()
    torch.manual_seed(0)
    if dims == 2:
        conv, x = torch.nn.Conv2d(3, 8, 2, stride=2), torch.randn(2, 3, 8, 8)
    else:
        conv, x = torch.nn.Conv3d(4, 8, (1, 2, 2), stride=(1, 2, 2)), torch.randn(2, 4, 2, 6, 6)
    k_in = conv.weight[0].numel()
    w = AdaptedLayer(conv, "patch_embedding")
    down, up = lora_pair(8, k_in, 2, 5, scale=0.3)      # LoCon: down [r, in * kernel]
    w.add_adapter("a", LayerAdapter("patch_embedding", down, up, alpha=2.0, diff_b=torch.randn(8) * 0.5), 0.7)
    w.attach()
    graphs, counting = _graph_counter()
    try:
        w.prepare_trace()
        tp = w.traced_factors
        assert tp is not None and [f[0].kind for f in tp.forms] == ["conv"] and len(tp.offsets) == 1
        cf = torch.compile(conv, backend=counting, dynamic=False)
        with torch.no_grad():
            base = _strengths_and_tiers(w, conv, cf, x, _far)
            assert len(graphs) == 1, f"{len(graphs)} graphs for 3 strengths and 2 tiers"
            with runtime_context(tier="lossless", adapters={"a": (1.0, torch.tensor([0.0, 1.0]))}):
                got, want = cf(x), conv(x)
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(got[0], base[0], rtol=0, atol=0)
            _far(got[1], base[1])
            assert len(graphs) == 2
    finally:
        w.detach()


def test_compile_layers_without_a_trace_plan_stay_correct():
    """A DoRA on a layer whose host patches the weight per call (ComfyUI ``weight_function``) has no
    trace plan: its base output is not x Wᵀ + b of the stored tensors. The compiled call takes the
    general path (it reads the context: a graph break) and is still correct."""
    from comfyui_lora_runtime.lora_runtime import AdaptedLayer
    from comfyui_lora_runtime.lora_runtime import updates as U
    from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
    from testkit.fixtures import lora_pair

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 24)
    lin.weight_function = []   # ComfyUI's per-call patch list: present, empty here
    lin.bias_function = [lambda b: b * 1.0]
    w = AdaptedLayer(lin, "l")
    down, up = lora_pair(24, 16, 4, 1, scale=0.3)
    v = U.DoRA(U.LoRA(down, up, 4.0), lin.weight.detach().norm(dim=1) * 1.2)
    v.check_module(24, 16)
    w.add_adapter("a", LayerAdapter("l", update=v), 0.8)
    w.attach()
    try:
        x = torch.randn(3, 16)
        with torch.no_grad():
            base = F.linear(x, lin.weight, lin.bias)
            w.prepare_trace()
            assert w.traced_factors is None
            cf = torch.compile(lin, backend="eager")
            with runtime_context(tier="lossless"):
                got, want = cf(x), lin(x)
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
            assert (got - base).abs().max() > 1e-2
    finally:
        w.detach()


def test_compile_set_strength_on_a_prepared_wrapper_does_not_recompile():
    from comfyui_lora_runtime.lora_runtime import AdaptedLayer
    from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
    from testkit.fixtures import lora_pair

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 24)
    w = AdaptedLayer(lin, "l")
    down, up = lora_pair(24, 16, 4, 1, scale=0.3)
    w.add_adapter("a", LayerAdapter("l", down, up, alpha=4.0), 0.8)
    w.attach()
    graphs, counting = _graph_counter()

    try:
        w.prepare_trace()
        cf = torch.compile(lin, backend=counting, dynamic=False)
        x = torch.randn(3, 16)
        with torch.no_grad(), runtime_context(tier="lossless"):
            for s in (0.8, 0.3, -1.2, 0.0, 2.0):
                w.set_strength("a", s)
                got, want = cf(x), lin(x)
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
                if s:
                    assert (got - F.linear(x, lin.weight, lin.bias)).abs().max() > 1e-2
        assert len(graphs) == 1, f"{len(graphs)} graphs for 5 strengths"
    finally:
        w.detach()
