"""Merge modes, the auto rule and its cache, applied() and the state-transition matrix."""
import itertools

import pytest
import torch
from safetensors.torch import save_file

from comfyui_lora_runtime.lora_runtime import (AUTO_MERGE_MAX_ROUNDING_LOSS, AdapterSpec, ConfigError, DecisionCache,
                                               LoraInjector, MergeRefusedError, NonFiniteMergeError, applied, plan)

from testkit.fixtures import TinyWanLike, assert_no_runtime_left, make_adapter_tensors, write_kohya, write_peft


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_state(model, snap):
    sd = model.state_dict()
    assert sd.keys() == snap.keys()
    for k, v in snap.items():
        assert torch.equal(sd[k], v), k


@pytest.fixture
def files(tmp_path):
    ref = TinyWanLike(dtype=torch.bfloat16)
    return {
        # |dW| ~ 3-10 % of |W|: most of it survives a bf16 merge
        "style": write_kohya(tmp_path / "style.safetensors", make_adapter_tensors(ref, r=4, seed=1, scale=0.25), alpha=4.0),
        # far below a bf16 ulp: a merge rounds nearly all of it away
        "distilled": write_peft(tmp_path / "distilled.safetensors", make_adapter_tensors(ref, r=4, seed=2, scale=0.004),
                                alpha=4.0),
        "second": write_kohya(tmp_path / "second.safetensors", make_adapter_tensors(ref, r=2, seed=3, scale=0.25)),
        "partial": write_kohya(tmp_path / "partial.safetensors",
                               make_adapter_tensors(ref, r=2, seed=4, scale=0.25, only=["ffn"])),
        "offset": _offset_file(tmp_path / "offset.safetensors", ref),
    }


def _offset_file(path, model):
    g = torch.Generator().manual_seed(7)
    sd = {f"diffusion_model.{n}.diff_b": torch.randn(model.get_submodule(n).out_features, generator=g) * 0.1
          for n in ("blocks.0.ffn.2", "blocks.1.self_attn.o")}
    save_file(sd, str(path))
    return path


def _run(model, specs, mode, tier="exact", cache=None, x=None):
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) if x is None else x
    with torch.no_grad(), applied(model, plan(model, specs, mode, tier), cache) as report:
        return model(x), report


def test_auto_keeps_sub_ulp_dynamic_and_merges_style(files):
    model = TinyWanLike(dtype=torch.bfloat16)
    snap = _snapshot(model)
    y_auto, rep = _run(model, [AdapterSpec(str(files["distilled"]))], "auto")
    assert rep.decision.chosen == "dynamic" and rep.decision.share_lost > 0.9
    assert "round away" in rep.decision.reason
    y_dyn, _ = _run(model, [AdapterSpec(str(files["distilled"]))], "dynamic")
    assert torch.equal(y_auto, y_dyn)
    y_off, _ = _run(model, [], "dynamic")
    assert not torch.equal(y_dyn, y_off)
    # a forced merge loses most of the adapter's effect, measured in fp32 so that the
    # bf16 forward's own noise does not hide it: merged bf16 weights vs the fp32 dynamic path
    spec = [AdapterSpec(str(files["distilled"]))]
    with torch.no_grad(), applied(model, plan(model, spec, "merge", "exact")):
        merged_sd = {k: v.float() for k, v in model.state_dict().items() if "base_layer" not in k}
        merged_sd.update({k.replace(".base_layer", ""): v.float() for k, v in model.state_dict().items()
                          if "base_layer" in k})
    m32 = TinyWanLike(dtype=torch.float32)
    x32 = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).float()
    m32.load_state_dict({k: v.float() for k, v in snap.items()})
    y_off32, _ = _run(m32, [], "dynamic", x=x32)
    y_dyn32, _ = _run(m32, spec, "dynamic", x=x32)
    m32.load_state_dict(merged_sd)
    with torch.no_grad():
        y_merge32 = m32(x32)
    effect = (y_dyn32 - y_off32).norm()
    assert (y_merge32 - y_dyn32).norm() > 0.5 * effect
    y_style_auto, rep_s = _run(model, [AdapterSpec(str(files["style"]))], "auto")
    assert rep_s.decision.chosen == "merge" and rep_s.decision.share_lost < AUTO_MERGE_MAX_ROUNDING_LOSS
    assert rep_s.restore_bytes < rep_s.merged_weight_bytes
    _assert_same_state(model, snap)


