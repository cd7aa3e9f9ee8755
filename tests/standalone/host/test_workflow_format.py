"""UI-format -> API-format conversion (what the frontend's graph-to-prompt does)."""
import copy
import json

import pytest

from comfyui_lora_runtime.standalone.host.core_nodes import CORE_NODE_CLASS_MAPPINGS
from comfyui_lora_runtime.standalone.host.workflow_format import (WorkflowFormatError, detect_format,
                                                               load_workflow, set_widget_value, ui_to_api)


class ToyCond:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"std": ("FLOAT", {"default": 1.0}), "tokens": ("INT", {"default": 4})}}
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "go"


class ToyDecode:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",)}}
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "go"


NODES = {**CORE_NODE_CLASS_MAPPINGS, "ToyCond": ToyCond, "ToyDecode": ToyDecode}


def node(id, type, inputs=(), outputs=(), widgets=None, mode=0, title=None):
    n = {"id": id, "type": type, "mode": mode,
         "inputs": [dict(i) for i in inputs], "outputs": [dict(o) for o in outputs]}
    if widgets is not None:
        n["widgets_values"] = widgets
    if title:
        n["title"] = title
    return n


def ui_workflow():
    """UNETLoader -> [ModelSamplingSD3, bypassed] -> KSampler; latent through a Reroute;
    seed from a PrimitiveNode; a Note; a muted PreviewImage."""
    nodes = [
        node(1, "UNETLoader", outputs=[{"name": "MODEL", "type": "MODEL", "links": [1]}],
             widgets=["tiny.safetensors", "default"]),
        node(2, "ModelSamplingSD3", inputs=[{"name": "model", "type": "MODEL", "link": 1}],
             outputs=[{"name": "MODEL", "type": "MODEL", "links": [2]}], widgets=[5.0], mode=4),
        node(3, "ToyCond", outputs=[{"name": "CONDITIONING", "type": "CONDITIONING", "links": [3]}],
             widgets=[1.0, 4]),
        node(5, "ToyCond", outputs=[{"name": "CONDITIONING", "type": "CONDITIONING", "links": [4]}],
             widgets=[0.0, 4], title="negative"),
        node(4, "EmptyHunyuanLatentVideo", outputs=[{"name": "LATENT", "type": "LATENT", "links": [5]}],
             widgets=[64, 48, 1, 1]),
        node(10, "Reroute", inputs=[{"name": "", "type": "*", "link": 5}],
             outputs=[{"name": "", "type": "LATENT", "links": [6]}]),
        node(11, "PrimitiveNode", outputs=[{"name": "INT", "type": "INT", "links": [7],
                                            "widget": {"name": "seed"}}], widgets=[1234, "fixed"]),
        node(6, "KSampler",
             inputs=[{"name": "model", "type": "MODEL", "link": 2},
                     {"name": "positive", "type": "CONDITIONING", "link": 3},
                     {"name": "negative", "type": "CONDITIONING", "link": 4},
                     {"name": "latent_image", "type": "LATENT", "link": 6},
                     {"name": "seed", "type": "INT", "link": 7, "widget": {"name": "seed"}}],
             outputs=[{"name": "LATENT", "type": "LATENT", "links": [8]}],
             widgets=[42, "randomize", 4, 5.0, "euler", "simple", 0.75]),
        node(7, "ToyDecode", inputs=[{"name": "samples", "type": "LATENT", "link": 8}],
             outputs=[{"name": "IMAGE", "type": "IMAGE", "links": [9, 10]}]),
        node(8, "SaveImage", inputs=[{"name": "images", "type": "IMAGE", "link": 9}],
             widgets=["run/img"]),
        node(9, "PreviewImage", inputs=[{"name": "images", "type": "IMAGE", "link": 10}], mode=2),
        node(12, "Note", widgets=["remember to set the seed"]),
    ]
    links = [[1, 1, 0, 2, 0, "MODEL"], [2, 2, 0, 6, 0, "MODEL"], [3, 3, 0, 6, 1, "CONDITIONING"],
             [4, 5, 0, 6, 2, "CONDITIONING"], [5, 4, 0, 10, 0, "LATENT"], [6, 10, 0, 6, 3, "LATENT"],
             [7, 11, 0, 6, 4, "INT"], [8, 6, 0, 7, 0, "LATENT"], [9, 7, 0, 8, 0, "IMAGE"],
             [10, 7, 0, 9, 0, "IMAGE"]]
    return {"last_node_id": 12, "last_link_id": 10, "nodes": nodes, "links": links,
            "groups": [], "config": {}, "extra": {}, "version": 0.4}


