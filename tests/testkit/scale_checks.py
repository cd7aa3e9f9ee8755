"""Scale-source checks shared by the adapter-file tests (their `model` and `pairs` fixtures
are in tests/lora_runtime/files/conftest.py): PEFT state dicts, the applied output against
a hand-scaled reference and the wrong scale, and the report's scale source."""
import torch

from comfyui_lora_runtime.lora_runtime import AdapterSpec, applied, load_adapter, match_adapter, plan

R = 4  # the rank of the `pairs` fixture


def peft_sd(pairs, prefix="base_model.model."):
    sd = {}
    for name, (down, up) in pairs.items():
        sd[f"{prefix}{name}.lora_A.weight"] = down.contiguous()
        sd[f"{prefix}{name}.lora_B.weight"] = up.contiguous()
    return sd


def applied_output(model, path, x):
    with torch.no_grad(), applied(model, plan(model, [AdapterSpec(str(path))], "dynamic", "exact"),
                                  fusion_backend=None):
        return model(x)


def expected_output(model, pairs, scales, x):
    """The model's output with each layer's delta at its intended scale, by hand."""
    import copy
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, (down, up) in pairs.items():
            m.get_submodule(name).weight += (up.double() @ down.double()).float() * scales(name)
        return m(x)


def check_scale(model, pairs, path, scales, x, source_word):
    got = applied_output(model, path, x)
    want = expected_output(model, pairs, scales, x)
    wrong = expected_output(model, pairs, lambda n: 1.0, x)   # the scale the loader used to apply
    scale = want.abs().max()  # fp32 forward: tolerance relative to the output's size
    err, off = (got - want).abs().max() / scale, (wrong - want).abs().max() / scale
    assert err < 1e-5 and off > 100 * err, (float(err), float(off))
    _, cov = match_adapter(load_adapter(path), model)
    assert source_word in cov.to_dict()["scale_source"], cov.to_dict()["scale_source"]
    return cov


X = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