def test_auto_measures_once_per_adapter_set(files):
    model = TinyWanLike(dtype=torch.bfloat16)
    cache = DecisionCache()
    s = [AdapterSpec(str(files["style"]), 0.8)]
    _, r1 = _run(model, s, "auto", cache=cache)
    _, r2 = _run(model, s, "auto", cache=cache)
    assert cache.measurements == 1 and not r1.decision.cached and r2.decision.cached
    assert r1.decision.share_lost == r2.decision.share_lost
    _run(model, [AdapterSpec(str(files["style"]), 0.5)], "auto", cache=cache)  # other strength: new key
    assert cache.measurements == 2


def test_auto_measures_again_when_the_merge_scaling_changes(files):
    """exact merges apply scale and strength in order, lossless/high fold them into one product:
    a share measured for one is not served to the other; lossless and high share it."""
    model = TinyWanLike(dtype=torch.bfloat16)
    cache = DecisionCache()
    s = [AdapterSpec(str(files["style"]), 0.8)]
    _run(model, s, "auto", tier="exact", cache=cache)
    _, r = _run(model, s, "auto", tier="lossless", cache=cache)
    assert cache.measurements == 2 and not r.decision.cached
    _, r = _run(model, s, "auto", tier="high", cache=cache)
    assert cache.measurements == 2 and r.decision.cached


def _merged_state(model, specs):
    with torch.no_grad(), applied(model, plan(model, specs, "merge", "exact"), fusion_backend=None):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("names", [("style", "distilled"), ("distilled", "style"), ("style", "distilled", "second")])
def test_auto_decides_each_adapter_on_its_own(files, names):
    """A sub-ulp (distilled) adapter stacked with a style adapter stays dynamic while the
    style merges: a set-wide share (about 1 %) would have merged both and rounded the
    distilled update away. The output is bit for bit the run with the mergeable adapters
    merged by hand and the distilled one dynamic on top, and differs from the all-merged
    run by about the distilled adapter's own effect."""
    model = TinyWanLike(dtype=torch.bfloat16)
    snap = _snapshot(model)
    specs = [AdapterSpec(str(files[n]), 0.8 if n == "style" else 1.0) for n in names]
    y_auto, rep = _run(model, specs, "auto")
    per = {a.name.split(".")[0]: a for a in rep.decision.adapters}
    assert {n: a.chosen for n, a in per.items()} == {n: ("dynamic" if n == "distilled" else "merge") for n in names}
    assert per["distilled"].share_lost > 0.9 and per["style"].share_lost < 0.1
    assert rep.decision.chosen == "mixed" and "distilled.safetensors: stays unmerged" in rep.decision.reason
    _assert_same_state(model, snap)
    mergeable = [sp for n, sp in zip(names, specs) if n != "distilled"]
    distilled = [sp for n, sp in zip(names, specs) if n == "distilled"]
    by_hand = TinyWanLike(dtype=torch.bfloat16)
    by_hand.load_state_dict(_merged_state(model, mergeable))
    y_hand, _ = _run(by_hand, distilled, "dynamic")
    assert torch.equal(y_auto, y_hand)
    # the wrong answer, all merged, compared in fp32 on the same bf16 weights (the bf16
    # forward's own rounding would hide a sub-ulp effect)
    f32 = lambda sd: {k: v.float() for k, v in sd.items()}  # noqa: E731
    x32 = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).float()
    m32 = TinyWanLike(dtype=torch.float32)
    m32.load_state_dict(f32(_merged_state(model, specs)))
    with torch.no_grad():
        y_all = m32(x32)
    m32.load_state_dict(f32(by_hand.state_dict()))
    with torch.no_grad():
        y_without = m32(x32)
    y_mixed, _ = _run(m32, distilled, "dynamic", x=x32)
    effect = (y_mixed - y_without).norm()
    assert effect > 0 and (y_mixed - y_all).norm() > 0.5 * effect