def test_detect_format():
    assert detect_format(ui_workflow()) == "ui"
    assert detect_format({"1": {"class_type": "X", "inputs": {}}}) == "api"
    for bad in ({}, [], {"1": {"inputs": {}}}, "x"):
        with pytest.raises(WorkflowFormatError):
            detect_format(bad)


def test_ui_to_api_full():
    wf = ui_workflow()
    before = copy.deepcopy(wf)
    api = ui_to_api(wf, NODES)
    assert wf == before
    assert set(api) == {"1", "3", "5", "4", "6", "7", "8"}  # no bypassed/muted/virtual nodes
    assert api["1"]["inputs"] == {"unet_name": "tiny.safetensors", "weight_dtype": "default"}
    assert api["4"]["inputs"] == {"width": 64, "height": 48, "length": 1, "batch_size": 1}
    assert api["3"]["inputs"] == {"std": 1.0, "tokens": 4}
    assert api["5"]["_meta"] == {"title": "negative"}
    assert api["6"] == {"class_type": "KSampler", "_meta": {"title": "KSampler"}, "inputs": {
        "model": ["1", 0],          # through the bypassed ModelSamplingSD3
        "seed": 1234,               # the PrimitiveNode's value, overriding the widget's 42
        "steps": 4,                 # "randomize" (control_after_generate) was skipped
        "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 0.75,
        "positive": ["3", 0], "negative": ["5", 0],
        "latent_image": ["4", 0],   # through the Reroute
    }}
    assert api["8"]["inputs"] == {"images": ["7", 0], "filename_prefix": "run/img"}


def test_control_value_only_skipped_after_seed():
    wf = ui_workflow()
    ks = next(n for n in wf["nodes"] if n["id"] == 6)
    ks["inputs"] = ks["inputs"][:4]                       # seed is a plain widget now
    ks["widgets_values"] = [7, "fixed", 20, 8.0, "euler", "normal", 1.0]
    api = ui_to_api(wf, NODES)
    assert api["6"]["inputs"]["seed"] == 7 and api["6"]["inputs"]["steps"] == 20
    assert api["6"]["inputs"]["scheduler"] == "normal"
    # an old workflow without the control value still maps positionally
    ks["widgets_values"] = [7, 20, 8.0, "euler", "normal", 1.0]
    assert ui_to_api(wf, NODES)["6"]["inputs"]["steps"] == 20


def test_muted_source_drops_the_input_and_bypass_without_match_too():
    wf = ui_workflow()
    next(n for n in wf["nodes"] if n["id"] == 5)["mode"] = 2   # mute the negative cond
    next(n for n in wf["nodes"] if n["id"] == 2)["mode"] = 0   # un-bypass model sampling
    api = ui_to_api(wf, NODES)
    assert "5" not in api and "negative" not in api["6"]["inputs"]
    assert api["6"]["inputs"]["model"] == ["2", 0]
    assert api["2"]["inputs"] == {"model": ["1", 0], "shift": 5.0}
    # a bypassed node with no input of the needed type passes nothing
    next(n for n in wf["nodes"] if n["id"] == 7)["mode"] = 4   # ToyDecode: LATENT in, IMAGE out
    api = ui_to_api(wf, NODES)
    assert "images" not in api["8"]["inputs"]


def test_dict_links_and_dict_widgets():
    wf = ui_workflow()
    wf["links"] = [dict(zip(("id", "origin_id", "origin_slot", "target_id", "target_slot", "type"), l))
                   for l in wf["links"]]
    next(n for n in wf["nodes"] if n["id"] == 4)["widgets_values"] = {
        "width": 32, "height": 32, "length": 5, "batch_size": 2}
    api = ui_to_api(wf, NODES)
    assert api["4"]["inputs"] == {"width": 32, "height": 32, "length": 5, "batch_size": 2}
    assert api["6"]["inputs"]["latent_image"] == ["4", 0]


def test_errors_name_the_node():
    wf = ui_workflow()
    next(n for n in wf["nodes"] if n["id"] == 3)["type"] = "MysteryNode"
    with pytest.raises(WorkflowFormatError, match=r"node 3 \(MysteryNode\)"):
        ui_to_api(wf, NODES)
    wf = ui_workflow()
    next(n for n in wf["nodes"] if n["id"] == 1)["widgets_values"] = []  # unet_name has no default
    with pytest.raises(WorkflowFormatError, match=r"node 1 \(UNETLoader\).*unet_name"):
        ui_to_api(wf, NODES)
    wf = ui_workflow()
    wf["links"] = [l for l in wf["links"] if l[0] != 6]
    with pytest.raises(WorkflowFormatError, match=r"node 6 \(KSampler\).*missing link 6"):
        ui_to_api(wf, NODES)


