"""Fusion sites and their guards (contracts.md s.1 and s.4)."""
import copy

import pytest
import torch
from torch import nn

from comfyui_lora_runtime.lora_runtime import AdapterSpec, LoraInjector, applied, plan, runtime_context
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
from comfyui_lora_runtime.lora_runtime.fusion.fusion_sites import find_sites, mount_fusions

from testkit.fixtures import lora_pair, write_kohya
from testkit.sites import FC1, SiteZoo, routes_of

SITES = ["blocks.0.ffn", "ff.net.0", "mlp"]


def _adapter_file(tmp_path, model, names, seed=1, scale=0.2, diff_b=False):
    pairs = {}
    for i, n in enumerate(names):
        m = model.get_submodule(n)
        pairs[n] = lora_pair(m.out_features, m.in_features, 4, seed * 100 + i, scale)
    path = write_kohya(tmp_path / f"a{seed}.safetensors", pairs, alpha=2.0, prefix=None)
    return path


def _x(dtype=torch.float32, seed=0):
    return torch.randn(3, 7, 24, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_sites_found_by_structure():
    sites = {s.path: s.kind for s in find_sites(SiteZoo())}
    assert sites == {"blocks.0.ffn": "sequential", "ff.net.0": "proj_gelu", "mlp": "mlp"}


def test_unmount_restores_output_bit_for_bit(tmp_path):
    model = SiteZoo(dtype=torch.bfloat16)
    x = _x(torch.bfloat16)
    inj = LoraInjector(model)
    inj.apply(plan(model, [AdapterSpec(str(_adapter_file(tmp_path, model, FC1)))], "dynamic", "lossless"))
    with torch.no_grad(), runtime_context(tier="lossless"):
        before = model(x)
        mounted = mount_fusions(model, "lossless", backend="torch")
        assert len(mounted.sites) == 3
        during = model(x)
        mounted.unmount()
        after = model(x)
    assert torch.equal(before, after)
    assert routes_of(mounted) == {"lora_fused": 3}
    assert not torch.equal(before, during)  # the fused path really ran (fp32 epilogue, one rounding)
    assert all("forward" not in s.spec.module.__dict__ for s in mounted.sites)
    inj.clear()


def test_exact_tier_mounts_nothing_and_exact_context_never_fuses(tmp_path):
    model = SiteZoo()
    assert mount_fusions(model, "exact", backend="torch").sites == []
    mounted = mount_fusions(model, "lossless", backend="torch")
    x = _x()
    with torch.no_grad(), runtime_context(tier="exact"):
        y = model(x)
    mounted.unmount()
    with torch.no_grad():
        assert torch.equal(y, model(x))
    assert sum(sum(s.routes.values()) for s in mounted.sites) == sum(s.routes["unfused"] for s in mounted.sites) == 3




def test_call_guard_follows_the_adapter_state(tmp_path):
    model = SiteZoo(dtype=torch.bfloat16)
    x = _x(torch.bfloat16)
    f = _adapter_file(tmp_path, model, FC1)
    inj = LoraInjector(model)
    cases = {}
    for label, mode, strength in [("dynamic", "dynamic", 1.0), ("off", "dynamic", 0.0), ("merged", "merge", 1.0)]:
        inj.apply(plan(model, [AdapterSpec(str(f), strength)], mode, "lossless"))
        m = mount_fusions(model, "lossless", backend="torch")
        with torch.no_grad(), runtime_context(tier="lossless"):
            model(x)
        m.unmount()
        cases[label] = routes_of(m)
    inj.clear()
    assert cases["dynamic"] == {"lora_fused": 3}
    assert cases["off"] == {"base_fused": 3}     # strength 0: nothing to add, base epilogue is right
    assert cases["merged"] == {"base_fused": 3}  # the weight holds the update


def test_active_adapter_without_the_lora_kernel_goes_unfused(tmp_path):
    model = SiteZoo()
    x = _x()
    inj = LoraInjector(model)
    inj.apply(plan(model, [AdapterSpec(str(_adapter_file(tmp_path, model, FC1)))], "dynamic", "lossless"))
    with torch.no_grad(), runtime_context(tier="lossless"):
        ref = model(x)
        m = mount_fusions(model, "lossless", backend="torch", only=["linear_gelu_tanh"])
        y = model(x)
        m.unmount()
    assert routes_of(m) == {"unfused": 3} and torch.equal(y, ref)
    inj.clear()


def test_offsets_and_dora_are_never_fused_with_the_base_weight():
    model = SiteZoo()
    fc1 = model.blocks[0].ffn[0]
    inj = LoraInjector(model)
    w = inj._wrap("blocks.0.ffn.0")
    w.add_adapter("off", LayerAdapter("x", diff_b=torch.ones(40)), 1.0)
    w.merge()  # merged, but diff_b is an output offset: still active
    x = _x()
    m = mount_fusions(model, "lossless", backend="torch")
    with torch.no_grad(), runtime_context(tier="lossless"):
        y = model.blocks[0].ffn(x)
    m.unmount()
    with torch.no_grad():
        expect = model.blocks[0].ffn(x)
    assert torch.equal(y, expect)
    assert m.sites[0].routes == {"unfused (an output offset (diff_b) rides on the layer)": 1}
    w.unmerge()
    w.remove_adapter("off")
    d, u = lora_pair(40, 24, 2, 5, 0.3)
    w.add_adapter("dora", LayerAdapter("x", down=d, up=u, dora_scale=fc1.weight.detach().norm(dim=1)), 1.0)
    m = mount_fusions(model, "lossless", backend="torch")
    with torch.no_grad(), runtime_context(tier="lossless"):
        model.blocks[0].ffn(x)
    m.unmount()
    assert m.sites[0].routes == {"unfused (dora update: a fused kernel takes plain LoRA only)": 1}
    w.remove_adapter("dora")
    from comfyui_lora_runtime.lora_runtime import updates
    g = torch.Generator().manual_seed(3)
    loha = updates.LoHa(*(torch.randn(s_, generator=g) * 0.3 for s_ in ((40, 2), (2, 24), (40, 2), (2, 24))))
    w.add_adapter("loha", LayerAdapter("x", update=loha), 1.0)
    m = mount_fusions(model, "lossless", backend="torch")
    with torch.no_grad(), runtime_context(tier="lossless"):
        y = model.blocks[0].ffn(x)
    m.unmount()
    with torch.no_grad(), runtime_context(tier="lossless"):
        expect = model.blocks[0].ffn(x)
    assert torch.equal(y, expect)  # the unfused path with the LoHa applied, never the base alone
    w.set_enabled("loha", False)
    with torch.no_grad(), runtime_context(tier="lossless"):
        assert not torch.allclose(y, model.blocks[0].ffn(x), rtol=1e-3, atol=1e-3)
    assert m.sites[0].routes == {"unfused (loha update: a fused kernel takes plain LoRA only)": 1}
    inj.clear()


class PackedWeight(torch.Tensor):
    pass


@pytest.mark.parametrize("attr,value,why", [
    ("weight_function", [lambda w: w], "weight/bias-function"),
    ("comfy_cast_weights", True, "cast/offloaded"),
    ("gather_output", True, "gather_output"),
    ("scale_weight", torch.tensor(1.0), "scale_weight"),
])
def test_static_guard_reads_the_wrapped_layer(attr, value, why):
    model = SiteZoo()
    setattr(model.blocks[0].ffn[0], attr, value)
    inj = LoraInjector(model)
    w = inj._wrap("blocks.0.ffn.0")
    # a wrapper that hid the attribute would fool a duck-typed guard; ours judges base_layer
    object.__setattr__(w, attr, None) if attr in w.__dict__ else None
    m = mount_fusions(model, "lossless", backend="torch")
    assert "blocks.0.ffn" in m.skipped and why in m.skipped["blocks.0.ffn"]
    assert {s.spec.path for s in m.sites} == {"ff.net.0", "mlp"}
    m.unmount()
    inj.clear()


def test_quantized_weight_is_not_mounted():
    model = SiteZoo()
    lin = model.mlp.fc1
    lin.weight = nn.Parameter(lin.weight.detach().as_subclass(PackedWeight), requires_grad=False)
    m = mount_fusions(model, "lossless", backend="torch")
    assert "quantized" in m.skipped["mlp"]


def test_auto_backend_does_not_mount_on_cpu():
    m = mount_fusions(SiteZoo(), "lossless")
    if not torch.cuda.is_available():
        assert m.sites == [] and all("no CUDA device" in v for v in m.skipped.values())


def test_applied_mounts_reports_and_unmounts(tmp_path):
    model = SiteZoo()
    snap = copy.deepcopy(model.state_dict())
    x = _x()
    spec = [AdapterSpec(str(_adapter_file(tmp_path, model, FC1)))]
    with torch.no_grad(), applied(model, plan(model, spec, "dynamic", "lossless"), fusion_backend="torch") as rep:
        model(x)
    assert {r["site"] for r in rep.fusions} == {"blocks.0.ffn", "ff.net.0", "mlp"}
    assert all(r["routes"] == {"lora_fused": 1} for r in rep.fusions)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())


