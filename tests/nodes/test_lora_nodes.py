"""The node pack on the bundled host: clone-not-mutate, reports, validation, restore on error/interrupt."""
import copy

import pytest
import torch
from safetensors.torch import load_file

from comfyui_lora_runtime import NODE_CLASS_MAPPINGS
from comfyui_lora_runtime.standalone.host import progress
from comfyui_lora_runtime.standalone.host.core_nodes import CORE_NODE_CLASS_MAPPINGS, UNETLoader
from comfyui_lora_runtime.standalone.host.executor import NodeExecutionError, execute_prompt
from comfyui_lora_runtime.standalone.host.validation import PromptValidationError, validate_prompt
from comfyui_lora_runtime.lora_runtime.settings import MergeMode, Tier
from comfyui_lora_runtime.lora_runtime.layer.wrapper import runtime_leftovers
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter, LoraMergeMode, LoraQualityTier, LoraSampler

from testkit.bad_adapter_files import EXPECTED, write_bad_files
from testkit.nodes_helpers import CLASSES, Capture, CondPos, _sample, _weights, _unloaded_weights  # noqa: F401


def test_no_adapter_equals_ksampler_bit_for_bit(base):
    from comfyui_lora_runtime.standalone.host.core_nodes import KSampler
    ours, rep = _sample(base)
    pos, neg = CondPos().go("pos")[0], CondPos().go("neg")[0]
    ref = KSampler().sample(base, 42, 3, 5.0, "euler", "simple", pos, neg,
                            {"samples": torch.zeros(1, 16, 1, 8, 8)}, 1.0)[0]["samples"]
    assert torch.equal(ours, ref)
    assert rep["decision"] is None and rep["adapters"] == []


def test_nodes_clone_and_never_mutate(base):
    before_opts = copy.deepcopy(base.model_options)
    w0 = _weights(base)
    a = LoadLoraAdapter().load(base, "style.safetensors", 1.0)["result"][0]
    b = LoadLoraAdapter().load(base, "sub/second.safetensors", -0.5)["result"][0]
    a2 = LoraMergeMode().set_mode(a, "merge")[0]
    a3 = LoraQualityTier().set_tier(a2, "exact")[0]
    assert base.model_options == before_opts
    assert a is not base and a.model is base.model
    assert [x.name for x in a3.model_options["lora_runtime"].adapters] == ["style.safetensors"]
    assert a.model_options["lora_runtime"].mode is MergeMode.AUTO and a2.model_options["lora_runtime"].mode is MergeMode.MERGE
    assert a3.model_options["lora_runtime"].tier is Tier.EXACT  # typed end to end
    y_base, _ = _sample(base)
    y_a, rep_a = _sample(a3)
    y_b, _ = _sample(b)
    y_base2, _ = _sample(base)
    assert torch.equal(y_base, y_base2)  # the base result is unchanged afterwards
    assert not torch.equal(y_a, y_base) and not torch.equal(y_b, y_base) and not torch.equal(y_a, y_b)
    # each branch gets its own result: equal to running that branch alone on a fresh model
    fresh = UNETLoader().load_unet("tiny_wan.safetensors", "default")[0]
    fa = LoraQualityTier().set_tier(LoraMergeMode().set_mode(
        LoadLoraAdapter().load(fresh, "style.safetensors", 1.0)["result"][0], "merge")[0], "exact")[0]
    assert torch.equal(_sample(fa)[0], y_a)
    w1 = _weights(base)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert rep_a["decision"]["chosen"] == "merge" and rep_a["tier"] == "exact"


def test_stacked_adapters_and_the_report(base):
    m = LoadLoraAdapter().load(base, "style.safetensors", 0.8)["result"][0]
    out = LoadLoraAdapter().load(m, "sub/second.safetensors", 0.5)
    assert out["ui"]["lora_coverage"][0]["matched"] == 4  # ffn.0/ffn.2 of 2 blocks
    m = LoraMergeMode().set_mode(out["result"][0], "dynamic")[0]
    y, rep = _sample(m)
    assert [a["name"] for a in rep["adapters"]] == ["style.safetensors", "sub/second.safetensors"]
    assert rep["adapters"][0]["coverage"]["matched"] == 20 and rep["adapters"][0]["coverage"]["unmatched"] == 0
    assert rep["decision"]["chosen"] == "dynamic" and rep["tier"] == "lossless"
    assert rep["fusions"]["mounted"] == 0 and rep["fusions"]["skipped"] == 3  # 2 FFNs + text_embedding; CPU: not mounted
    assert rep["seconds_per_step"] > 0 and rep["patch_seconds"] >= 0
    ex, _ = _sample(LoraQualityTier().set_tier(m, "exact")[0])
    # lossless vs exact on the same adapters: the 0..25 latents agree to float32 noise
    assert (y - ex).abs().max() < 1e-3 and not torch.equal(y, _sample(base)[0])


