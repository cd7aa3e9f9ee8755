"""Every registered fusion picks a side (contracts.md s.1).

Side (a): mounted alone on a site whose linears carry a *dynamic* adapter, the output
equals the unfused forward within the tier and differs from the base-weight-only
output. Side (b): a written reason why it cannot drop an adapter's output.
"""
import pytest
import torch

from comfyui_lora_runtime.kernels import registry
from comfyui_lora_runtime.lora_runtime import AdapterSpec, LoraInjector, plan, runtime_context
from comfyui_lora_runtime.lora_runtime.fusion import fusion_sites
from comfyui_lora_runtime.lora_runtime.fusion.fusion_registry import FUSIONS, Fusion, register
from comfyui_lora_runtime.lora_runtime.fusion.fusion_sites import mount_fusions
from comfyui_lora_runtime.lora_runtime.settings import Tier
from comfyui_lora_runtime.lora_runtime.layer.wrapper import attached_wrapper

from testkit.fixtures import assert_lossless, lora_pair, write_kohya
from testkit.sites import FC1, SiteZoo


def test_a_fusion_that_picks_no_side_cannot_register():
    with pytest.raises(ValueError, match="must pick a side"):
        register(Fusion("sneaky_gemm", Tier.LOSSLESS, "reads proj.weight"))
    assert "sneaky_gemm" not in FUSIONS


def _model_with_dynamic_adapter(tmp_path, dtype, device="cpu"):
    model = SiteZoo(dtype=dtype).to(device)
    names = FC1 + ["blocks.0.ffn.2", "ff.net.2", "mlp.fc2"]
    pairs = {n: lora_pair(model.get_submodule(n).out_features, model.get_submodule(n).in_features, 4, i, 0.25)
             for i, n in enumerate(names)}
    path = write_kohya(tmp_path / "dyn.safetensors", pairs, alpha=2.0, prefix=None)
    inj = LoraInjector(model)
    inj.apply(plan(model, [AdapterSpec(str(path), 0.8)], "dynamic", "lossless"))
    return model, inj


def _truth(model, x):
    """fp64 forward of the same model and adapters (exact path in double)."""
    import copy
    m64 = copy.deepcopy(model).double()
    for mod in [attached_wrapper(m) for m in m64.modules()]:
        if mod is not None:
            for s in mod.slots.values():
                s.update.clear_cache()
            mod.factor_cache.clear()
    with torch.no_grad(), runtime_context(tier="exact"):
        return m64(x.double())


# every fusion with every backend registered for its kernel op
CASES = [(n, b.name) for n in sorted(FUSIONS) for b in registry.backends(FUSIONS[n].op)]


def test_every_backend_of_every_fusion_is_covered():
    """The parametrisation below is built from the kernel registry: a new backend is in it."""
    names = {b for n, b in CASES}
    assert {"torch", "triton", "cublaslt", "delta_first", "kconcat_cached", "kconcat_rebuilt"} <= names
    assert all(any(c == (n, b.name) for c in CASES) for n in FUSIONS for b in registry.backends(FUSIONS[n].op))


@pytest.mark.parametrize("name,backend", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_fusion_picks_a_side(tmp_path, name, backend, dtype):
    fusion = FUSIONS[name]
    if not fusion.tested_with_dynamic_adapter:
        assert len(fusion.cannot_drop_reason) >= 20, name
        return
    # compiled kernels on a GPU when there is one (the interpreter on the CPU otherwise);
    # a named backend runs as named (no speed-based choice of path)
    be = registry.get(fusion.op, backend)
    device = "cuda" if "cuda" in be.devices and torch.cuda.is_available() else "cpu"
    why = be.why_not(torch.device(device), dtype)
    if why:
        pytest.skip(f"{fusion.op}/{backend} does not run here: {why}")
    model, inj = _model_with_dynamic_adapter(tmp_path, dtype, device)
    # 512 tokens: enough elements that the max-error statistic of the lossless rule is stable
    # (at 18 tokens the fp32 max error of two equally good paths differs by up to 1.8x by chance)
    x = torch.randn(8, 64, 24, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    with torch.no_grad():
        with runtime_context(tier="exact"):
            reference = model(x)  # the unfused eager forward
        with runtime_context(tier=fusion.min_tier):
            m = mount_fusions(model, fusion.min_tier, backend=backend, only=[name])
            assert len(m.sites) == 3, m.report()
            mounted = model(x)
            m.unmount()
        # the report names the backend each site ran (the base epilogue never runs over a live adapter)
        want = {"lora_fused:" + backend: 1} if fusion.op == "lora_linear" else {}
        assert all(r["ran"] == want for r in m.report()), m.report()
        # the wrong answer: each site's first linear without its adapter (base weight only)
        for fc1 in FC1:
            attached_wrapper(model.get_submodule(fc1)).set_enabled("dyn.safetensors", False)
        with runtime_context(tier="exact"):
            base_only = model(x)
        if fusion.op == "linear_gelu_tanh":  # with the adapter off the backend runs, within the tier
            with runtime_context(tier=fusion.min_tier):
                m = mount_fusions(model, fusion.min_tier, backend=backend, only=[name])
                fused_base = model(x)
                m.unmount()
            assert all(r["ran"] == {"base_fused:" + backend: 1} for r in m.report()), m.report()
            assert_lossless(fused_base.cpu(), base_only.cpu(), _truth(model, x).cpu(), name + " adapter off")
    mounted, reference, base_only = mounted.cpu(), reference.cpu(), base_only.cpu()
    assert_lossless(mounted, reference, _truth(_enable_all(model), x).cpu(), name)
    err = (mounted.float() - reference.float()).abs().mean()
    assert (mounted.float() - base_only.float()).abs().mean() > 30 * err, name
    inj.clear()


def _enable_all(model):
    for mod in [attached_wrapper(m) for m in model.modules()]:
        if mod is not None:
            for n in mod.slots:
                mod.set_enabled(n, True)
    return model