def test_auto_cache_is_per_adapter_and_follows_merge_order(files):
    model = TinyWanLike(dtype=torch.bfloat16)
    cache = DecisionCache()
    both = [AdapterSpec(str(files["style"]), 0.8), AdapterSpec(str(files["distilled"]))]
    _, r1 = _run(model, both, "auto", cache=cache)
    assert cache.measurements == 2 and not r1.decision.cached
    _, r2 = _run(model, both, "auto", cache=cache)
    assert cache.measurements == 2 and r2.decision.cached and r2.decision.to_dict() == {
        **r1.decision.to_dict(), "cached": True, "measured": 0,
        "adapters": [{**a, "cached": True} for a in r1.decision.to_dict()["adapters"]]}
    # the distilled adapter alone is measured against the bare weight: a new key
    _run(model, both[1:], "auto", cache=cache)
    assert cache.measurements == 3


def test_fp32_model_always_merges_under_auto(files):
    model = TinyWanLike(dtype=torch.float32)
    _, rep = _run(model, [AdapterSpec(str(files["distilled"]))], "auto", x=torch.randn(2, 5, 32))
    assert rep.decision.chosen == "merge" and rep.decision.share_lost == 0.0


class PackedWeight(torch.Tensor):
    pass


def test_quantized_weights_stay_dynamic_and_merge_is_refused(files):
    model = TinyWanLike(dtype=torch.bfloat16)
    lin = model.blocks[0].ffn[0]
    lin.weight = torch.nn.Parameter(lin.weight.detach().as_subclass(PackedWeight), requires_grad=False)
    _, rep = _run(model, [AdapterSpec(str(files["style"]))], "auto")
    assert rep.decision.chosen == "dynamic" and "cannot take a merge" in rep.decision.reason
    snap = _snapshot(model)
    with pytest.raises(MergeRefusedError, match=r"blocks.0.ffn.0.*quantized.*dynamic"):
        _run(model, [AdapterSpec(str(files["style"]))], "merge")
    _assert_same_state(model, snap)
    assert_no_runtime_left(model)


def test_bad_settings_are_refused(files):
    model = TinyWanLike()
    with pytest.raises(ConfigError, match="unknown merge mode 'fuse'"):
        plan(model, [], "fuse")
    with pytest.raises(ConfigError, match="unknown quality tier 'fast'"):
        plan(model, [], "auto", "fast")
    with pytest.raises(ConfigError, match="strength of style.safetensors 11.0 is out of range"):
        plan(model, [AdapterSpec(str(files["style"]), 11.0)])


def test_nonfinite_merge_names_adapter_and_leaves_weights(tmp_path):
    model = TinyWanLike(dtype=torch.float16)
    pairs = make_adapter_tensors(model, r=1, seed=5, scale=1.0, only=["ffn"])
    pairs["blocks.1.ffn.2"] = (torch.full((1, 64), 400.0), torch.full((32, 1), 400.0))
    path = write_kohya(tmp_path / "boom.safetensors", pairs)
    snap = _snapshot(model)
    with pytest.raises(NonFiniteMergeError, match=r"boom.safetensors.*blocks.1.ffn.2.*no weight was changed"):
        _run(model, [AdapterSpec(str(path))], "merge", x=torch.randn(2, 5, 32).half())
    _assert_same_state(model, snap)


