"""The pack on ComfyUI 0.38.1's ModelPatcher shapes, simulated on the bundled host (0.38.1 cannot run
here): `testkit.comfy038_patcher.Patcher038` says what is simulated.

- ``fast_disk``: every node of ours that clones a MODEL hands back the host's own patcher class with
  the ``fast_disk`` it was built with (our clones go through the host's ``clone()``, never a
  constructor of ours), and the LoRA Sampler samples it;
- ``("config", ...)`` patches: the host turns one into an object patch of a module (a copy with
  the config); our clones keep that object patch untouched (the same object), our adapters go on the
  layers of the copy the host puts into the tree (a deep copy: new Linear objects), the output equals
  our run without the config patch bit for bit, the report counts no host-patched layer, and the
  module tree and weights are the base's after the host unloads;
- the ``"fooocus"`` weight patch (any weight patch type the engine does not read) on layers we adapt:
  the report counts and names those layers; merge mode keeps them dynamic; the output equals our
  adapter on the host-patched weight (the reference: the same bits written into the weight by hand),
  and differs from either patch alone; after the host unloads, the weights are the base's bit for bit.
"""
import copy

import pytest
import torch

from comfyui_lora_runtime.standalone.host import model_management
from comfyui_lora_runtime.lora_runtime.layer.wrapper import runtime_leftovers
from comfyui_lora_runtime.nodes import lifecycle, report as report_mod
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter, LoraMergeMode, LoraQualityTier
from comfyui_lora_runtime.nodes.stack_node import LoraStack

from testkit.comfy038_patcher import Patcher038, patched_weight
from testkit.nodes_helpers import _sample, _weights

CONFIG_MODULE = "blocks.0.self_attn"
FOOOCUS_LAYERS = ("blocks.0.ffn.0", "blocks.1.self_attn.q")


def _ours(model, mode="dynamic", lora="style.safetensors", strength=0.8):
    m = LoadLoraAdapter().load(model, lora, strength)["result"][0]
    return LoraQualityTier().set_tier(LoraMergeMode().set_mode(m, mode)[0], "exact")[0]


@pytest.fixture
def p038(base):
    yield Patcher038(base.model, fast_disk=True)
    model_management.unload_all_models()


def test_our_clones_keep_the_hosts_class_and_fast_disk(p038):
    import json
    outs = {"load": LoadLoraAdapter().load(p038, "style.safetensors", 1.0)["result"][0]}
    outs["merge_mode"] = LoraMergeMode().set_mode(outs["load"], "merge")[0]
    outs["tier"] = LoraQualityTier().set_tier(outs["merge_mode"], "exact")[0]
    rows = json.dumps([{"on": True, "lora": "style.safetensors", "strength": 0.5}])
    outs["stack"] = LoraStack().load(p038, rows)["result"][0]
    for what, m in outs.items():
        assert type(m) is Patcher038 and m.fast_disk is True and m is not p038, what
        assert lifecycle.is_registered(m), what
    _, rep = _sample(outs["tier"])
    assert rep["decision"]["chosen"] == "merge" and "host_patched" not in rep


def _with_config(monkeypatch, dm):
    """Give the module class a ``with_config`` as 0.38.1's configurable modules have: a deep copy
    carrying the config (new child Linear objects, the same weights)."""
    cls = type(dm.get_submodule(CONFIG_MODULE))

    def with_config(self, cfg):
        n = copy.deepcopy(self)
        n.config = cfg
        return n
    monkeypatch.setattr(cls, "with_config", with_config, raising=False)


