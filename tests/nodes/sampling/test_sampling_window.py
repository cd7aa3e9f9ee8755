"""The sampling window: our adapters go on right after the host loads the model
(PREPARE_SAMPLING) and come off when the whole sampling ends (OUTER_SAMPLE), so a model layer that
runs while the conditions are prepared (LTX-2's text connectors in ComfyUI) runs with its adapter,
and the first-call check counts it as run."""
import torch
import torch.nn.functional as F

from comfyui_lora_runtime.standalone.host.model_patcher import PREPARE_SAMPLING
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter, LoraMergeMode
from testkit.fixtures import write_kohya
from testkit.nodes_helpers import _sample, _unloaded_weights, _weights

ALPHA, R = 4.0, 4


def _probe_model(base, seen):
    """A clone whose PREPARE_SAMPLING wrapper (outside ours: registered first) runs the text
    embedding's first Linear after the model is prepared, as condition processing would."""
    def probe(executor, patcher, *args, **kwargs):
        out = executor(patcher, *args, **kwargs)
        lin = patcher.get_model_object("diffusion_model").text_embedding[0]
        x = torch.linspace(-1, 1, 2 * lin.in_features).reshape(2, lin.in_features)
        seen.append((x, lin(x)))
        return out
    m = base.clone()
    m.add_wrapper_with_key(PREPARE_SAMPLING, "condition probe", probe)
    return m


def test_a_layer_run_while_conditions_are_prepared_carries_its_adapter(base, folders, models_dir):
    dm = base.get_model_object("diffusion_model")
    lin = dm.text_embedding[0]
    g = torch.Generator().manual_seed(3)
    down, up = torch.randn(R, lin.in_features, generator=g) * 0.2, torch.randn(lin.out_features, R, generator=g) * 0.2
    write_kohya(models_dir / "loras" / "text_embedding.safetensors", {"text_embedding.0": (down, up)}, alpha=ALPHA)
    w0 = _weights(base)
    for mode in ("dynamic", "merge"):
        seen = []
        m = LoadLoraAdapter().load(_probe_model(base, seen), "text_embedding.safetensors", 1.0)["result"][0]
        _, rep = _sample(LoraMergeMode().set_mode(m, mode)[0], steps=2)
        (x, y), = seen
        w1 = _unloaded_weights(base)                                # off again once the host unloads it
        assert all(torch.equal(w0[k], w1[k]) for k in w0), mode
        with torch.no_grad():
            base_out = F.linear(x, lin.weight, lin.bias)
            ref = base_out + (ALPHA / R) * F.linear(F.linear(x, down), up)
        assert (y - base_out).abs().max() > 1e-2, mode            # not the base layer alone
        # the worst-case bound of an fp32 dot product over n terms (n eps |W'| |x|, both sides' sums in
        # another order), plus for merge W + dW rounded once to the weight's dtype (half an ulp each)
        eps32, n = torch.finfo(torch.float32).eps, lin.in_features
        eps_w = torch.finfo(lin.weight.dtype).eps if mode == "merge" else 0.0
        bound = (0.5 * eps_w + 2 * n * eps32) * F.linear(x.abs(), (lin.weight.float() + (ALPHA / R) * up @ down).abs())
        assert ((y - ref).abs() <= bound).all(), (mode, float((y - ref).abs().max()))
        assert "ran_check" not in rep, rep.get("ran_check")         # it ran (before the first model call)
