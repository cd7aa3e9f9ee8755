"""A MODEL patched by Load LoRA Adapter, then compiled the way ComfyUI's TorchCompileModel does it
(an APPLY_MODEL wrapper added after ours that runs the diffusion model through torch.compile), is
sampled by the host's stock KSampler at several strengths and with a strength schedule: the
compiled graph is re-used (no recompile), and each image equals the uncompiled one.

Backend aot_eager: whether a call recompiles is dynamo's guard decision, the same for every
backend, and aot_eager functionalizes the graph as inductor does; inductor's C++ build of the
whole tiny DiT takes minutes on a busy CPU. Inductor itself: tests/lora_runtime/test_compile_safe.py."""
import torch

from comfyui_lora_runtime.standalone.host.core_nodes import KSampler
from comfyui_lora_runtime.standalone.host.model_patcher import APPLY_MODEL
from comfyui_lora_runtime.nodes import lifecycle, report
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter, LoraMergeMode, LoraQualityTier

from testkit.nodes_helpers import CondPos

STEPS, SEED, CFG = 3, 42, 5.0
# fp32 DiT over 3 Euler steps: the compiled adapter call scales h = x A^T by fp32 factor tensors
# where eager uses addmm_'s alpha (a few fp32 roundings per layer); latents of O(1) agree to ~1e-5
RTOL, ATOL = 1e-4, 1e-4
COMPILES = []


def _counting_backend(gm, example_inputs):
    COMPILES.append(gm)
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def _compile_model(model):
    """TorchCompileModel's shape: a clone whose APPLY_MODEL wrapper calls the compiled DiT."""
    m = model.clone()
    compiled = {}

    def wrapper(executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kw):
        dm = executor.class_obj
        if id(dm) not in compiled:
            compiled[id(dm)] = torch.compile(dm, backend=_counting_backend, dynamic=False)
        return compiled[id(dm)](x, t * 1000, c_crossattn)

    m.add_wrapper_with_key(APPLY_MODEL, "torch.compile", wrapper)
    return m


def _sample(model):
    pos, neg = CondPos().go("pos")[0], CondPos().go("neg")[0]
    latent = {"samples": torch.zeros(1, 16, 1, 8, 8)}
    return KSampler().sample(model, SEED, STEPS, CFG, "euler", "simple", pos, neg, latent, 1.0)[0]["samples"]


def _loaded(base, strength, schedule=""):
    m = LoadLoraAdapter().load(base, "style.safetensors", strength, strength_schedule=schedule)["result"][0]
    return LoraQualityTier().set_tier(LoraMergeMode().set_mode(m, "dynamic")[0], "lossless")[0]


def test_compiled_model_resampled_at_new_strengths_does_not_recompile(base):
    y_base = _sample(base)
    first = None
    outs = {}
    for strength, schedule in ((0.8, ""), (0.4, ""), (1.2, ""), (0.8, "1, 0.5, 0")):
        m = _loaded(base, strength, schedule)
        mc = _compile_model(m)
        got = _sample(mc)
        r = lifecycle.last_report(mc)  # the report says whether this sampling compiled anything
        if first is None:
            first = len(COMPILES)
            assert first == 1, "the DiT broke into several graphs: traced code read Python state (a context)"
            assert r["compile"]["graphs_compiled"] == 1
            assert "torch.compile compiled 1 graph(s) during this sampling" in report.text(r)
        else:
            assert "compile" not in r and "torch.compile" not in report.text(r), r.get("compile")
        want = _sample(m)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        assert (got - y_base).abs().max() > 1e-2  # the adapter is in the compiled model's output
        outs[(strength, schedule)] = got
    assert (outs[(0.4, "")] - outs[(1.2, "")]).abs().max() > 1e-2
    assert (outs[(0.8, "")] - outs[(0.8, "1, 0.5, 0")]).abs().max() > 1e-3  # the schedule reached the graph
    assert len(COMPILES) == first, "a strength or schedule change recompiled the DiT"
