"""The pack registers in a real ComfyUI: imported without failure, every node in
/object_info exactly as the pack declares it, the web extension served."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Combo inputs whose values come from the host (ComfyUI), not from the pack: the
# in-process (bundled) INPUT_TYPES cannot be the reference for them.
KSAMPLER_COMBOS = ("sampler_name", "scheduler")
MODEL_FILE_COMBOS = {"lora_name": "loras"}
# options that list a model folder's files (the LoRA Stack's row picker): the server lists its own folder
MODEL_FILE_OPTIONS = {"lora_names": "loras"}


def _jsonable(x):
    return json.loads(json.dumps(x))


def _import_times_section(log: str) -> list[str]:
    lines = log.splitlines()
    starts = [i for i, ln in enumerate(lines) if "Import times for custom nodes" in ln]
    assert starts, "ComfyUI log has no 'Import times for custom nodes' section:\n" + "\n".join(lines[-40:])
    out = []
    for ln in lines[starts[-1] + 1:]:
        if "seconds" not in ln:
            break
        out.append(ln)
    return out


def test_pack_imports_without_failure(comfy):
    log = comfy.log_text()
    section = _import_times_section(log)
    ours = [ln for ln in section if ln.rstrip().endswith("/" + comfy.pack_link_name)]
    assert len(ours) == 1, f"the pack is not in the import times:\n" + "\n".join(section)
    assert "IMPORT FAILED" not in ours[0], ours[0]
    helper = [ln for ln in section if ln.rstrip().endswith("/" + comfy.helper_pack_name)]
    assert helper and "IMPORT FAILED" not in helper[0], "\n".join(section)
    failures = [ln for ln in log.splitlines() if "Cannot import" in ln and comfy.pack_link_name in ln]
    assert not failures, "\n".join(failures)


def test_every_node_is_registered_as_declared(comfy, pack):
    # /object_info as it is now: the model-file combos are compared with the folders as they are now,
    # and earlier tests of the session add LoRA files after the session's cached copy was taken
    status, object_info = comfy.get_json("/object_info")
    assert status == 200
    assert pack.NODE_CLASS_MAPPINGS, "the pack declares no nodes"
    missing = sorted(set(pack.NODE_CLASS_MAPPINGS) - set(object_info))
    assert not missing, f"not in /object_info: {missing}"
    for name, cls in pack.NODE_CLASS_MAPPINGS.items():
        info = object_info[name]
        where = f"{name}: "
        assert info["name"] == name
        assert info["python_module"] == f"custom_nodes.{comfy.pack_link_name}", where + info["python_module"]
        assert info["display_name"] == pack.NODE_DISPLAY_NAME_MAPPINGS.get(name, name), where + "display_name"
        assert info["category"] == cls.CATEGORY, where + "category"
        assert info["output"] == list(cls.RETURN_TYPES), where + "output"
        assert info["output_node"] == bool(getattr(cls, "OUTPUT_NODE", False)), where + "output_node"
        assert info["description"] == getattr(cls, "DESCRIPTION", ""), where + "description"
        if hasattr(cls, "RETURN_NAMES"):
            assert info["output_name"] == list(cls.RETURN_NAMES), where + "output_name"

        local = cls.INPUT_TYPES()
        for section in ("required", "optional"):
            want = local.get(section) or {}
            got = info["input"].get(section) or {}
            assert list(got) == list(want), f"{where}{section} inputs {list(got)} != {list(want)}"
            assert info["input_order"].get(section, []) == list(want), where + "input_order"
            for inp, spec in want.items():
                _check_input(comfy, object_info, f"{where}{section}.{inp}", inp, spec, got[inp])
        assert set(info["input"].get("hidden") or {}) == set(local.get("hidden") or {}), where + "hidden"


def _check_input(comfy, object_info, where, inp, spec, got):
    typ = spec[0]
    opts = _jsonable(spec[1]) if len(spec) > 1 else {}
    got_opts = got[1] if len(got) > 1 else {}
    if isinstance(typ, str):
        assert got[0] == typ, f"{where}: type {got[0]!r} != {typ!r}"
    else:  # combo
        assert isinstance(got[0], list), f"{where}: expected a combo, got {got[0]!r}"
        if inp in KSAMPLER_COMBOS:
            expected = object_info["KSampler"]["input"]["required"][inp][0]
        elif inp in MODEL_FILE_COMBOS:
            folder = comfy.models_dir / MODEL_FILE_COMBOS[inp]
            expected = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.safetensors"))
            assert sorted(got[0]) == expected, f"{where}: {got[0]} != files in {folder}"
            expected = got[0]
        else:
            expected = _jsonable(list(typ))
        assert got[0] == expected, f"{where}: combo {got[0]} != {expected}"
    for key, kind in MODEL_FILE_OPTIONS.items():
        if key in opts:
            folder = comfy.models_dir / kind
            files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.safetensors"))
            assert sorted(got_opts.get(key, [])) == files, f"{where}: option {key} != files in {folder}"
            opts = {k: v for k, v in opts.items() if k != key}
            got_opts = {k: v for k, v in got_opts.items() if k != key}
    assert got_opts == opts, f"{where}: options {got_opts} != {opts}"


def test_web_extension_is_served(comfy):
    files = sorted(p.relative_to(REPO / "web").as_posix() for p in (REPO / "web").rglob("*.js"))
    if not files:
        pytest.skip("the pack has no web/*.js")
    status, listed = comfy.get_json("/extensions")
    assert status == 200
    for f in files:
        url = f"/extensions/{comfy.pack_link_name}/{f}"
        assert url in listed, f"{url} not in /extensions"
        status, body = comfy._request("GET", url)
        assert status == 200 and body == (REPO / "web" / f).read_bytes(), url


DEMO_NODES = ("LoraRuntimeTinyTextEncode", "LoraRuntimeTinyDecode", "LoraRuntimeTinyEncode")


def test_embedded_model_helpers_are_in_a_marked_demo_category(object_info, pack):
    """The embedded model's helper nodes are listed apart from the LoRA nodes: a category of their own
    named demo, and names that say so; not flagged deprecated (ComfyUI would label them so)."""
    from comfyui_lora_runtime.nodes.tiny_nodes import CATEGORY as DEMO
    assert "demo" in DEMO and not DEMO.startswith("loaders/")
    for name in DEMO_NODES:
        info = object_info[name]
        assert info["category"] == DEMO, (name, info["category"])
        assert info["display_name"].startswith("Demo: ") and "embedded model only" in info["display_name"], info
        assert info["description"].startswith("Demo node for the pack's embedded tiny model only"), info
        assert not info.get("deprecated") and not info.get("experimental"), info
    for name in set(pack.NODE_CLASS_MAPPINGS) - set(DEMO_NODES):
        assert object_info[name]["category"] == "loaders/lora runtime", name
        assert "demo" not in object_info[name]["display_name"].lower(), name


def test_template_browser_lists_each_example_workflow_once(comfy):
    """/workflow_templates (ComfyUI's scan of example_workflows/, workflows/, examples/, ...: here workflows/) lists the
    pack's example workflows, each once, and each opens from its template route."""
    status, listed = comfy.get_json("/workflow_templates")
    assert status == 200
    ours = sorted(listed.get(comfy.pack_link_name, []))
    assert ours == sorted(p.stem for p in (REPO / "workflows").glob("*.json")), ours
    for name in ours[:2]:
        status, body = comfy._request("GET", f"/api/workflow_templates/{comfy.pack_link_name}/{name}.json")
        assert status == 200 and json.loads(body)["nodes"], name


def test_templates_come_from_workflows_with_their_thumbnails_and_never_the_api_prompts(comfy):
    """GET /api/workflow_templates (what Browse Templates reads) lists exactly workflows/*.json, each
    file and its NAME.jpg thumbnail served byte for byte from workflows/; none of the API-format
    prompts in workflows/api/ is listed (ComfyUI lists no subfolder)."""
    status, listed = comfy.get_json("/api/workflow_templates")
    assert status == 200
    ours = sorted(listed.get(comfy.pack_link_name, []))
    folder = REPO / "workflows"
    assert ours == sorted(p.stem for p in folder.glob("*.json")), ours
    api = sorted(p.name[:-len(".json")] for p in (folder / "api").glob("*.api.json"))
    assert api and not set(api) & set(ours), ours
    for name in ours:
        for ext in ("json", "jpg"):
            status, body = comfy._request("GET", f"/api/workflow_templates/{comfy.pack_link_name}/{name}.{ext}")
            assert status == 200 and body == (folder / f"{name}.{ext}").read_bytes(), (name, ext, status)
