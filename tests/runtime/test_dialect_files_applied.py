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
from comfyui_lora_runtime.lora_runtime.wrapper import attached_wrapper

from _dialect_models import DIALECT_FILES, MODELS, make_dialect_file


@pytest.mark.parametrize("dialect", list(DIALECT_FILES))
def test_dialect_file_applies_its_exact_delta(tmp_path, dialect):
    family, _, _, _, label = DIALECT_FILES[dialect]
    model = MODELS[family]()
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