def test_a_kernel_that_fails_its_probe_leaves_the_site_unmounted(tmp_path, monkeypatch):
    import comfyui_lora_runtime.lora_runtime.fusion.fusion_sites as fs

    def broken(*a, **k):
        raise RuntimeError("PTX not supported on this GPU")
    monkeypatch.setattr(fs, "lora_linear", broken)
    model = SiteZoo()
    x = _x()
    inj = LoraInjector(model)
    inj.apply(plan(model, [AdapterSpec(str(_adapter_file(tmp_path, model, FC1)))], "dynamic", "lossless"))
    with torch.no_grad(), runtime_context(tier="lossless"):
        ref = model(x)
        m = mount_fusions(model, "lossless", backend="torch")
        y = model(x)
        m.unmount()
    assert torch.equal(y, ref) and m.sites == []
    assert set(m.skipped) == set(SITES) and all("PTX not supported" in v for v in m.skipped.values())
    assert all(r["fusions"] == [] and "failed its probe" in r["skipped"] for r in m.report())
    inj.clear()


def test_a_kernel_that_computes_wrong_in_its_probe_is_not_mounted(monkeypatch):
    import comfyui_lora_runtime.lora_runtime.fusion.fusion_sites as fs
    monkeypatch.setattr(fs, "linear_gelu_tanh", lambda x, w, b, backend: torch.zeros(x.shape[0], w.shape[0]))
    m = mount_fusions(SiteZoo(), "lossless", backend="torch")
    assert m.sites == [] and all("computed wrong" in v for v in m.skipped.values())


def test_an_error_while_sampling_propagates_after_the_restore(tmp_path, monkeypatch):
    """Once mounted nothing is caught: an out-of-memory inside a fused kernel ends the
    run with that error, and applied() has restored every weight and forward by then."""
    import comfyui_lora_runtime.lora_runtime.fusion.fusion_sites as fs
    model = SiteZoo()
    snap = copy.deepcopy(model.state_dict())
    spec = [AdapterSpec(str(_adapter_file(tmp_path, model, FC1)))]
    real = fs.lora_linear
    calls = {"n": 0}

    def fails_after_probe(*a, **k):
        calls["n"] += 1
        if calls["n"] > len(SITES):  # the probes pass, the first call while sampling fails
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*a, **k)
    monkeypatch.setattr(fs, "lora_linear", fails_after_probe)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        with torch.no_grad(), applied(model, plan(model, spec, "dynamic", "lossless"),
                                      fusion_backend="torch"):
            model(_x())
    assert all("forward" not in m.__dict__ and "_lora_runtime" not in m.__dict__ for m in model.modules())
    assert all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())