def test_missing_widget_value_uses_default():
    wf = ui_workflow()
    next(n for n in wf["nodes"] if n["id"] == 4)["widgets_values"] = [64, 48]
    api = ui_to_api(wf, NODES)
    assert api["4"]["inputs"] == {"width": 64, "height": 48, "length": 25, "batch_size": 1}


def test_load_workflow_both_formats(tmp_path):
    ui_path = tmp_path / "ui.json"
    ui_path.write_text(json.dumps(ui_workflow()))
    api, ui = load_workflow(ui_path, NODES)
    assert ui == ui_workflow() and api["6"]["inputs"]["seed"] == 1234
    api_path = tmp_path / "api.json"
    api_path.write_text(json.dumps(api))
    api2, ui2 = load_workflow(api_path, NODES)
    assert api2 == api and ui2 is None
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(WorkflowFormatError, match="bad.json"):
        load_workflow(tmp_path / "bad.json", NODES)


# -- set_widget_value: an API override written back into the UI workflow ------------
def _only(api, node_id, **changed):
    """`api` with node `node_id`'s inputs changed by `changed` (for comparisons)."""
    out = copy.deepcopy(api)
    out[node_id]["inputs"].update(changed)
    return out


def test_set_widget_value_lands_where_ui_to_api_reads_it():
    wf = ui_workflow()
    api = ui_to_api(wf, NODES)
    assert set_widget_value(wf, "6", "steps", 9, NODES) is None     # after seed + "randomize"
    assert set_widget_value(wf, 6, "denoise", 0.5, NODES) is None   # an int id works too
    assert set_widget_value(wf, "3", "std", 0.25, NODES) is None
    ks = next(n for n in wf["nodes"] if n["id"] == 6)
    assert ks["widgets_values"] == [42, "randomize", 9, 5.0, "euler", "simple", 0.5]
    assert ui_to_api(wf, NODES) == _only(_only(api, "6", steps=9, denoise=0.5), "3", std=0.25)


def test_set_widget_value_on_a_linked_widget_disconnects_the_link():
    """seed comes from a PrimitiveNode: the override replaces that link, as in the API."""
    wf = ui_workflow()
    api = ui_to_api(wf, NODES)
    note = set_widget_value(wf, "6", "seed", 4242, NODES)
    assert note == "disconnected the link from node 11"
    ks = next(n for n in wf["nodes"] if n["id"] == 6)
    assert ks["widgets_values"][:2] == [4242, "randomize"]
    assert next(i for i in ks["inputs"] if i["name"] == "seed")["link"] is None
    assert all(l[0] != 7 for l in wf["links"])
    assert next(n for n in wf["nodes"] if n["id"] == 11)["outputs"][0]["links"] == []
    assert ui_to_api(wf, NODES) == _only(api, "6", seed=4242)


def test_set_widget_value_fills_missing_values_and_dict_widgets():
    wf = ui_workflow()
    next(n for n in wf["nodes"] if n["id"] == 4)["widgets_values"] = [64, 48]
    api = ui_to_api(wf, NODES)
    set_widget_value(wf, "4", "batch_size", 3, NODES)
    assert next(n for n in wf["nodes"] if n["id"] == 4)["widgets_values"] == [64, 48, 25, 3]
    assert ui_to_api(wf, NODES) == _only(api, "4", batch_size=3)
    wf = ui_workflow()
    next(n for n in wf["nodes"] if n["id"] == 4)["widgets_values"] = {"width": 32, "height": 32}
    set_widget_value(wf, "4", "length", 5, NODES)
    assert ui_to_api(wf, NODES)["4"]["inputs"] == {"width": 32, "height": 32, "length": 5}


def test_set_widget_value_refuses_what_the_workflow_cannot_hold():
    wf = ui_workflow()
    before = copy.deepcopy(wf)
    with pytest.raises(WorkflowFormatError, match=r"node 6 \(KSampler\): 'model' is not a widget"):
        set_widget_value(wf, "6", "model", 1, NODES)
    with pytest.raises(WorkflowFormatError, match="node 99 is not in the UI workflow"):
        set_widget_value(wf, "99", "seed", 1, NODES)
    assert wf == before
