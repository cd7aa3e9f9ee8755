"""Fusion sites under a strength schedule or a branch (issue 12): the scheduled multiplier
reaches the LoRA-aware fused kernel as its scale, a call scheduled to 0 takes the base fused
epilogue, and a per-branch adapter in a batched CFG call reaches the backends that take a
per-row scale as one (its row mask in h) and runs unfused, reported with why, on the others."""
import pytest
import torch

from comfyui_lora_runtime.kernels.registry import interpreting, triton_importable
from comfyui_lora_runtime.lora_runtime import AdapterSpec, LoraInjector, plan, runtime_context
from comfyui_lora_runtime.lora_runtime.fusion.fusion_sites import mount_fusions

from testkit.fixtures import lora_pair, write_kohya
from testkit.sites import FC1, SiteZoo, routes_of

POS_ROWS = torch.tensor([0.0, 0.0, 1.0, 1.0])  # CFG batch, negative rows first


@pytest.mark.parametrize("backend", ["torch", "triton", "delta_first", "kconcat_cached"])
def test_fused_site_takes_the_scheduled_scale_and_the_branch(tmp_path, backend):
    if backend == "triton" and not (triton_importable() and (torch.cuda.is_available() or interpreting())):
        pytest.skip("the Triton kernels need CUDA or TRITON_INTERPRET=1")
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    model = SiteZoo().to(dev)
    pairs = {n: lora_pair(model.get_submodule(n).out_features, model.get_submodule(n).in_features, 4, i, 0.2)
             for i, n in enumerate(FC1)}
    path = write_kohya(tmp_path / "a.safetensors", pairs, alpha=2.0, prefix=None)
    x = torch.randn(4, 7, 24, generator=torch.Generator().manual_seed(0)).to(dev)
    inj = LoraInjector(model)
    inj.apply(plan(model, [AdapterSpec(str(path), 0.8, "a")], "dynamic", "lossless"))
    try:
        with torch.no_grad(), runtime_context(tier="lossless"):
            unfused = {}
            with runtime_context(adapters={"a": (0.5, None)}):
                unfused[0.5] = model(x)
            with runtime_context(adapters={"a": (0.0, None)}):
                unfused[0.0] = model(x)
            with runtime_context(adapters={"a": (1.0, POS_ROWS.to(dev))}):
                unfused["pos"] = model(x)
            constant = model(x)
            mounted = mount_fusions(model, "lossless", backend={"lora_linear": backend,
                                                                "linear_gelu_tanh": "triton" if backend == "triton"
                                                                else "torch"})
            fused = {}
            with runtime_context(adapters={"a": (0.5, None)}):
                fused[0.5] = model(x)
            r_half = dict(routes_of(mounted))
            with runtime_context(adapters={"a": (0.0, None)}):
                fused[0.0] = model(x)
            r_zero = dict(routes_of(mounted))
            with runtime_context(adapters={"a": (1.0, POS_ROWS.to(dev))}):
                fused["pos"] = model(x)
            r_pos = dict(routes_of(mounted))
            mounted.unmount()
    finally:
        inj.clear()
    assert r_half == {"lora_fused": 3}                                 # the scheduled scale through the kernel
    assert r_zero == {"lora_fused": 3, "base_fused": 3}                # 0: the base fused epilogue
    if backend == "triton":  # the Triton kernel takes a per-rank scale only
        per_branch = [k for k in r_pos if "per-branch adapter" in k]  # reported, with why
        assert len(per_branch) == 1 and r_pos == {"lora_fused": 3, "base_fused": 3, per_branch[0]: 3}, r_pos
        assert "per-rank scale" in per_branch[0]
        assert torch.equal(fused["pos"], unfused["pos"])               # unfused route: the same eager path
    else:  # the row mask rides in h: the per-branch call is fused too
        assert r_pos == {"lora_fused": 6, "base_fused": 3}, r_pos
        assert not torch.allclose(fused["pos"], unfused[0.0], atol=1e-3)  # the wrong answer: adapter dropped
    for k in (0.5, 0.0, "pos"):  # fp32; Triton sums the K products in its own order (hence 1e-4 there)
        tol = 1e-5 if backend != "triton" else 1e-4
        torch.testing.assert_close(fused[k], unfused[k], rtol=tol, atol=tol)
    assert not torch.allclose(fused[0.5], constant, atol=1e-3)          # the wrong answer: schedule ignored
    assert not torch.allclose(fused[0.0], constant, atol=1e-3)
    assert not torch.allclose(fused["pos"], constant, atol=1e-3)        # the wrong answer: mask ignored


