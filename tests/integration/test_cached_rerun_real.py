"""A fully cached re-run still shows our nodes' UI (real ComfyUI 0.33+, CPU).

Our nodes that show something on the node set ``HAS_INTERMEDIATE_OUTPUT = True``; ComfyUI
0.33's ``execution.py`` (``_is_intermediate_output`` / ``_send_cached_ui``) re-sends the cached
UI of such nodes when a prompt runs entirely from the cache, so the coverage badge and the
report do not vanish from the editor and from ``/history``.

Graph (the reference tiny Wan, conditioning from the test-only helper node, as in
test_any_sampler_real.py): UNETLoader -> Load LoRA Adapter (11) -> KSampler (6) -> SaveLatent,
a LoRA Runtime Report (90) on the adapter's MODEL and the KSampler's LATENT, and a LoRA Sampler
(5) -> SaveLatent on the same MODEL. The prompt is queued once (everything runs), then the
identical prompt again from a fresh client id (a new websocket, as a reloaded editor tab):
every node is cached, none runs, and the second prompt's ``/history`` entry and the websocket's
``executed`` messages hold the adapter's ``lora_coverage`` and both ``lora_report`` outputs,
equal to the first run's. The report node (an output node that also sets the flag) gets two
``executed`` messages with the same output on 0.33: one when it is staged, one from the
end-of-prompt loop (a cached node never enters ``executed``); the other two get one each.

ComfyUI before HAS_INTERMEDIATE_OUTPUT (0.3.64: no ``_is_intermediate_output`` in its
``execution.py``) sends no ``executed`` message for a cached node that is not an output node
(its ``/history`` still lists the UI, from its UI cache): the test skips there.
"""
from __future__ import annotations

import contextlib
import copy
import uuid

import pytest
from testkit.comfyui.ws_client import open_websocket
from testkit.lora_assets import install_model_and_lora

LORA = "it_cached_rerun.safetensors"  # written here only: the first run cannot come from the cache
SETTINGS = {"seed": 7, "steps": 3, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple"}
ADAPTER, KSAMPLER, REPORT, LORA_SAMPLER = "11", "6", "90", "5"
UI_NODES = {ADAPTER: "lora_coverage", REPORT: "lora_report", LORA_SAMPLER: "lora_report"}


@pytest.fixture(scope="session")
def intermediate_output(comfy_checkout):
    """Skip unless the ComfyUI under test re-sends a cached HAS_INTERMEDIATE_OUTPUT node's UI.
    Session scope, so that it runs (and skips) before the session's server is started for these tests."""
    comfy_dir, _ = comfy_checkout
    src = (comfy_dir / "execution.py").read_text(encoding="utf-8", errors="replace")
    if "_is_intermediate_output" not in src:
        version = "?"
        vfile = comfy_dir / "comfyui_version.py"
        if vfile.is_file():
            for line in vfile.read_text(encoding="utf-8").splitlines():
                if line.startswith("__version__"):
                    version = line.split("=", 1)[1].strip().strip("\"'")
        pytest.skip(f"ComfyUI {version} predates HAS_INTERMEDIATE_OUTPUT (no _is_intermediate_output in "
                    "execution.py): it does not re-send a cached node's UI on a fully cached re-run")
    return True


@pytest.fixture(scope="module")
def assets(comfy, reference):
    install_model_and_lora(comfy, reference, LORA, seed=707)
    return comfy


@contextlib.contextmanager
def fresh_client(comfy):
    """Queue and follow prompts as another client (a new client id and its own /ws) inside the block."""
    old = comfy.client_id, comfy._ws
    comfy.client_id = uuid.uuid4().hex
    comfy._ws = open_websocket("127.0.0.1", comfy.port, f"/ws?clientId={comfy.client_id}")
    try:
        yield comfy.client_id
    finally:
        try:
            comfy._ws.close()
        finally:
            comfy.client_id, comfy._ws = old


def cached_rerun_prompt(cond_class: str) -> dict:
    tag = f"cached-rerun-{uuid.uuid4().hex}"  # nothing of a previous test's sampling is reused
    p = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan_d128_l2.safetensors",
                                                     "weight_dtype": "default"}},
        "2": {"class_type": cond_class, "inputs": {"which": "positive"}},
        "3": {"class_type": cond_class, "inputs": {"which": "zeros"}},
        "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1,
                                                                  "batch_size": 1}},
        "40": {"class_type": "ZZLoraRuntimeTestLatentTag", "inputs": {"samples": ["4", 0], "tag": tag}},
        ADAPTER: {"class_type": "LoraRuntimeLoadAdapter",
                  "inputs": {"model": ["1", 0], "lora_name": LORA, "strength": 0.8}},
    }
    sampling = dict(positive=["2", 0], negative=["3", 0], latent_image=["40", 0], denoise=1.0, **SETTINGS)
    p[KSAMPLER] = {"class_type": "KSampler", "inputs": {"model": [ADAPTER, 0], **sampling}}
    p["s6"] = {"class_type": "SaveLatent", "inputs": {"samples": [KSAMPLER, 0], "filename_prefix": "it_cached/ks"}}
    p[REPORT] = {"class_type": "LoraRuntimeReport", "inputs": {"model": [ADAPTER, 0], "latent": [KSAMPLER, 0]}}
    p[LORA_SAMPLER] = {"class_type": "LoraRuntimeSampler", "inputs": {"model": [ADAPTER, 0], **sampling}}
    p["s5"] = {"class_type": "SaveLatent", "inputs": {"samples": [LORA_SAMPLER, 0],
                                                      "filename_prefix": "it_cached/lrs"}}
    return p


