"""An adapter at strength 0 is reported as "off (strength 0)" on the node, in the log text
and in each adapter's decision (it used to read "dynamic" with an empty reason), and the
image is the base model's bit for bit."""
import pytest
import torch

from comfyui_lora_runtime.nodes import report
from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter, LoraMergeMode

from testkit.nodes_helpers import _sample, _weights

jsonschema = pytest.importorskip("jsonschema")


def _valid(r):
    import json
    schema = json.loads(report.SCHEMA_PATH.read_text())
    assert [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(r)] == []


@pytest.mark.parametrize("mode", ["auto", "dynamic", "merge"])
def test_strength_zero_reads_off_and_changes_nothing(base, mode):
    w0 = _weights(base)
    y_base, _ = _sample(base)
    m = LoraMergeMode().set_mode(LoadLoraAdapter().load(base, "style.safetensors", 0.0)["result"][0], mode)[0]
    y, rep = _sample(m)
    assert torch.equal(y, y_base)
    d = rep["decision"]
    assert d["chosen"] == "off" and d["reason"] == "off (strength 0)", d
    assert [a["chosen"] for a in d["adapters"]] == ["off"]
    assert rep["adapters"][0]["decision"]["reason"] == "off (strength 0)"
    text = report.text(rep)
    assert "-> off (strength 0)" in text and "layers, off (strength 0): style.safetensors x0.0" in text
    _valid(rep)
    assert all(torch.equal(w0[k], v) for k, v in _weights(base).items())


def test_one_adapter_off_and_one_on_each_says_its_own(base):
    m = LoadLoraAdapter().load(base, "style.safetensors", 0.0)["result"][0]
    m = LoadLoraAdapter().load(m, "sub/second.safetensors", 0.5)["result"][0]
    m = LoraMergeMode().set_mode(m, "dynamic")[0]
    y, rep = _sample(m)
    d = rep["decision"]
    assert d["chosen"] == "dynamic"  # what happens to the adapter that is on
    by = {a["name"]: a for a in d["adapters"]}
    assert by["style.safetensors"]["chosen"] == "off" and by["sub/second.safetensors"]["chosen"] == "dynamic"
    assert "style.safetensors: off (strength 0)" in d["reason"] and "sub/second.safetensors: dynamic" in d["reason"]
    _valid(rep)
    only = LoraMergeMode().set_mode(LoadLoraAdapter().load(base, "sub/second.safetensors", 0.5)["result"][0],
                                    "dynamic")[0]
    assert torch.equal(y, _sample(only)[0])  # the off adapter adds nothing
