"""Every dialect file, through the real loader and wrapper: zero unmatched keys, and the
dense delta applied to each native module (dynamic and merged) equals the expected one
computed by `_dialect_models.make_dialect_file` independently of the resolver.

fp32 tolerance rel <= 1e-6: the delta is one fp32 product of fp32 factors (a few ulps);
the wrong answers (adapter off; slices ignored = the first slice's update over the
fused weight's first rows only) are off by O(1)."""
import pytest
import torch
from safetensors.torch import save_file

from comfyui_lora_runtime.lora_runtime import AdapterSpec, applied, load_adapter, match_adapter, plan
from comfyui_lora_runtime.lora_runtime.layer.wrapper import attached_wrapper

from testkit.dialect_models import ALL_MODELS, DIALECT_FILES, MODELS, MORE_DIALECT_FILES, make_dialect_file

FILES = {**DIALECT_FILES, **MORE_DIALECT_FILES}   # the seven families, then Chroma, Z-Image, HunyuanVideo


@pytest.mark.parametrize("dialect", list(FILES))
def test_dialect_file_applies_its_exact_delta(tmp_path, dialect):
    family, _, _, _, label = FILES[dialect]
    model = ALL_MODELS[family]()
    tensors, expected = make_dialect_file(dialect, model, rank=4, seed=1)
    path = tmp_path / "a.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    layers, cov = match_adapter(load_adapter(path), model)
    assert cov.unmatched == {} and cov.keys_applied == cov.keys_total == len(tensors)
    assert set(layers) == set(expected)
    assert cov.format.startswith(label), cov.format
    before = {n: m.weight.detach().clone() for n, m in model.named_modules() if n in expected}
    for mode in ("dynamic", "merge"):
        with torch.no_grad(), applied(model, plan(model, [AdapterSpec(str(path))], mode, "lossless"),
                                      fusion_backend=None):
            for name, want in expected.items():
                mod = model.get_submodule(name)
                w = attached_wrapper(mod)
                if mode == "merge":
                    got = mod.weight.double() - before[name].double()
                    tol = 4 * torch.finfo(torch.float32).eps * before[name].abs().max().item()
                    err = (got - want).abs().max().item()
                    assert err <= tol + 1e-6 * want.abs().max().item(), (name, err)
                else:
                    got = w.delta_rows(slice(None)).double()
                    rel = ((got - want).norm() / want.norm()).item()
                    assert rel <= 1e-6, (dialect, name, rel)
                    x = torch.randn(3, mod.in_features, generator=torch.Generator().manual_seed(2))
                    y = mod(x).double() - torch.nn.functional.linear(x, before[name], mod.bias).double()
                    ref = x.double() @ want.T
                    assert ((y - ref).norm() / ref.norm()).item() < 1e-5, (dialect, name)
                    assert ((y).norm() / ref.norm()).item() > 0.5  # the adapter is there at all
        for name in expected:  # restored bit for bit
            assert torch.equal(model.get_submodule(name).weight, before[name])


def test_sliced_file_differs_from_reading_slices_as_whole_weights(tmp_path):
    """The wrong answer a slice-blind loader gives: q's update on the first rows only."""
    model = MODELS["Flux"]()
    tensors, expected = make_dialect_file("Flux diffusers", model, rank=4, seed=3)
    qkv = next(n for n in expected if n.endswith("img_attn.qkv"))
    want = expected[qkv]
    h = want.shape[0] // 3
    only_q = torch.zeros_like(want)
    only_q[:h] = want[:h]
    assert ((want - only_q).norm() / want.norm()).item() > 0.5


def test_matching_a_cached_adapter_twice_gives_the_same_updates(tmp_path):
    """The adapter cache hands the same loaded file to every run: matching must not change
    it (a second run would otherwise swap [scale, shift] back, or lose a slice's diff_b)."""
    model = MODELS["Flux"]()
    tensors, expected = make_dialect_file("Flux diffusers", model, rank=4, seed=4)
    q = next(k for k in tensors if k.endswith("transformer_blocks.0.attn.to_q.lora_B.weight"))
    tensors[q.replace(".lora_B.weight", ".diff_b")] = torch.randn(tensors[q].shape[0])
    assert any("norm_out.linear" in k for k in tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "f.safetensors"))
    adapter = load_adapter(tmp_path / "f.safetensors")
    first, _ = match_adapter(adapter, model)
    second, _ = match_adapter(adapter, model)
    for name, la in first.items():
        v1, v2 = la.update, second[name].update
        assert torch.equal(v1.delta(), v2.delta()), name
        b1, b2 = v1.bias_delta(), v2.bias_delta()
        assert (b1 is None) == (b2 is None) and (b1 is None or torch.equal(b1, b2)), name
    qkv = next(n for n in first if n.endswith("double_blocks.0.img_attn.qkv"))
    assert first[qkv].update.bias_delta() is not None
    final = next(n for n in first if n.endswith("final_layer.adaLN_modulation.1"))
    assert torch.allclose(first[final].update.delta().double(), expected[final], rtol=1e-5, atol=1e-7)