def test_object_info_flags_our_ui_nodes(intermediate_output, comfy):
    # /object_info/<class> per node: the session's `object_info` snapshot is test_registration's
    # (taken here it would predate the adapter files later tests write into models/loras)
    # the LoRA Runtime Report is an output node: ComfyUI re-sends a cached output node's UI anyway
    for cls, flagged in (("LoraRuntimeLoadAdapter", True), ("LoraRuntimeSampler", True), ("LoraRuntimeReport", False)):
        status, info = comfy.get_json(f"/object_info/{cls}")
        assert status == 200 and cls in info, (cls, status)
        assert bool(info[cls].get("has_intermediate_output")) is flagged, (cls, info[cls])


def test_fully_cached_rerun_resends_coverage_and_reports(intermediate_output, assets):
    comfy = assets
    prompt = cached_rerun_prompt(comfy.helper_cond_class)

    first = comfy.run(copy.deepcopy(prompt))
    for nid in (ADAPTER, KSAMPLER, REPORT, LORA_SAMPLER):
        assert nid in first["executing"] and nid not in first["cached"], \
            f"node {nid} did not run in the first prompt (cached {first['cached']}); the re-run would prove nothing"
    out1 = first["history"]["outputs"]
    for nid, key in UI_NODES.items():
        assert key in out1.get(nid, {}), f"first run: no {key} for node {nid} in /history: {sorted(out1)}"
    (coverage,) = out1[ADAPTER]["lora_coverage"]
    assert coverage["matched"] == 20, coverage  # the tiny Wan's 20 Linear layers
    for nid in (REPORT, LORA_SAMPLER):
        (rep,) = out1[nid]["lora_report"]
        (ad,) = rep["adapters"]
        assert ad["name"] == LORA and ad["strength"] == pytest.approx(0.8), ad

    first_client = comfy.client_id
    with fresh_client(comfy) as client_id:
        assert client_id != first_client
        second = comfy.run(copy.deepcopy(prompt))
    assert comfy.client_id == first_client

    # every node came from the cache, none ran
    assert sorted(second["cached"]) == sorted(prompt), \
        f"not every node was cached: {sorted(set(prompt) - set(second['cached']))}"
    assert second["executing"] == [], f"nodes ran in the fully cached re-run: {second['executing']}"

    out2 = second["history"]["outputs"]
    for nid, key in UI_NODES.items():
        assert key in out2.get(nid, {}), \
            f"cached re-run: /history has no {key} for node {nid} ({prompt[nid]['class_type']}): {sorted(out2)}"
        assert out2[nid][key] == out1[nid][key], f"cached re-run: node {nid}'s {key} differs from the first run's"
        # the websocket of the new client got the node's cached UI as an "executed" message
        assert nid in second["executed"], \
            f"cached re-run: no 'executed' message for node {nid} ({prompt[nid]['class_type']}) on the new client"
        assert (second["executed"][nid] or {}).get(key) == out1[nid][key], (nid, second["executed"][nid])
        sent = [e["data"] for e in second["events"] if e["type"] == "executed" and e["data"]["node"] == nid]
        print(f"cached re-run: node {nid} ({prompt[nid]['class_type']}): {len(sent)} 'executed' message(s)")
        for ev in sent:
            assert ev["display_node"] == nid and ev["prompt_id"] == second["prompt_id"], ev
            assert ev["output"] == {key: out1[nid][key]}, (nid, ev["output"])
        # each cached node's UI is sent once: a non-output node's by ComfyUI 0.33's end-of-prompt loop
        # (HAS_INTERMEDIATE_OUTPUT), the output node's (LoRA Runtime Report) when it is staged
        assert len(sent) == 1, (nid, sent)
