"""Block filters end to end on the bundled host: a filtered adapter samples as a hand-edited copy
of its file (the B/up tensors of the scaled blocks multiplied, the left-out layers' keys removed)
loaded without a filter, in every merge mode and tier; a filter ignored (the wrong answer) does
not. Also: the stack samples as the chain with filters, the report says which layers got which
strength, and a mistake is one clear error naming the node and the input."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_lora_runtime.standalone.host.core_nodes import KSampler
from comfyui_lora_runtime.standalone.host.executor import NodeExecutionError, execute_prompt
from comfyui_lora_runtime.standalone.host.validation import validate_prompt
from comfyui_lora_runtime.lora_runtime import LoraRuntimeError
from comfyui_lora_runtime.nodes import lifecycle, report
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter, LoraMergeMode, LoraQualityTier
from comfyui_lora_runtime.nodes.stack_node import LoraStack
from comfyui_lora_runtime.lora_runtime.block_filter import parse_blocks

from testkit.nodes_helpers import CLASSES, Capture, CondPos, _weights, sampling_graph

STEPS, SEED, CFG = 4, 42, 5.0
FILTER = "0: 0.5, !cross_attn"   # block 0 at half strength (a power of two: see _edit), cross attention left out


def _edit(models_dir, name, factor_of, keep) -> str:
    """A copy of loras/style.safetensors whose up (B) tensors of each layer are multiplied by
    factor_of(layer) in fp32 and whose layers keep() refuses are removed. With a power-of-two factor
    (B * 0.5)(A x) is exactly 0.5 (B (A x)) and merges alike, so `exact` must match bit for bit."""
    sd = load_file(str(models_dir / "loras" / "style.safetensors"))
    out = {}
    for k, v in sd.items():
        layer = k.split(".")[0].removeprefix("lora_unet_")   # kohya stem: blocks_0_self_attn_q
        if not keep(layer):
            continue
        if k.endswith("lora_up.weight"):
            f = factor_of(layer)
            v = v if f == 1.0 else (v.float() * f).to(v.dtype)
        out[k] = v
    save_file(out, str(models_dir / "loras" / name))
    return name


def _model(base, lora="style.safetensors", strength=0.8, blocks="", mode="dynamic", tier="exact", strength_schedule=""):
    m = LoadLoraAdapter().load(base, lora, strength, blocks=blocks, strength_schedule=strength_schedule)["result"][0]
    return LoraQualityTier().set_tier(LoraMergeMode().set_mode(m, mode)[0], tier)[0]


def _sample(model):
    pos, neg = CondPos().go("pos")[0], CondPos().go("neg")[0]
    return KSampler().sample(model, SEED, STEPS, CFG, "euler", "simple", pos, neg,
                             {"samples": torch.zeros(1, 16, 1, 8, 8)}, 1.0)[0]["samples"]


def _psnr(a, ref):
    peak = float(ref.max() - ref.min())
    mse = float((a.double() - ref.double()).pow(2).mean())
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


@pytest.fixture
def edited(models_dir):
    return _edit(models_dir, "style_edited.safetensors",
                 lambda layer: 0.5 if layer.startswith("blocks_0_") else 1.0, lambda layer: "cross_attn" not in layer)


@pytest.mark.parametrize("mode,tier", [("dynamic", "exact"), ("merge", "exact"), ("auto", "exact"),
                                       ("dynamic", "lossless"), ("merge", "lossless"), ("auto", "lossless"),
                                       ("dynamic", "high")])
def test_filter_equals_the_hand_edited_file(base, edited, mode, tier):
    w0 = _weights(base)
    want = _sample(_model(base, edited, mode=mode, tier="exact"))         # the edited file, no filter
    got_model = _model(base, blocks=FILTER, mode=mode, tier=tier)
    got = _sample(got_model)
    if tier == "exact":
        assert torch.equal(got, want)
    else:  # the tiers' end-to-end contract against exact: lossless >= 40 dB, high >= 30 dB
        assert _psnr(got, want) >= (40.0 if tier == "lossless" else 30.0), _psnr(got, want)
    ignored = _sample(_model(base, mode=mode, tier=tier))                 # the wrong answer: filter ignored
    assert (ignored - want).abs().mean() > 1e-3 and _psnr(ignored, want) < _psnr(got, want) - 10
    assert (want - _sample(base)).abs().mean() > 1e-3                     # and the edited adapter does something
    assert all(torch.equal(w0[k], v) for k, v in _weights(base).items())
    a = lifecycle.last_report(got_model)["adapters"][0]
    assert a["layers"] == 12  # 20 layers, 8 cross attention left out
    if mode == "auto":  # each layer measured at its own strength: the same choice as the edited file's
        ed = _model(base, edited, mode="auto")
        _sample(ed)
        assert a["decision"]["chosen"] == lifecycle.last_report(ed)["adapters"][0]["decision"]["chosen"]


def test_a_block_factor_is_a_strength(base, models_dir):
    """'*: 0.3' at strength 1 is strength 0.3 (bit for bit in exact: the product is the layer's strength,
    applied by scaling.py where the strength is); a non-power-of-two factor edited into B differs
    from it only by rounding (lossless contract)."""
    got = _sample(_model(base, strength=1.0, blocks="*: 0.3"))
    assert torch.equal(got, _sample(_model(base, strength=0.3)))
    edited = _edit(models_dir, "style_x03.safetensors", lambda layer: 0.3, lambda layer: True)
    want = _sample(_model(base, edited, strength=1.0))
    assert _psnr(got, want) >= 40.0
    assert (_sample(_model(base, strength=1.0)) - want).abs().mean() > 1e-3


def test_only_and_name_patterns(base, models_dir):
    edited = _edit(models_dir, "style_b1_ffn.safetensors",
                   lambda layer: 0.25 if "ffn" in layer else 1.0, lambda layer: layer.startswith("blocks_1_"))
    got = _sample(_model(base, blocks="only 1\nffn: 0.25"))
    assert torch.equal(got, _sample(_model(base, edited)))
    assert not torch.equal(got, _sample(_model(base, blocks="only 1")))
    # wildcards match the whole layer name; strength 0 leaves the layer out as '!' does
    assert torch.equal(_sample(_model(base, blocks="blocks.*.cross_attn.*: 0")),
                       _sample(_model(base, blocks="!cross_attn")))


def test_the_report_shows_the_strength_of_each_layer_group_and_the_layers_left_out(base):
    m = _model(base, blocks=FILTER)
    _sample(m)
    r = lifecycle.last_report(m)
    b = r["adapters"][0]["blocks"]
    assert b["text"] == FILTER
    assert b["strengths"] == [{"factor": 0.5, "layers": 6, "where": "blocks 0"},
                              {"factor": 1.0, "layers": 6, "where": "blocks 1"}]
    assert b["excluded"] == 8 and b["excluded_where"] == "blocks 0-1"
    assert "blocks '0: 0.5, !cross_attn': 6 layers x0.5 (blocks 0), 6 layers x1 (blocks 1); 8 left out" \
        in report.text(r)
    shown = LoadLoraAdapter().load(base, "style.safetensors", 0.8, blocks=FILTER)["ui"]["lora_coverage"][0]
    assert shown["blocks"] == b



@pytest.mark.parametrize("mode,tier", [("dynamic", "exact"), ("auto", "lossless"), ("merge", "exact")])
def test_stack_with_filters_equals_chain_with_filters(folders, mode, tier):
    rows = [{"lora": "style.safetensors", "strength": 0.8, "blocks": FILTER},
            {"lora": "sub/second.safetensors", "strength": -0.5, "blocks": "1: 2"}]

    def run(p):
        Capture.seen.clear()
        res = execute_prompt(p, CLASSES, folders=folders)
        return Capture.seen[-1], res.ui["10"]["lora_report"][0]

    chain = {"20": {"class_type": "LoraRuntimeLoadAdapter", "inputs": {
                 "model": ["1", 0], "lora_name": rows[0]["lora"], "strength": 0.8, "blocks": rows[0]["blocks"]}},
             "21": {"class_type": "LoraRuntimeLoadAdapter", "inputs": {
                 "model": ["20", 0], "lora_name": rows[1]["lora"], "strength": -0.5, "blocks": rows[1]["blocks"]}}}
    stack = {"2": {"class_type": "LoraRuntimeStack", "inputs": {"model": ["1", 0], "rows": json.dumps(rows)}}}
    y_chain, r_chain = run(sampling_graph(chain, "21", mode, tier))
    y_stack, r_stack = run(sampling_graph(stack, "2", mode, tier))
    assert torch.equal(y_stack, y_chain)
    assert [a["blocks"] for a in r_stack["adapters"]] == [a["blocks"] for a in r_chain["adapters"]]
    unfiltered = [dict(r, blocks="") for r in rows]
    y_plain, _ = run(sampling_graph({"2": {"class_type": "LoraRuntimeStack",
                                   "inputs": {"model": ["1", 0], "rows": json.dumps(unfiltered)}}}, "2", mode, tier))
    assert not torch.equal(y_stack, y_plain)                             # the wrong answer: filters dropped


@pytest.mark.parametrize("blocks,says", [
    ("0-9", "entry '0-9' has no strength"),
    ("0: x", "strength 'x' is not a number"),
    ("5: 0.5", "selects none of the 20 layers this adapter changes (blocks 0-1"),
    ("*: 0", "leaves out every one of the 20 layers"),
    ("0: 0.5, *: 1", "has no effect: the later '*: 1' overrides every layer"),
])
def test_a_mistake_is_one_error_at_the_node_naming_blocks(folders, base, blocks, says):
    p = sampling_graph({"2": {"class_type": "LoraRuntimeLoadAdapter", "inputs": {
        "model": ["1", 0], "lora_name": "style.safetensors", "strength": 1.0, "blocks": blocks}}}, "2")
    assert validate_prompt(p, CLASSES, folders=folders)[0]      # not blamed on lora_name at queue time
    with pytest.raises(NodeExecutionError) as ei:               # the loader runs before any sampler touches a weight
        execute_prompt(p, CLASSES, folders=folders)
    msg = str(ei.value)
    assert ei.value.node_id == "2" and "Load LoRA Adapter (style.safetensors): blocks" in msg and says in msg, msg


def test_the_stack_validates_each_rows_blocks_on_rows(folders):
    rows = [{"lora": "style.safetensors"}, {"lora": "sub/second.safetensors", "blocks": "ffn"}]
    msg = LoraStack.VALIDATE_INPUTS(json.dumps(rows))
    assert msg.startswith("LoRA Stack row 2 (sub/second.safetensors): blocks entry 'ffn' has no strength"), msg
    assert "blocks must be text" in LoraStack.VALIDATE_INPUTS(json.dumps([{"lora": "style.safetensors",
                                                                          "blocks": 3}]))
    assert LoraStack.VALIDATE_INPUTS(json.dumps([dict(r, blocks="!cross_attn") for r in rows])) is True


def test_a_filter_that_matches_nothing_fails_before_any_weight_changes(base):
    w0 = _weights(base)
    with pytest.raises(LoraRuntimeError, match=r"blocks entry 'single_blocks.0-3: 1' selects none"):
        LoadLoraAdapter().load(base, "style.safetensors", 1.0, blocks="single_blocks.0-3: 1")
    assert all(torch.equal(w0[k], v) for k, v in _weights(base).items())


@pytest.mark.parametrize("tier", ["exact", "lossless"])
def test_a_layers_strength_is_one_factor_under_scalings_rules(base, tier):
    """strength x block factor is one strength (scaling.layer_strength): strength 2 with a block factor of
    0.5 multiplies nothing, as strength 1 does; strength 0.8 x 0.5 multiplies as strength 0.4 does (once in
    exact), with the same bits.
    A block factor applied as a factor of its own would add a multiply (the wrong answer)."""
    from comfyui_lora_runtime.standalone.host import folder_paths
    from comfyui_lora_runtime.lora_runtime import AdapterSpec, applied, plan
    from comfyui_lora_runtime.lora_runtime.block_filter import parse_blocks
    from testkit.compare import MulCounter

    dm = base.model.diffusion_model
    path = folder_paths.get_full_path_or_raise("loras", "style.safetensors")

    def one_call(strength, blocks=None):
        p = plan(dm, [AdapterSpec(path, strength, "style", blocks=parse_blocks(blocks))], "dynamic", tier)
        layer = "blocks.0.ffn.0"
        assert layer in p.adapters[0].layers
        x = torch.randn(3, dm.get_submodule(layer).in_features, generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), applied(dm, p, fusion_backend=None):
            with MulCounter() as c:
                y = dm.get_submodule(layer)(x)
        return c.muls, y

    n_half, y_half = one_call(2.0, "*: 0.5")
    n_one, y_one = one_call(1.0)
    assert n_half == n_one and torch.equal(y_half, y_one)
    if tier == "exact":  # (lossless may fold a strength into the GEMM's alpha: no aten.mul to count)
        assert n_one == one_call(2.0)[0] - 1
    n, y = one_call(0.8, "*: 0.5")
    n_ref, y_ref = one_call(0.4)
    assert n == n_ref and torch.equal(y, y_ref)
    assert not torch.equal(y, one_call(0.8)[1])


def test_the_node_and_the_run_match_and_resolve_the_filter_once(base, monkeypatch):
    """The loader node matches the adapter and resolves its filter (coverage shown, early errors);
    the run reuses that for the same model and adapter objects: one match, one resolve, and the
    same output as without the memo. A model the node never saw is matched again (the memo is per
    model object, not a guess)."""
    from comfyui_lora_runtime.lora_runtime import block_filter, targets
    calls = {"match": 0, "resolve": 0}
    match, resolve = targets.match_adapter, block_filter.BlockFilter.resolve

    def counted_match(*a, **k):
        calls["match"] += 1
        return match(*a, **k)

    def counted_resolve(self, *a, **k):
        calls["resolve"] += 1
        return resolve(self, *a, **k)
    monkeypatch.setattr(targets, "match_adapter", counted_match)
    monkeypatch.setattr(block_filter.BlockFilter, "resolve", counted_resolve)
    targets._MEMO.clear()
    m = _model(base, blocks=FILTER, strength_schedule="0.5", mode="auto")
    got = _sample(m)
    assert calls == {"match": 1, "resolve": 1}
    r = lifecycle.last_report(m)["adapters"][0]
    assert r["layers"] == 12 and r["blocks"]["excluded"] == 8
    # without the memo (node and run each match and resolve) the output is the same; the run
    # without the filter (the wrong answer, sampled first so the run above is not kept) differs
    monkeypatch.setattr(targets, "MEMO_ENTRIES", 0)
    targets._MEMO.clear()
    calls.update(match=0, resolve=0)
    unfiltered = _sample(_model(base, strength_schedule="0.5", mode="auto"))
    assert calls == {"match": 2, "resolve": 0}
    want = _sample(_model(base, blocks=FILTER, strength_schedule="0.5", mode="auto"))
    assert calls == {"match": 4, "resolve": 2}
    assert torch.equal(got, want) and not torch.equal(want, unfiltered)


def test_each_call_gets_its_own_coverage_and_dicts(base, models_dir):
    """The memo's answer is shared; what a caller receives is its own (the plan names the coverage)."""
    from comfyui_lora_runtime.lora_runtime import targets
    from comfyui_lora_runtime.lora_runtime.intent import AdapterSpec
    from comfyui_lora_runtime.nodes import host
    from comfyui_lora_runtime.nodes.caches import ADAPTERS
    path = str(models_dir / "loras" / "style.safetensors")
    adapter, model = ADAPTERS.load(path), host.diffusion_model(base)
    spec = AdapterSpec(path, 0.8, blocks=parse_blocks(FILTER))
    a, b = (targets.targets_of(adapter, model, spec, where="x") for _ in range(2))
    a.coverage.adapter = "renamed"
    a.coverage.notes.append("a note")
    a.layers.clear()
    a.factors.clear()
    assert b.coverage.adapter != "renamed" and "a note" not in b.coverage.notes
    assert len(b.layers) == 12 and set(b.strengths(0.8, where="x").values()) == {0.4}
    assert len(b.strengths(0.8, where="x")) == 6 and b.factors is not a.factors