@pytest.mark.parametrize("mode", ["dynamic", "merge"])
def test_a_config_patch_passes_through_untouched(p038, base, monkeypatch, mode):
    dm = base.model.diffusion_model
    original = dm.get_submodule(CONFIG_MODULE)
    w0 = _weights(base)
    expected, rep0 = _sample(_ours(p038, mode))
    model_management.unload_all_models()

    _with_config(monkeypatch, dm)
    host = p038.clone()
    assert host.add_patches({f"diffusion_model.{CONFIG_MODULE}.config": ("config", ({"attention": "sdpa"},))}) \
        == [f"diffusion_model.{CONFIG_MODULE}.config"]
    assert host.patches == {}                                   # a config patch is no weight patch
    cfg_module = host.object_patches[f"diffusion_model.{CONFIG_MODULE}"]
    ours = _ours(host, mode)
    assert ours.object_patches == host.object_patches
    assert ours.object_patches[f"diffusion_model.{CONFIG_MODULE}"] is cfg_module   # the same object
    out, rep = _sample(ours)
    assert torch.equal(out, expected), mode                     # our adapter reached the copy's layers
    assert "host_patched" not in rep and not rep.get("ran_check"), rep
    assert rep["adapters"][0]["coverage"]["matched"] == rep0["adapters"][0]["coverage"]["matched"] == 20
    assert cfg_module.config == {"attention": "sdpa"} and dm.get_submodule(CONFIG_MODULE) is cfg_module
    model_management.unload_all_models()
    assert dm.get_submodule(CONFIG_MODULE) is original          # the host put its module back
    assert runtime_leftovers(dm) == [] and runtime_leftovers(cfg_module) == []
    assert all(torch.equal(w0[k], v) for k, v in _weights(base).items())


def _fooocus(shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return ("fooocus", (w, torch.full(shape, -0.02), torch.full(shape, 0.02)))


@pytest.mark.parametrize("mode", ["dynamic", "merge"])
def test_a_fooocus_patch_on_our_layers_is_counted_kept_dynamic_and_applied(p038, base, mode):
    dm = base.model.diffusion_model
    w0 = _weights(base)
    patches = {f"diffusion_model.{n}.weight": _fooocus(dm.get_submodule(n).weight.shape, i)
               for i, n in enumerate(FOOOCUS_LAYERS)}
    host = p038.clone()
    assert sorted(host.add_patches(patches, 0.7)) == sorted(patches)

    # the reference: the host's patched weights written by hand, our adapter on them, no host patch
    with torch.no_grad():
        for n in FOOOCUS_LAYERS:
            k = f"diffusion_model.{n}.weight"
            dm.get_submodule(n).weight.copy_(patched_weight(w0[f"{n}.weight"], host.patches[k]))
    reference, _ = _sample(_ours(p038, mode))
    fooocus_alone, _ = _sample(p038)
    model_management.unload_all_models()
    with torch.no_grad():
        for n in FOOOCUS_LAYERS:
            dm.get_submodule(n).weight.copy_(w0[f"{n}.weight"])
    ours_alone, _ = _sample(_ours(p038, mode))
    model_management.unload_all_models()

    out, rep = _sample(_ours(host, mode))
    rel = ((out - reference).norm() / reference.norm()).item()
    print(f"\n{mode}: vs reference rel {rel:.3g}, vs fooocus alone "
          f"{((out - fooocus_alone).norm() / reference.norm()).item():.3g}, vs ours alone "
          f"{((out - ours_alone).norm() / reference.norm()).item():.3g}")
    if mode == "dynamic":
        assert torch.equal(out, reference)
    else:   # the reference merges the two layers the host keeps dynamic: two fp32 roundings of the same
        assert rel < 1e-5   # sum there, measured 6.0e-7 apart; the wrong answers below are 4e-2 and 0.9 away
    for wrong in (fooocus_alone, ours_alone):
        assert ((out - wrong).norm() / reference.norm()).item() > 1e-2
    hp = rep["host_patched"]
    assert hp["layers"] == 2 and hp["examples"] == sorted(FOOOCUS_LAYERS), hp
    assert rep["adapters"][0]["host_patched"] == 2
    line = report_mod.host_patched_line(hp)
    assert "2 adapted layers carry a ComfyUI patch beside ours (blocks.0.ffn.0, blocks.1.self_attn.q)" in line
    assert line in report_mod.text(rep)
    jsonschema = pytest.importorskip("jsonschema")
    import json
    assert not list(jsonschema.Draft202012Validator(json.loads(report_mod.SCHEMA_PATH.read_text())).iter_errors(rep))
    if mode == "merge":   # the other 18 layers merge; the two host-patched ones stay dynamic
        assert rep["decision"]["chosen"] == "merge" and rep["decision"]["kept_dynamic"] == 2, rep["decision"]
    model_management.unload_all_models()
    assert runtime_leftovers(dm) == []
    assert all(torch.equal(w0[k], v) for k, v in _weights(base).items())