def test_restore_on_error_inside_the_block(files):
    model = TinyWanLike(dtype=torch.bfloat16)
    snap = _snapshot(model)
    p = plan(model, [AdapterSpec(str(files["style"]))], "merge")
    with pytest.raises(KeyboardInterrupt):
        with applied(model, p):
            assert not torch.equal(model.blocks[0].ffn[0].weight, snap["blocks.0.ffn.0.weight"])
            raise KeyboardInterrupt  # an interrupt mid-sampling
    _assert_same_state(model, snap)
    assert type(model.blocks[0].ffn[0]) is torch.nn.Linear


STATES = {
    "none": [],
    "one@1.0": [("style", 1.0)],
    "one@0.0": [("style", 0.0)],
    "one@-0.5": [("style", -0.5)],
    "two stacked": [("style", 1.0), ("second", 0.7)],
    "order swapped": [("second", 0.7), ("style", 1.0)],
    "partial": [("partial", 1.0)],
    "diff_b": [("offset", 1.0), ("style", 0.6)],
}


@pytest.mark.parametrize("mode,restore", [("merge", "lean"), ("merge", "copy"), ("dynamic", "lean")])
def test_state_transitions_equal_fresh_application(files, mode, restore):
    """Every state after every state equals a fresh application of it (and the model comes back
    bit for bit); with restore memory copy each swap's merge takes the copy its restore wrote back."""
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    specs = {k: [AdapterSpec(str(files[f]), s) for f, s in v] for k, v in STATES.items()}
    fresh = {}
    for k, sp in specs.items():
        m = TinyWanLike(dtype=torch.bfloat16)
        inj = LoraInjector(m)
        inj.apply(plan(m, sp, mode, "exact"))
        with torch.no_grad():
            fresh[k] = m(x)
        inj.clear()
    assert not torch.equal(fresh["none"], fresh["one@1.0"])
    assert not torch.equal(fresh["one@1.0"], fresh["two stacked"])
    assert torch.equal(fresh["none"], fresh["one@0.0"])
    model = TinyWanLike(dtype=torch.bfloat16)
    snap = _snapshot(model)
    inj = LoraInjector(model)
    plans = {k: plan(model, sp, mode, "exact", restore=restore) for k, sp in specs.items()}
    for a, b in itertools.product(specs, specs):
        inj.apply(plans[a])
        inj.apply(plans[b])
        with torch.no_grad():
            assert torch.equal(model(x), fresh[b]), f"{a} -> {b} ({mode})"
    inj.clear()
    _assert_same_state(model, snap)