def test_restore_on_interrupt_and_on_error(base, monkeypatch):
    w0 = _weights(base)
    m = LoraMergeMode().set_mode(LoadLoraAdapter().load(base, "style.safetensors", 1.0)["result"][0], "merge")[0]
    calls = {"n": 0}

    def hook(value, total, preview, node_id=None):
        calls["n"] += 1
        if value == 2:
            progress.interrupt_current_processing(True)

    with progress.progress_hook(hook):
        with pytest.raises(progress.InterruptProcessingException):
            _sample(m, steps=4)
    progress.interrupt_current_processing(False)
    assert calls["n"] >= 2
    w1 = _weights(base)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert runtime_leftovers(base.model.diffusion_model) == []
    from comfyui_lora_runtime.nodes import host as host_mod

    def boom(*a, **k):
        raise RuntimeError("sampler exploded")
    monkeypatch.setattr(host_mod, "sample", boom)
    with pytest.raises(RuntimeError, match="exploded"):
        _sample(m)
    w2 = _weights(base)
    assert all(torch.equal(w0[k], w2[k]) for k in w0)


def _prompt(lora="style.safetensors", strength=1.0, mode="auto", tier="lossless"):
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "LoraRuntimeLoadAdapter", "inputs": {"model": ["1", 0], "lora_name": lora,
                                                                 "strength": strength}},
        "3": {"class_type": "LoraRuntimeMergeMode", "inputs": {"model": ["2", 0], "mode": mode}},
        "4": {"class_type": "LoraRuntimeQualityTier", "inputs": {"model": ["3", 0], "tier": tier}},
        "5": {"class_type": "CondPos", "inputs": {"which": "pos"}},
        "6": {"class_type": "CondPos", "inputs": {"which": "neg"}},
        "7": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1,
                                                                  "batch_size": 1}},
        "8": {"class_type": "LoraRuntimeSampler", "inputs": {
            "model": ["4", 0], "seed": 42, "steps": 2, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["5", 0], "negative": ["6", 0], "latent_image": ["7", 0], "denoise": 1.0}},
        "9": {"class_type": "Capture", "inputs": {"samples": ["8", 0]}},
    }


def test_workflow_runs_through_the_executor(folders):
    res = execute_prompt(_prompt(), CLASSES, folders=folders)
    rep = res.ui["8"]["lora_report"][0]
    assert rep["decision"]["requested"] == "auto" and rep["decision"]["chosen"] == "merge"  # fp32 weights
    assert rep["decision"]["share_lost"] == 0.0
    assert res.ui["2"]["lora_coverage"][0]["matched"] == 20


@pytest.mark.parametrize("node,inp,value,etype,text", [
    ("2", "lora_name", "missing.safetensors", "custom_validation_failed", "not found"),
    ("2", "lora_name", "../diffusion_models/tiny_wan.safetensors", "custom_validation_failed", "loras"),
    ("2", "strength", 11.0, "value_bigger_than_max", ""),
    ("3", "mode", "fuse", "value_not_in_list", ""),
    ("4", "tier", "fast", "value_not_in_list", ""),
])
def test_validation_errors_in_comfyui_shape(folders, node, inp, value, etype, text):
    p = _prompt()
    p[node]["inputs"][inp] = value
    ok, err, outputs, node_errors = validate_prompt(p, CLASSES, folders=folders)
    assert not ok and node in node_errors
    e = node_errors[node]["errors"][0]
    assert e["type"] == etype and e["extra_info"]["input_name"] == inp
    assert text in e["details"] + e["message"]


@pytest.mark.parametrize("name,message", list(EXPECTED.items()))
def test_bad_files_fail_validation_naming_the_node(folders, models_dir, name, message):
    """What the header tells is refused when the prompt is queued (ComfyUI: HTTP 400
    node_errors), before anything runs; a pickle is never opened."""
    write_bad_files(models_dir / "loras")
    with pytest.raises(PromptValidationError) as ei:
        execute_prompt(_prompt(lora=name), CLASSES, folders=folders)
    errs = ei.value.node_errors
    assert list(errs) == ["2"] and errs["2"]["class_type"] == "LoraRuntimeLoadAdapter"
    text = str(errs["2"])
    assert name in text and message in text, text


def test_an_adapter_for_another_model_fails_when_its_node_runs(folders):
    """Layer matching needs the MODEL, which ComfyUI does not hand to validation."""
    with pytest.raises(NodeExecutionError) as ei:
        execute_prompt(_prompt(lora="flux_only.safetensors"), CLASSES, folders=folders)
    assert ei.value.node_id == "2" and "matches no layer" in str(ei.value)


