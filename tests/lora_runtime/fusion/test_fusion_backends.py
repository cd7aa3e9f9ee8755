"""Sites and the kernel backend registry: an "auto" site runs the measured fastest of its
device's backends (or the unfused forward) per shape bucket and names it on the report;
use_backend forces one; a backend that fails its probe is dropped and named; the K-concat
cache's memory is on the report. The measured choice runs on CUDA; here it is pointed at
the CPU with a scripted timer, so the choice logic is tested without a GPU."""
import pytest
import torch

from comfyui_lora_runtime.kernels import registry, use_backend
from comfyui_lora_runtime.lora_runtime import AdapterSpec, LoraInjector, plan, runtime_context
from comfyui_lora_runtime.lora_runtime.fusion import fusion_sites as fs
from comfyui_lora_runtime.lora_runtime.fusion.fusion_sites import mount_fusions
from comfyui_lora_runtime.lora_runtime.layer.wrapper import attached_wrapper

from testkit.fixtures import lora_pair, write_kohya
from testkit.sites import FC1, SiteZoo

SITES = ["blocks.0.ffn", "ff.net.0", "mlp"]


@pytest.fixture
def dyn_model(tmp_path):
    model = SiteZoo()
    pairs = {n: lora_pair(model.get_submodule(n).out_features, model.get_submodule(n).in_features, 4, i, 0.25)
             for i, n in enumerate(FC1)}
    path = write_kohya(tmp_path / "dyn.safetensors", pairs, alpha=2.0, prefix=None)
    inj = LoraInjector(model)
    inj.apply(plan(model, [AdapterSpec(str(path), 0.8)], "dynamic", "lossless"))
    yield model
    inj.clear()


def scripted(fastest: str, timed: list):
    """A timer that runs each path once and says `fastest` took 1 ms, every other 2 ms."""
    def timer(fn, name):
        fn()
        timed.append(name)
        return 1.0 if name == fastest else 2.0
    return timer


def _x():
    return torch.randn(2, 9, 24, generator=torch.Generator().manual_seed(3))


def _run(model, x, backend="auto"):
    with torch.no_grad(), runtime_context(tier="lossless"):
        m = mount_fusions(model, "lossless", backend=backend)
        y = model(x)
        m.unmount()
        ref = model(x)  # unmounted: the wrapper's own (unfused) lossless forward
    return m, y, ref


@pytest.mark.parametrize("fastest", ["delta_first", "kconcat_cached", "kconcat_rebuilt"])
def test_auto_runs_the_measured_fastest_backend_and_names_it(dyn_model, monkeypatch, fastest):
    timed = []
    monkeypatch.setattr(registry, "MEASURED", registry.MeasuredChoice(("cpu",), scripted(fastest, timed)))
    m, y, ref = _run(dyn_model, _x())
    assert len(m.sites) == 3, m.report()
    # one measurement per shape bucket: the three sites share (24 -> 40, rank 4, 18 rows)
    assert timed == ["delta_first", "kconcat_cached", "kconcat_rebuilt", "torch", "unfused"]
    for r in m.report():
        assert r["backends"]["lora_linear"] == ["delta_first", "kconcat_cached", "kconcat_rebuilt", "torch"]
        assert r["ran"] == {f"lora_fused:{fastest}": 1}, r
        # the K-concat cache is held (and reported: [W | B] = 40 x (24 + 4) fp32) only where it is used
        assert r.get("cache_bytes", 0) == (40 * 28 * 4 if fastest == "kconcat_cached" else 0), r
    rec = m.report()[0]["measured"]
    assert list(rec) == ["lora M<=32 R=4"] and rec["lora M<=32 R=4"]["chosen"] == fastest
    assert torch.allclose(y, ref, atol=1e-5) and not torch.allclose(y, ref, atol=0)
    assert all(s.state == {} for s in m.sites)  # unmounting drops the cache


def test_auto_keeps_eager_where_it_measures_faster(dyn_model, monkeypatch):
    monkeypatch.setattr(registry, "MEASURED", registry.MeasuredChoice(("cpu",), scripted("unfused", [])))
    m, y, ref = _run(dyn_model, _x())
    assert all(r["routes"] == {"unfused (measured faster here)": 1} and r["ran"] == {} for r in m.report())
    assert all("cache_bytes" not in r for r in m.report())
    assert torch.equal(y, ref)


def test_auto_base_path_when_the_adapter_is_off(dyn_model, monkeypatch):
    monkeypatch.setattr(registry, "MEASURED", registry.MeasuredChoice(("cpu",), scripted("torch", [])))
    for n in FC1:
        attached_wrapper(dyn_model.get_submodule(n)).set_enabled("dyn.safetensors", False)
    m, y, ref = _run(dyn_model, _x())
    # on the CPU neither cuBLASLt (CUDA only) nor the Triton interpreter is an "auto" candidate
    assert all(r["backends"]["linear_gelu_tanh"] == ["torch"] for r in m.report())
    assert all(r["ran"] == {"base_fused:torch": 1} for r in m.report())
    assert torch.allclose(y, ref, atol=1e-5)


def test_use_backend_forces_auto_sites(dyn_model, monkeypatch):
    timed = []
    monkeypatch.setattr(registry, "MEASURED", registry.MeasuredChoice(("cpu",), scripted("delta_first", timed)))
    with use_backend("kconcat_rebuilt"):
        m, y, ref = _run(dyn_model, _x())
    assert timed == [] and all(r["ran"] == {"lora_fused:kconcat_rebuilt": 1} for r in m.report())


def test_a_backend_failing_its_probe_is_dropped_and_named(dyn_model, monkeypatch):
    monkeypatch.setattr(registry, "MEASURED", registry.MeasuredChoice(("cpu",), scripted("kconcat_rebuilt", [])))
    real = fs.lora_linear

    def flaky(*a, backend, **k):
        if backend == "kconcat_rebuilt":
            raise RuntimeError("no kernel image for this GPU")
        return real(*a, backend=backend, **k)
    monkeypatch.setattr(fs, "lora_linear", flaky)
    m, y, ref = _run(dyn_model, _x())
    assert len(m.sites) == 3
    for r in m.report():
        assert "kconcat_rebuilt" not in r["backends"]["lora_linear"]
        assert "no kernel image" in r["dropped"]["lora_linear/kconcat_rebuilt"]
        assert r["ran"] == {"lora_fused:delta_first": 1}  # the fastest left (scripted: others tie)


def test_named_backends_and_their_refusals(dyn_model):
    m, y, ref = _run(dyn_model, _x(), backend={"lora_linear": "delta_first", "linear_gelu_tanh": "torch"})
    assert all(r["ran"] == {"lora_fused:delta_first": 1} for r in m.report())
    with pytest.raises(ValueError, match="unknown linear_gelu_tanh backend 'delta_first'"):
        mount_fusions(dyn_model, "lossless", backend="delta_first")  # the base op has no such backend
    m = mount_fusions(dyn_model, "lossless", backend={"linear_gelu_tanh": "cublaslt", "lora_linear": "torch"})
    assert m.sites == [] and all("runs on cuda, not cpu" in v for v in m.skipped.values())