def test_applied_keeps_the_module_tree_keys_and_parameters(files):
    """Adapters ride on instance forwards: while applied, named_modules(), state_dict()
    keys and the Parameter objects are the model's own, and the output has the adapter."""
    model = TinyWanLike(dtype=torch.float32)
    names = [n for n, _ in model.named_modules()]
    keys = list(model.state_dict().keys())
    params = {n: p for n, p in model.named_parameters()}
    x = torch.randn(2, 5, model.blocks[0].ffn[0].in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(x)
        for mode in ("dynamic", "merge"):
            with applied(model, plan(model, [AdapterSpec(str(files["style"]))], mode), fusion_backend=None):
                assert [n for n, _ in model.named_modules()] == names
                assert list(model.state_dict().keys()) == keys
                assert all(p is params[n] for n, p in model.named_parameters())
                out = model(x)
            assert (out - base).abs().max() > 1e-3, mode  # not the base weights alone
            assert_no_runtime_left(model)
            assert torch.equal(model(x), base)


def test_a_forward_patched_by_someone_else_is_chained_and_restored(files):
    model = TinyWanLike(dtype=torch.float32)
    lin = model.blocks[0].ffn[0]
    calls = []

    def theirs(x, _orig=type(lin).forward.__get__(lin)):
        calls.append(1)
        return _orig(x)
    lin.forward = theirs
    x = torch.randn(3, lin.in_features)
    with torch.no_grad(), applied(model, plan(model, [AdapterSpec(str(files["style"]))], "dynamic"),
                                  fusion_backend=None):
        with_adapter = lin(x)
        assert calls == [1]  # their patch still ran, under ours
    assert lin.__dict__["forward"] is theirs
    assert not torch.equal(with_adapter, lin(x))


@pytest.mark.parametrize("mode", ["merge", "auto"])
def test_layers_the_host_refuses_stay_dynamic_while_the_rest_merges(files, mode):
    """A host refusal (ComfyUI patches that weight itself) keeps that one layer dynamic:
    the output is the all-dynamic one, only the other layers' weights change while applied,
    and every weight comes back bit for bit."""
    model = TinyWanLike(dtype=torch.bfloat16)
    snap = _snapshot(model)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    spec = [AdapterSpec(str(files["style"]))]
    with torch.no_grad():
        dynamic, _ = _run(model, spec, "dynamic", x=x)
        p = plan(model, spec, mode, "exact")
        p.merge_refusals = {"blocks.0.ffn.0": "host patches it"}
        with applied(model, p, fusion_backend=None) as rep:
            held = model.blocks[0].ffn[0].weight.detach().clone()
            other = model.blocks[0].ffn[2].weight.detach().clone()
            out = model(x)
    d = rep.decision
    assert d.chosen == "merge" and d.kept_dynamic == {"blocks.0.ffn.0": "host patches it"}
    assert d.to_dict()["kept_dynamic"] == 1 and "host patches it" in d.reason
    assert torch.equal(held, snap["blocks.0.ffn.0.weight"])               # not merged into
    assert not torch.equal(other, snap["blocks.0.ffn.2.weight"])          # merged
    assert (out.float() - dynamic.float()).abs().max() < 0.05 * dynamic.float().abs().max()
    _assert_same_state(model, snap)


def test_restore_follows_a_weight_that_moved_and_refuses_one_that_was_cast(files):
    from comfyui_lora_runtime.lora_runtime import RestoreError
    model = TinyWanLike(dtype=torch.bfloat16)
    snap = _snapshot(model)
    inj = LoraInjector(model)
    inj.apply(plan(model, [AdapterSpec(str(files["style"]))], "merge"))
    lin = model.blocks[0].ffn[0]
    lin.weight.data = lin.weight.data.clone()   # new storage, same values (what an offload and back does)
    inj.clear()
    _assert_same_state(model, snap)
    inj.apply(plan(model, [AdapterSpec(str(files["style"]))], "merge"))
    lin.weight.data = lin.weight.data.half()    # cast while merged: no bit-exact way back
    with pytest.raises(RestoreError, match=r"blocks.0.ffn.0.*cast or replaced.*dynamic"):
        inj.clear()


@pytest.mark.parametrize("mode", ["auto", "dynamic", "merge"])
def test_an_update_that_overflows_fp16_is_an_error_in_every_mode(tmp_path, mode):
    """Before: auto read 'would round away inf %', kept it dynamic, and sampling gave inf."""
    model = TinyWanLike(dtype=torch.float16)
    snap = _snapshot(model)
    pairs = make_adapter_tensors(TinyWanLike(), r=2, seed=5, scale=1.0, only=["ffn.0"])
    pairs = {k: (d * 300.0, u * 300.0) for k, (d, u) in pairs.items()}  # |dW| ~ 1e5 > fp16 max 65504
    path = write_kohya(tmp_path / "huge.safetensors", pairs, alpha=2.0)
    with pytest.raises(NonFiniteMergeError, match=r"huge.safetensors.*blocks.\d.ffn.0.*(float16|non-finite).*[Ll]ower (its|the) strength"):
        _run(model, [AdapterSpec(str(path))], mode, x=torch.randn(2, 5, 32).half())
    _assert_same_state(model, snap)