def test_auto_on_bf16_weights_keeps_a_sub_ulp_adapter_dynamic(folders, monkeypatch):
    from comfyui_lora_runtime.standalone.host.core_nodes import UNET_DTYPE_ENV
    monkeypatch.setenv(UNET_DTYPE_ENV, "bf16")
    base = UNETLoader().load_unet("tiny_wan.safetensors", "default")[0]
    assert base.model.diffusion_model.blocks[0].ffn[0].weight.dtype == torch.bfloat16
    w0 = _weights(base)
    d = LoadLoraAdapter().load(base, "distilled.safetensors", 1.0)["result"][0]
    y_auto, rep = _sample(d)
    assert rep["decision"]["chosen"] == "dynamic" and rep["decision"]["share_lost"] > 0.8
    y_dyn, _ = _sample(LoraMergeMode().set_mode(d, "dynamic")[0])
    assert torch.equal(y_auto, y_dyn)
    assert not torch.equal(y_dyn, _sample(base)[0])
    s = LoadLoraAdapter().load(base, "style.safetensors", 1.0)["result"][0]
    _, rep_s = _sample(s)
    assert rep_s["decision"]["chosen"] == "merge" and rep_s["decision"]["share_lost"] < 0.5
    w1 = _unloaded_weights(base)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_unmatched_keys_are_reported_by_default_and_fail_with_error(folders, models_dir):
    from safetensors.torch import load_file as _load, save_file as _save
    sd = _load(str(models_dir / "loras" / "style.safetensors"))
    sd["diffusion_model.blocks.7.self_attn.q.lora_down.weight"] = torch.zeros(4, 128)  # a block the model lacks
    sd["diffusion_model.blocks.7.self_attn.q.lora_up.weight"] = torch.zeros(128, 4)
    _save(sd, str(models_dir / "loras" / "extra.safetensors"))
    strict = _prompt(lora="extra.safetensors")
    strict["2"]["inputs"]["unmatched_keys"] = "error"
    with pytest.raises(NodeExecutionError) as ei:
        execute_prompt(strict, CLASSES, folders=folders)
    assert ei.value.node_id == "2" and "blocks.7.self_attn.q" in str(ei.value) and "skip and report" in str(ei.value)
    p = _prompt(lora="extra.safetensors")   # the default: ComfyUI's policy, the rest applied and reported
    res = execute_prompt(p, CLASSES, folders=folders)
    cov = res.ui["8"]["lora_report"][0]["adapters"][0]["coverage"]
    assert cov["unmatched"] == 1 and "blocks.7.self_attn.q" in cov["unmatched_examples"][0]
    assert "per-layer .alpha tensors (20 layers)" in cov["scale_source"]


# one error per mistake, on the input that holds it ------------------------------------------


def _errors(p, folders):
    ok, _, _, node_errors = validate_prompt(p, CLASSES, folders=folders)
    assert not ok
    return [(e["extra_info"]["input_name"], e["type"], e["message"] + " " + e["details"])
            for e in node_errors["2"]["errors"]]


def test_a_bad_file_is_one_error_on_lora_name(folders, models_dir):
    """ComfyUI attaches VALIDATE_INPUTS' answer to every input it declares: the file check
    must not also land on strength_schedule and branch."""
    write_bad_files(models_dir / "loras")
    p = _prompt(lora="truncated.safetensors")
    p["2"]["inputs"].update(strength_schedule="1, 0", branch="both")
    [(inp, etype, text)] = _errors(p, folders)
    assert inp == "lora_name" and etype == "custom_validation_failed" and "truncated.safetensors" in text


def test_a_bad_branch_is_one_error_on_branch(folders):
    p = _prompt()
    p["2"]["inputs"]["branch"] = "left only"
    [(inp, etype, text)] = _errors(p, folders)
    assert inp == "branch" and etype == "value_not_in_list" and "left only" in text


def test_two_mistakes_are_two_errors_each_on_its_input(folders, models_dir):
    write_bad_files(models_dir / "loras")
    p = _prompt(lora="pickled.safetensors")
    p["2"]["inputs"]["branch"] = "left only"
    errs = _errors(p, folders)
    assert sorted(e[0] for e in errs) == ["branch", "lora_name"], errs
    assert "pickled.safetensors" in dict((e[0], e[2]) for e in errs)["lora_name"]


def test_a_malformed_schedule_stops_the_run_at_its_node_naming_strength_schedule(folders):
    p = _prompt()
    p["2"]["inputs"]["strength_schedule"] = "1, x"
    assert validate_prompt(p, CLASSES, folders=folders)[0]  # not blamed on lora_name at queue time
    with pytest.raises(NodeExecutionError) as ei:  # the loader node runs before any sampler touches a weight
        execute_prompt(p, CLASSES, folders=folders)
    assert ei.value.node_id == "2" and "strength_schedule" in str(ei.value) and "not a number" in str(ei.value)
