"""The pack's frontend extension in a real browser: ComfyUI's editor in headless Chromium.

One driver run (``tests/testkit/comfyui/editor_driver.cjs``, Node + playwright-core, no browser
download: the system Chromium) goes through the editor the way a user does, stage by
stage, and writes what it saw to a JSON file; the tests below check it stage by stage:

1. the editor loads with the pack's extension (console and page errors recorded from the start);
2. a UI-format workflow file is dragged onto the canvas: a ``drop`` event whose
   DataTransfer holds the File, dispatched on the canvas element (the editor's own
   document-level drop handler loads it) - our nodes keep their widget values;
   then the title font: the one the canvas draws every title in (read off one redraw) is the
   frontend's own, loaded and drawn as itself, the extension measures with it, and a node added
   as the node list adds one is exactly as wide as its title in it needs;
3. a PNG the pack saved (the bundled host's SaveImage, ``python -m comfyui_lora_runtime
   run``: ``prompt``/``workflow`` text chunks) is dropped the same way;
4. the Run button is clicked; after execution_success the sampler shows its report
   (merge decision, adapter coverage, ...) in its DOM widget, the adapter node its
   coverage, and ``node.properties`` hold the same report as ``/history``; no node was
   widened (a line wider than its node ends in an ellipsis, whole in its hover text);
   then the layout (every node's box from ``app.graph``, title bar included): no two nodes
   overlap, no node moved or changed width, and no widget label the canvas drew whole
   before the run is cut after it (labels read off one redraw, see ``pageLayout``);
   and with a node moved right under the sampler the report folds to one line (no
   overlap), a click shows every line, another folds it, the node moved back: every line;
5. ``LoraRuntime.ShowBadges`` off hides the report (and shrinks the node), on shows it;
6. the saved workflow re-loaded shows the report again from ``node.properties``;
7. the Vue node renderer (``Comfy.VueNodes.Enabled``, frontend 1.27: hidden/experimental):
   the report is shown inside the node's element (switched on with a report there, after a
   run in Vue mode: the new report, setting off/on), and nothing is added to the prompt;
8. the classic canvas again;
9. ComfyUI's own ``KSampler`` in the sampler's place, with a ``LoraRuntimeReport`` node fed by
   the same MODEL and the KSampler's LATENT (the workflow is built here from the one above,
   see ``stock_sampler_workflow``), dropped and run from the Run button: the server's
   ``lora_runtime.report`` event puts the report on the KSampler (DOM widget, decision line),
   the report node shows it too, ``/history`` holds the report node's ``lora_report`` equal
   to the KSampler's ``node.properties``, and it comes back when the workflow is re-loaded;
10. *Browse Templates* (the frontend's ``Comfy.BrowseTemplates`` command): the dialog lists the
   pack's workflows (``GET /api/workflow_templates``: ``workflows/*.json``), the pack's category
   (or the search box) shows ``embedded_style``'s card, a click loads it with its saved values
   and closes the dialog, and the Run button runs it with the report on the sampler;
and no console/page errors beyond the listed benign ones.

A second browser session (``tests/testkit/comfyui/editor_vue_stack.cjs``) runs the LoRA Stack in the
Vue node renderer: ``workflows/embedded_style_stack.json`` dropped with ``Comfy.VueNodes.Enabled``
on; + Add LoRA, a row's on/off toggle (off, then on) and a row's remove clicked in the Vue node (the
rows JSON, the widgets and what the node shows agree after each); the Run button; the sampler's
report and the stack's coverage inside their Vue nodes, equal to ``/history``. It skips, saying so,
on a frontend without the Vue node renderer.

Workflow: ``workflows/embedded_style.json`` with the embedded model when its files are
in ``standalone/models/`` (tiny_wan_glyphs + its loras); until then the same graph on the reference
tiny Wan (``tiny_wan_d128_l2``, as test_workflows_real) with a generated kohya adapter.

Environment (the tests skip, saying why, without them; nothing is downloaded):

- ``LORA_RUNTIME_CHROMIUM``: a Chromium/Chrome binary (e.g. ``/usr/bin/chromium``);
- ``LORA_RUNTIME_PLAYWRIGHT_DIR``: a playwright-core package folder
  (e.g. ``/work/browser-tools/node_modules/playwright-core``);
- ``LORA_RUNTIME_NODE``: the node binary (default: ``node`` on PATH);
- ``LORA_RUNTIME_BROWSER_MODEL=reference``: use the reference tiny Wan even when the embedded
  model is there;
- ``LORA_RUNTIME_UPDATE_DOCS_SCREENSHOT=1``: also write ``docs/editor_lora_nodes.png``
  (otherwise the candidate goes to ``test-output/browser/`` only);
- ``LORA_RUNTIME_DEJAVU_DIR``: the folder of DejaVuSans.ttf (default: found under /usr/share/fonts);
- ``LORA_RUNTIME_FRONTEND_ROOT`` (read by the server harness): serve another frontend build, e.g.
  the ``static`` folder of the ``comfyui_frontend_package`` 1.58.1 wheel (``--front-end-root``).

Fonts: Chromium runs with a fontconfig file that holds DejaVu Sans only, so a system family such as
frontend 1.27's "Arial" is drawn in DejaVu Sans, about 16 % wider than Arial's metrics (Liberation
Sans): the widest common fallback. Frontends 1.49 and 1.58 draw titles and labels in the Inter web
font they ship (about 8 % narrower than DejaVu Sans). The saved workflow must load with no node
grown past its saved size, every title whole, and no overlap, in either.

Screenshots of every stage: ``test-output/browser/`` (gitignored).
"""
from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DRIVER = HERE.parent / "testkit" / "comfyui" / "editor_driver.cjs"
VUE_STACK_DRIVER = HERE.parent / "testkit" / "comfyui" / "editor_vue_stack.cjs"
SCREENSHOT_DIR = REPO / "test-output" / "browser"
DOCS_SCREENSHOT = REPO / "docs" / "editor_lora_nodes.png"
DOCS_MAX_BYTES = 300 * 1024

ENV_CHROMIUM = "LORA_RUNTIME_CHROMIUM"
ENV_PLAYWRIGHT = "LORA_RUNTIME_PLAYWRIGHT_DIR"
ENV_NODE = "LORA_RUNTIME_NODE"
ENV_UPDATE_DOCS = "LORA_RUNTIME_UPDATE_DOCS_SCREENSHOT"
ENV_DEJAVU = "LORA_RUNTIME_DEJAVU_DIR"
# DejaVu Sans at 14 px, the negative prompt's title (PIL's advance; Chromium within a pixel)
FONT_PROBE_TEXT = "Negative prompt (empty = unconditional)"
FONT_PROBE_DEJAVU_PX = 294.06
# the family each frontend draws node titles in (LiteGraph.NODE_FONT): 1.27 names Arial, a system
# family (drawn here in the harness's DejaVu Sans); 1.49 and 1.58 ship the Inter web font
KNOWN_TITLE_FAMILIES = {(1, 27): "Arial", (1, 49): "Inter", (1, 58): "Inter"}

WORKFLOW = REPO / "workflows" / "embedded_style.json"
STACK_WORKFLOW = REPO / "workflows" / "embedded_style_stack.json"
STACK_ID, STACK_SAMPLER_ID = 2, 8  # node ids in embedded_style_stack.json
# Why the Vue stack session stops on frontends before 1.49 (seen on 1.27.10, where the setting is hidden):
VUE_STACK_OLD_FRONTEND = ("its Vue node renderer (hidden, experimental) does not re-render a node's widgets that "
                          "an extension adds or removes after the node is shown (+ Add LoRA changes the rows "
                          "JSON, the Vue node keeps its old rows until the renderer is switched off and on)")
API_WORKFLOW = REPO / "workflows" / "api" / "embedded_style.api.json"
EMBEDDED_MODEL = REPO / "standalone" / "models" / "diffusion_models" / "tiny_wan_glyphs.safetensors"
EMBEDDED_LORAS = REPO / "standalone" / "models" / "loras"
REFERENCE_MODEL = "tiny_wan_d128_l2.safetensors"
FALLBACK_LORA = "it_browser_style.safetensors"

# node ids in embedded_style.ui.json
UNET_ID, ADAPTER_ID, MODE_ID, TIER_ID, SAMPLER_ID = 1, 2, 3, 4, 8
DOCS_NODE_IDS = [UNET_ID, ADAPTER_ID, MODE_ID, TIER_ID, SAMPLER_ID]
FOLD_NEIGHBOUR_ID = 9  # Tiny Decode: moved under the sampler in the fold stage, then back
# the stock-sampler workflow (stock_sampler_workflow): KSampler in the sampler's place, a report node
STOCK_SAMPLER_ID, STOCK_REPORT_ID = SAMPLER_ID, 11
OUR_TYPES = ("LoraRuntimeLoadAdapter", "LoraRuntimeMergeMode", "LoraRuntimeQualityTier", "LoraRuntimeSampler")

PROMPT_TIMEOUT_S = float(os.environ.get("COMFYUI_PROMPT_TIMEOUT", "300"))
DRIVER_TIMEOUT_S = 300 + 4 * PROMPT_TIMEOUT_S  # load + 3 runs + every bounded wait, with room
PNG_TIMEOUT_S = 600

# Console messages / page errors ComfyUI 0.3.64 + frontend 1.27.10 (and 0.33.0 + frontend 1.49.6)
# produce on their own in a fresh --base-directory with no network; nothing else may show up.
# (type, text regex, url regex). Besides, no console error / warning may have our extension on its
# stack (results["consoleStacks"], recorded through CDP).
BENIGN_CONSOLE = [
    # a fresh user folder: no user.css, no saved workflows / subgraphs, no templates index
    ("error", r"^Failed to load resource: the server responded with a status of 404 \(Not Found\)$",
     r"^http://127\.0\.0\.1:\d+/(api/userdata/user\.css|user\.css|api/userdata/comfy\.templates\.json"
     r"|api/userdata\?dir=(workflows|subgraphs%2F|subgraphs)&.*)$"),
    # frontend 1.49.6 at start-up: a core setting's onChange reads app.rootGraph before the graph
    # exists (logged by ComfyApp.rootGraph, called from the setting store; not from our code: the
    # stack check in test_no_console_or_page_errors)
    ("error", r"^ComfyApp graph accessed before initialization$", r"/assets/settingStore-[\w-]+\.js$"),
    # requests off 127.0.0.1 (api.comfy.org release notes) are aborted by the driver
    ("error", r"^Failed to load resource: net::ERR_BLOCKED_BY_CLIENT", r"^https?://(?!127\.0\.0\.1[:/])"),
]
BENIGN_PAGE_ERRORS = [
    # frontend 1.27.10, first start of a new user: the Comfy.Canvas.NavigationMode setting's
    # onChange sets Comfy.Canvas.LeftMouseClickBehavior before that setting is registered
    # (useSettingStore.set -> onChange(undefined...) -> setting.id); core code only.
    (r"^Cannot read properties of undefined \(reading 'id'\)$", r"at Proxy\.addSetting \(.*/assets/index-"),
]
OUR_EXTENSION_URL = "/extensions/comfyui-lora-runtime/"

# the browser tools first: without them every test skips before the ComfyUI server starts
pytestmark = pytest.mark.usefixtures("browser_tools")


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def png_text_chunks(path: Path) -> dict[str, str]:
    """tEXt / zTXt / iTXt chunks of a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, out = 8, {}
    while pos + 8 <= len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if kind == b"tEXt":
            k, _, v = body.partition(b"\0")
            out[k.decode("latin-1")] = v.decode("latin-1")
        elif kind == b"zTXt":
            k, _, v = body.partition(b"\0")
            out[k.decode("latin-1")] = zlib.decompress(v[1:]).decode("latin-1")
        elif kind == b"iTXt":
            k, _, rest = body.partition(b"\0")
            compressed, rest = rest[0], rest[2:]
            _lang, _, rest = rest.partition(b"\0")
            _tkey, _, text = rest.partition(b"\0")
            out[k.decode("utf-8")] = (zlib.decompress(text) if compressed else text).decode("utf-8")
        elif kind == b"IEND":
            break
        pos += 12 + n
    return out


def expected_nodes(ui_workflow: dict) -> dict[str, dict]:
    return {str(n["id"]): {"type": n["type"], "widgets_values": n.get("widgets_values", [])}
            for n in ui_workflow["nodes"]}


def write_kohya_lora(path: Path, *, seed: int, rank: int = 4, alpha: float = 4.0) -> None:
    """A kohya adapter for every linear of the reference tiny Wan (dim 128, 2 blocks)."""
    import torch
    from safetensors.torch import save_file

    dim, ffn = 128, 512
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for b in range(2):
        mods = [(f"blocks.{b}.{a}.{p}", dim, dim) for a in ("self_attn", "cross_attn") for p in "qkvo"]
        mods += [(f"blocks.{b}.ffn.0", dim, ffn), (f"blocks.{b}.ffn.2", ffn, dim)]
        for name, fan_in, fan_out in mods:
            sd[f"diffusion_model.{name}.lora_down.weight"] = torch.randn(rank, fan_in, generator=g) / math.sqrt(fan_in)
            sd[f"diffusion_model.{name}.lora_up.weight"] = (torch.randn(fan_out, rank, generator=g)
                                                            * (0.5 * math.sqrt(rank) / alpha))
            sd[f"diffusion_model.{name}.alpha"] = torch.tensor(float(alpha))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path), metadata={"written_by": "comfyui-lora-runtime browser tests"})


def stock_sampler_workflow(ui: dict) -> dict:
    """The same graph with ComfyUI's ``KSampler`` in the LoRA Sampler's place (same widgets, same
    inputs), and a ``LoraRuntimeReport`` node fed by the MODEL that feeds the KSampler and by the
    KSampler's LATENT, placed in the next column 400 lower (nothing under the KSampler)."""
    wf = copy.deepcopy(ui)
    nodes = {n["id"]: n for n in wf["nodes"]}
    sampler = nodes[SAMPLER_ID]
    assert sampler["type"] == "LoraRuntimeSampler", sampler["type"]
    assert STOCK_REPORT_ID not in nodes
    sampler["type"] = "KSampler"
    sampler["properties"] = {"Node name for S&R": "KSampler"}
    sampler.pop("title", None)
    model_link = next(ln for ln in wf["links"] if ln[3] == SAMPLER_ID and ln[5] == "MODEL")
    origin, origin_slot = model_link[1], model_link[2]
    first = int(wf["last_link_id"]) + 1
    wf["links"] += [[first, origin, origin_slot, STOCK_REPORT_ID, 0, "MODEL"],
                    [first + 1, SAMPLER_ID, 0, STOCK_REPORT_ID, 1, "LATENT"]]
    nodes[origin]["outputs"][origin_slot]["links"].append(first)
    sampler["outputs"][0]["links"].append(first + 1)
    wf["nodes"].append({
        "id": STOCK_REPORT_ID, "type": "LoraRuntimeReport",
        "pos": [sampler["pos"][0] + sampler["size"][0] + 50, sampler["pos"][1] + 400], "size": [300, 130],
        "flags": {}, "order": len(wf["nodes"]), "mode": 0,
        "inputs": [{"name": "model", "type": "MODEL", "link": first},
                   {"name": "latent", "type": "LATENT", "link": first + 1}],
        "outputs": [], "properties": {"Node name for S&R": "LoraRuntimeReport"}, "widgets_values": []})
    wf["last_node_id"] = max(int(wf["last_node_id"]), STOCK_REPORT_ID)
    wf["last_link_id"] = first + 1
    return wf


def _embedded_files_present(ui: dict) -> bool:
    if not EMBEDDED_MODEL.is_file():
        return False
    loras = [n["widgets_values"][0] for n in ui["nodes"] if n["type"] == "LoraRuntimeLoadAdapter"]
    return all((EMBEDDED_LORAS / name).is_file() for name in loras)


def _is_benign_console(entry: dict) -> bool:
    return any(entry["type"] == t and re.search(text, entry["text"]) and re.search(url, entry.get("url") or "")
               for t, text, url in BENIGN_CONSOLE)


def _is_benign_page_error(err: dict) -> bool:
    if OUR_EXTENSION_URL in (err.get("stack") or ""):
        return False
    return any(re.search(msg, err["message"]) and re.search(stack, err.get("stack") or "")
               for msg, stack in BENIGN_PAGE_ERRORS)


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------
@pytest.fixture(scope="session")  # session: checked before the (session) ComfyUI server starts
def browser_tools() -> dict:
    chromium = os.environ.get(ENV_CHROMIUM)
    playwright = os.environ.get(ENV_PLAYWRIGHT)
    node = os.environ.get(ENV_NODE) or shutil.which("node")
    missing = []
    if not chromium or not os.access(chromium, os.X_OK):
        missing.append(f"{ENV_CHROMIUM} (a Chromium binary, e.g. /usr/bin/chromium; now {chromium!r})")
    if not playwright or not (Path(playwright) / "package.json").is_file():
        missing.append(f"{ENV_PLAYWRIGHT} (a playwright-core package folder; now {playwright!r})")
    if not node or not shutil.which(node):
        missing.append(f"{ENV_NODE} or node on PATH (now {node!r})")
    dejavu = _dejavu_dir()
    if dejavu is None:
        missing.append(f"{ENV_DEJAVU} (the folder of DejaVuSans.ttf; none under /usr/share/fonts)")
    if missing:
        pytest.skip("browser tests need " + "; ".join(missing))
    return {"chromium": chromium, "playwright": str(Path(playwright).resolve()), "node": shutil.which(node),
            "dejavu": dejavu}


def _dejavu_dir() -> Path | None:
    given = os.environ.get(ENV_DEJAVU)
    if given:
        return Path(given) if (Path(given) / "DejaVuSans.ttf").is_file() else None
    found = sorted(Path("/usr/share/fonts").rglob("DejaVuSans.ttf")) if Path("/usr/share/fonts").is_dir() else []
    return found[0].parent if found else None


def dejavu_only_fontconfig(font_dir: Path, work: Path) -> Path:
    """A fontconfig file with DejaVu's folder only, every generic and Arial family mapped to it."""
    aliases = "".join(
        f"<alias><family>{fam}</family><prefer><family>{to}</family></prefer></alias>"
        for fam, to in [("Arial", "DejaVu Sans"), ("Helvetica", "DejaVu Sans"), ("sans-serif", "DejaVu Sans"),
                        ("system-ui", "DejaVu Sans"), ("serif", "DejaVu Serif"), ("monospace", "DejaVu Sans Mono")])
    conf = work / "fonts-dejavu-only.conf"
    (work / "fontcache").mkdir(parents=True, exist_ok=True)
    conf.write_text('<?xml version="1.0"?>\n<!DOCTYPE fontconfig SYSTEM "fonts.dtd">\n<fontconfig>'
                    f"<dir>{font_dir}</dir><cachedir>{work / 'fontcache'}</cachedir>{aliases}</fontconfig>\n",
                    encoding="utf-8")
    return conf


@pytest.fixture(scope="module")
def editor_assets(browser_tools, comfy, tmp_path_factory) -> dict:
    """The workflow to drop (embedded_style.ui.json, or the same graph on the reference tiny Wan),
    its models in the server's models folder, and a PNG the pack saved from it."""
    work = tmp_path_factory.mktemp("browser-assets")
    ui = json.loads(WORKFLOW.read_text(encoding="utf-8"))
    api = json.loads(API_WORKFLOW.read_text(encoding="utf-8"))
    if _embedded_files_present(ui) and os.environ.get("LORA_RUNTIME_BROWSER_MODEL") != "reference":
        mode = "embedded"
        shutil.copyfile(EMBEDDED_MODEL, comfy.diffusion_models_dir / EMBEDDED_MODEL.name)
        for f in EMBEDDED_LORAS.rglob("*.safetensors"):
            dst = comfy.loras_dir / f.relative_to(EMBEDDED_LORAS)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
    else:
        mode = "reference"
        ref = Path(os.environ.get("LORA_RUNTIME_REFERENCE_DIR") or REPO.parent / "shared" / "reference")
        shutil.copyfile(ref / REFERENCE_MODEL, comfy.diffusion_models_dir / REFERENCE_MODEL)
        write_kohya_lora(comfy.loras_dir / FALLBACK_LORA, seed=404)
        for n in ui["nodes"]:
            if n["type"] == "UNETLoader":
                n["widgets_values"][0] = REFERENCE_MODEL
            elif n["type"] == "LoraRuntimeLoadAdapter":
                n["widgets_values"][0] = FALLBACK_LORA
        for n in api.values():
            if n["class_type"] == "UNETLoader":
                n["inputs"]["unet_name"] = REFERENCE_MODEL
            elif n["class_type"] == "LoraRuntimeLoadAdapter":
                n["inputs"]["lora_name"] = FALLBACK_LORA
    wf_path = work / WORKFLOW.name  # the name the editor shows for the dropped file
    wf_path.write_text(json.dumps(ui, indent=1), encoding="utf-8")
    stock = stock_sampler_workflow(ui)
    stock_path = work / "stock_ksampler_style.ui.json"
    stock_path.write_text(json.dumps(stock, indent=1), encoding="utf-8")

    # a PNG the pack saved: the bundled host's SaveImage (prompt + workflow chunks) ...
    out = work / "png"
    png_source = None
    if importlib.util.find_spec("comfyui_lora_runtime") is not None:
        cmd = [sys.executable, "-m", "comfyui_lora_runtime", "run", str(wf_path), "--output", str(out),
               "--models", str(comfy.models_dir)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PNG_TIMEOUT_S, cwd=str(work))
        assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        png_source = "bundled host: python -m comfyui_lora_runtime run (SaveImage)"
    else:
        # ... or, without the pack importable here, ComfyUI's own SaveImage from a queued run
        status, answer = comfy.post_json("/prompt", {"prompt": api, "client_id": comfy.client_id,
                                                     "extra_data": {"extra_pnginfo": {"workflow": ui}}})
        assert status == 200, answer
        record = comfy.wait(answer["prompt_id"])
        for item in (record["executed"].get("10") or {}).get("images", []):
            raw = comfy.fetch_image(item["filename"], item.get("subfolder", ""), item.get("type", "output"))
            out.mkdir(parents=True, exist_ok=True)
            (out / item["filename"]).write_bytes(raw)
        png_source = "ComfyUI SaveImage (POST /prompt with extra_pnginfo.workflow)"
    pngs = sorted(out.rglob("*.png"))
    assert pngs, f"no PNG written under {out}"
    png = pngs[0]
    chunks = png_text_chunks(png)
    assert "workflow" in chunks and "prompt" in chunks, f"{png.name}: text chunks {sorted(chunks)}"
    png_workflow = json.loads(chunks["workflow"])
    return {"mode": mode, "workflow_path": wf_path, "workflow": ui, "png_path": png, "png_source": png_source,
            "stock_path": stock_path, "stock_workflow": stock,
            "png_workflow": png_workflow, "adapter_name": next(
                n["widgets_values"][0] for n in ui["nodes"] if n["type"] == "LoraRuntimeLoadAdapter")}


def _driver_base(browser_tools: dict, comfy, work: Path, shots: Path) -> dict:
    """The settings every driver run starts from, and the config keys every driver reads. A returning
    user: no "Get started with a template" dialog over the canvas; and no minimap panel over the
    canvas' bottom-right corner (set before the editor starts: switching it off later makes frontend
    1.27.10 log "Attempted to cleanup event listeners for graph that was never set up"). No cached
    node outputs: every node of the first run executes (and reports)."""
    status, _ = comfy.post_json("/settings", {"Comfy.TutorialCompleted": True, "Comfy.Minimap.Visible": False})
    assert status == 200
    comfy.free()
    return {
        "url": comfy.url + "/",
        "chromium": browser_tools["chromium"],
        "playwrightDir": browser_tools["playwright"],
        "userDataDir": str(work / "chromium-profile"),
        "fontconfigFile": str(dejavu_only_fontconfig(browser_tools["dejavu"], work)),
        "screenshotDir": str(shots),
    }


@pytest.fixture(scope="module")
def editor_session(browser_tools, comfy, editor_assets, tmp_path_factory) -> dict:
    """Run the driver once; its results (stages, console, screenshots) for the tests below."""
    work = tmp_path_factory.mktemp("browser-run")
    if SCREENSHOT_DIR.exists():
        for old in SCREENSHOT_DIR.glob("*.png"):
            old.unlink()
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    cfg = _driver_base(browser_tools, comfy, work, SCREENSHOT_DIR)
    time.sleep(1.0)
    update_docs = os.environ.get(ENV_UPDATE_DOCS) == "1"
    cfg |= {
        "docsScreenshot": str(DOCS_SCREENSHOT if update_docs else SCREENSHOT_DIR / "editor_lora_nodes.png"),
        "uiWorkflow": {"path": str(editor_assets["workflow_path"]), "name": editor_assets["workflow_path"].name,
                       "expected": expected_nodes(editor_assets["workflow"])},
        "png": {"path": str(editor_assets["png_path"]), "name": editor_assets["png_path"].name,
                "expected": expected_nodes(editor_assets["png_workflow"])},
        "samplerId": SAMPLER_ID,
        "adapterId": ADAPTER_ID,
        "foldNeighbourId": FOLD_NEIGHBOUR_ID,
        "stock": {"workflow": {"path": str(editor_assets["stock_path"]), "name": editor_assets["stock_path"].name,
                               "expected": expected_nodes(editor_assets["stock_workflow"])},
                  "samplerId": STOCK_SAMPLER_ID, "reportId": STOCK_REPORT_ID},
        # Browse Templates: the pack's own workflows/embedded_style.json as ComfyUI serves it (runs when
        # the embedded model is in the server's model folders)
        "template": {"pack": comfy.pack_link_name, "name": WORKFLOW.stem,
                     "expected": expected_nodes(json.loads(WORKFLOW.read_text(encoding="utf-8"))),
                     "run": editor_assets["mode"] == "embedded", "samplerId": SAMPLER_ID},
        "docsNodeIds": DOCS_NODE_IDS,  # the part of the graph the stage screenshots show
        # the title font stage: the font the canvas draws titles in, and a node added as the node list does
        "titleFont": {"nodeType": "LoraRuntimeReport", "probe": FONT_PROBE_TEXT,
                      "extensionPath": f"{OUR_EXTENSION_URL}lora_runtime.js"},
        "docsShotNodeIds": [int(n["id"]) for n in editor_assets["workflow"]["nodes"]],
        "docsViewport": {"width": 2400, "height": 900},
        "layoutViewport": {"width": 3400, "height": 1100},  # the whole graph at 100 % for the layout checks
        "assetsMode": editor_assets["mode"],
        "pngSource": editor_assets["png_source"],
        "timeouts": {"action": 30_000, "load": 120_000, "run": int(PROMPT_TIMEOUT_S * 1000)},
        "hardStopSeconds": int(DRIVER_TIMEOUT_S),
    }
    results = _run_driver(browser_tools, comfy, DRIVER, cfg, work)
    results["config"] = cfg
    (SCREENSHOT_DIR / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    return results


def _run_driver(browser_tools: dict, comfy, driver: Path, cfg: dict, work: Path) -> dict:
    """Run a browser driver on `cfg` (killed a minute after its own hard stop); its results, with what it
    printed as "driver_output". No proxy variables reach it: 127.0.0.1 only."""
    cfg_path, res_path = work / "config.json", work / "results.json"
    cfg_path.write_text(json.dumps(cfg, indent=1), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    limit = cfg["hardStopSeconds"] + 60
    try:
        proc = subprocess.run([browser_tools["node"], str(driver), str(cfg_path), str(res_path)],
                              capture_output=True, text=True, timeout=limit, env=env)
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        output = f"driver killed after {limit} s\n{e.stdout or ''}{e.stderr or ''}"
    if not res_path.is_file():
        pytest.fail(f"{driver.name} wrote no results:\n{output}\n{comfy.log_tail()}")
    results = json.loads(res_path.read_text(encoding="utf-8"))
    results["driver_output"] = output
    return results


def _stage(session: dict, name: str) -> dict:
    st = session["stages"].get(name)
    if st is None:
        pytest.fail(f"stage {name!r} did not run (driver: {session.get('error')})\n"
                    + "\n".join(session.get("log", [])))
    return st


def _ok(session: dict, name: str) -> dict:
    st = _stage(session, name)
    assert st["ok"], f"stage {name} failed: {st.get('error')}\n" + "\n".join(session.get("log", []))
    return st


def _history_outputs(comfy, prompt_id: str) -> dict:
    entry = comfy.history(prompt_id)
    assert entry.get("status", {}).get("completed"), f"prompt {prompt_id} not completed: {entry.get('status')}"
    return entry["outputs"]


def _check_report_text(report_state: dict, report: dict, adapter_name: str) -> None:
    """The widget's lines say what the report says: decision first, then the adapter coverage."""
    lines = [ln["text"] for ln in report_state["lines"]]
    assert lines, "the report widget is empty"
    chosen = report["decision"]["chosen"]
    word = {"merge": "merged", "dynamic": "dynamic"}[chosen]
    assert lines[0].startswith(word), f"decision line {lines[0]!r} does not say {word!r} (chosen: {chosen})"
    cov = report["adapters"][0]["coverage"]
    # the layer count and this adapter's decision first, then the file (a cut line keeps them)
    own = {"merge": "merged", "dynamic": "dynamic"}.get((report["adapters"][0].get("decision") or {}).get("chosen"))
    head = f"{cov['matched']}/{cov['file_layers']} layers" + (f" · {own}" if own else "")
    coverage_line = [ln for ln in lines if ln.startswith(head)]
    assert coverage_line, f"no line starting {head!r} in {lines}"
    assert f" · {short_name(adapter_name)}" in coverage_line[0], coverage_line[0]
    assert any(ln.startswith(f"tier {report['tier']} · mode {report['mode_requested']}") for ln in lines), lines


def short_name(name: str, limit: int = 28) -> str:
    """A file name as the report lines show it (web/lora_report_format.js shortName)."""
    stem = re.sub(r"\.safetensors$", "", name, flags=re.I)
    if len(stem) <= limit:
        return stem
    head = (limit - 1 + 1) // 2
    return stem[:head] + "\u2026" + stem[len(stem) - (limit - 1 - head):]


def _check_lines_clamped(report_state: dict, width_before: float) -> None:
    """The node kept its width: each line is one line within it, cut with an ellipsis when wider,
    its hover text starting with the whole line."""
    assert abs(report_state["nodeSize"][0] - width_before) <= 1, \
        f"the node was widened from {width_before} to {report_state['nodeSize'][0]}"
    for ln in report_state["lines"]:
        assert ln["whiteSpace"] == "nowrap" and ln["textOverflow"] == "ellipsis", ln
        assert 0 < ln["clientWidth"], ln
        if not ln["collapsed"]:
            assert ln["title"].startswith(ln["text"]), ln


def _layout_node(layout: dict, node_id: int) -> dict:
    return next(n for n in layout["nodes"] if str(n["id"]) == str(node_id))  # 1.49: string ids


def _check_layout(before: dict, after: dict, overlaps: list) -> None:
    """No two nodes overlap; no node moved or changed width; no label drawn whole before is cut."""
    assert not overlaps, "overlapping nodes: " + json.dumps(overlaps, indent=1)
    assert not after["lowQuality"] and after["scale"] >= 0.9, (after["scale"], after["lowQuality"])
    for b in before["nodes"]:
        a = _layout_node(after, b["id"])
        assert a["pos"] == b["pos"], f"node {b['id']} ({b['type']}) moved: {b['pos']} -> {a['pos']}"
        assert abs(a["size"][0] - b["size"][0]) <= 0.5, \
            f"node {b['id']} ({b['type']}) width {b['size'][0]} -> {a['size'][0]}"
        was = {lb["name"]: lb["state"] for lb in b["labels"]}
        for lb in a["labels"]:
            if was.get(lb["name"]) == "whole":
                assert lb["state"] == "whole", f"node {b['id']} ({b['type']}): label {lb['label']!r} " \
                                               f"{lb['state']} after the run"


def _check_vue_report(state: dict, key: str) -> None:
    """The report is shown inside the node's own element (Vue node renderer)."""
    assert state["shownBy"] == "vue-node", (key, state)
    assert state["connected"] and state["visible"] and state["insideVueNode"], (key, state)
    assert state["visibleReportsInNode"] == 1, f"{key}: the Vue node shows the report " \
                                               f"{state['visibleReportsInNode']} times"
    assert state["lines"] and state["text"].strip(), (key, state)
    assert " | ".join(ln["text"] for ln in state["lines"]) == state["properties"]["lora_runtime_summary"], (key, state)


# ---------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------
def test_editor_loads_with_our_extension(editor_session):
    st = _ok(editor_session, "load")
    assert "comfyui_lora_runtime.report" in st["extensions"]
    assert st["showBadges"] is True, "LoraRuntime.ShowBadges should default to on"
    assert st["runButton"], "no Run button ([data-testid=queue-button]) in the editor"
    assert st["frontendVersion"], "window.__COMFYUI_FRONTEND_VERSION__ not set"


def test_titles_are_drawn_in_the_font_the_frontend_ships_with_no_fallback(editor_session):
    """The canvas draws every title in one font, the frontend's own (LiteGraph's NODE_TEXT_SIZE and
    NODE_FONT). A web font the frontend ships (Inter, 1.49+) is loaded and drawn as itself, not in a
    fallback; a system family (Arial, 1.27) comes from the harness's fontconfig, DejaVu Sans only. The
    extension measures titles in that same font, and a node added from the node list is exactly as
    wide as its title in it needs (not the ~8 % more the fallback's metrics would give)."""
    st = _ok(editor_session, "title_font")
    version = _ok(editor_session, "load")["frontendVersion"]
    assert st["drawn"] and len(st["fonts"]) == 1, f"titles drawn in {st['fonts']}: {st['drawn']}"
    font, family = st["font"], st["family"]
    assert font == f"{st['nodeTextSize']}px {st['nodeFont']}", (font, st["nodeFont"], st["nodeTextSize"])
    known = KNOWN_TITLE_FAMILIES.get(tuple(int(p) for p in version.split(".")[:2]))
    if known:
        assert family == known, f"frontend {version}: titles in {family!r}, expected {known!r}"
    w = st["widths"]
    # the harness's fontconfig: "Arial" (and every sans family) is DejaVu Sans itself
    assert abs(w["arial"] - w["dejavu"]) < 0.01, w
    assert abs(w["dejavu"] - FONT_PROBE_DEJAVU_PX) < 1.5, w
    if st["faces"]:
        # a web font of the frontend's: loaded, and drawn as itself (not the DejaVu fallback's metrics)
        assert any(f["status"] == "loaded" for f in st["faces"]), st["faces"]
        assert st["check"] is True, st
        assert abs(w["drawn"] - w["dejavu"]) > 5, f"{family} measures as the fallback: {w}"
    else:
        # a system family: the harness's DejaVu Sans, no other face
        assert abs(w["drawn"] - w["dejavu"]) < 0.01, f"{family} is not drawn in DejaVu Sans: {w}"
    # the extension measures with the canvas' font, and sizes a new node for its whole title in it
    assert st["extensionFont"] == font, (st["extensionFont"], font)
    node = st["node"]
    need = math.ceil(node["titleWidth"] + 2 * node["titleHeight"] + 10)
    assert abs(node["size"][0] - need) <= 1, f"{node['type']} {node['size'][0]} wide, its title needs {need}: {node}"
    assert node["titleWidth"] <= node["size"][0] - 2 * node["titleHeight"], node


def test_dropped_workflow_keeps_its_saved_sizes_and_whole_titles(editor_session, editor_assets):
    """No node is grown past its saved size when it loads (the saved size holds its content in the
    font the frontend draws: DejaVu Sans for 1.27's Arial here, Inter in 1.49+), and every title is
    drawn whole (the canvas cuts a title wider than its room)."""
    st = _ok(editor_session, "drop_json")
    saved = {int(n["id"]): n for n in editor_assets["workflow"]["nodes"]}
    for n in st["graph"]["nodes"]:
        want = saved[int(n["id"])]["size"]
        assert abs(n["size"][0] - want[0]) <= 0.5 and abs(n["size"][1] - want[1]) <= 0.5, \
            f"node {n['id']} ({n['title']}): saved {want}, drawn {n['size']}"
        assert n["titleWidth"] <= n["titleRoom"], f"node {n['id']}: title {n['title']!r} " \
                                                  f"{n['titleWidth']:.0f} wide in {n['titleRoom']:.0f}"


def test_drop_ui_workflow_file_loads_our_nodes_with_their_values(editor_session, editor_assets):
    st = _ok(editor_session, "drop_json")
    assert [e["type"] for e in st["dispatch"]["events"]] == ["dragenter", "dragover", "drop"]
    assert st["dispatch"]["events"][-1]["defaultPrevented"], "the editor did not handle the drop"
    assert st["problems"] == []
    nodes = {int(n["id"]): n for n in st["graph"]["nodes"]}  # frontend 1.49 has string ids
    for t in OUR_TYPES:
        assert any(n["type"] == t for n in nodes.values()), f"{t} not in the dropped graph"
    widgets = {w["name"]: w["value"] for w in nodes[SAMPLER_ID]["widgets"]}
    file_nodes = {n["id"]: n for n in editor_assets["workflow"]["nodes"]}
    seed, control, steps, cfg, sampler_name, scheduler, denoise = file_nodes[SAMPLER_ID]["widgets_values"]
    assert (widgets["seed"], widgets["steps"], widgets["cfg"], widgets["sampler_name"], widgets["scheduler"],
            widgets["denoise"]) == (seed, steps, cfg, sampler_name, scheduler, denoise), widgets
    adapter = {w["name"]: w["value"] for w in nodes[ADAPTER_ID]["widgets"]}
    assert adapter["lora_name"] == editor_assets["adapter_name"] and adapter["strength"] == 1.0, adapter
    assert {w["name"]: w["value"] for w in nodes[MODE_ID]["widgets"]}["mode"] == file_nodes[MODE_ID]["widgets_values"][0]
    assert {w["name"]: w["value"] for w in nodes[TIER_ID]["widgets"]}["tier"] == file_nodes[TIER_ID]["widgets_values"][0]
    assert len(st["graph"]["nodes"]) == len(file_nodes) and st["graph"]["links"] == len(
        editor_assets["workflow"]["links"])


def test_drop_png_saved_by_the_pack_loads_its_workflow(editor_session, editor_assets):
    st = _ok(editor_session, "drop_png")
    assert st["dispatch"]["events"][-1]["defaultPrevented"]
    assert st["problems"] == []
    types = sorted(n["type"] for n in st["graph"]["nodes"])
    assert types == sorted(n["type"] for n in editor_assets["png_workflow"]["nodes"])
    for t in OUR_TYPES:
        assert t in types


def test_run_button_shows_the_report_on_our_nodes(editor_session, editor_assets, comfy):
    st = _ok(editor_session, "run")
    assert st["queuedVia"].startswith("click "), f"queued via {st['queuedVia']} (Run button not clickable)"
    assert st["outcome"] == "execution_success"
    assert not st.get("loadedViaFallback")
    assert str(SAMPLER_ID) in st["executedNodes"] and str(ADAPTER_ID) in st["executedNodes"], st["executedNodes"]
    outputs = _history_outputs(comfy, st["promptId"])
    report = outputs[str(SAMPLER_ID)]["lora_report"][0]
    coverage = outputs[str(ADAPTER_ID)]["lora_coverage"]

    before = st["before"]
    assert not before["hasWidget"] and "lora_runtime_report" not in before["properties"]

    sampler = st["sampler"]
    assert sampler["hasWidget"] and sampler["widgetType"] == "lora_runtime_report"
    assert sampler["connected"] and sampler["visible"], sampler
    assert sampler["insideNodeBox"], f"report drawn outside its node: {sampler['elementRect']} vs " \
                                     f"{sampler['canvasNodeBox']}"
    assert json.loads(sampler["properties"]["lora_runtime_report"]) == report
    assert sampler["properties"]["lora_runtime_summary"] == " | ".join(ln["text"] for ln in sampler["lines"])
    _check_report_text(sampler, report, editor_assets["adapter_name"])

    # the node keeps its width (lines wider than it end in an ellipsis); nothing folded here
    widths = {int(n["id"]): n["size"][0] for n in st["layoutBefore"]["nodes"]}
    _check_lines_clamped(sampler, widths[SAMPLER_ID])
    assert not sampler["collapsed"] and len(sampler["lines"]) > 1, sampler["lines"]

    adapter = st["adapter"]
    assert adapter["connected"] and adapter["visible"] and adapter["insideNodeBox"], adapter
    _check_lines_clamped(adapter, widths[ADAPTER_ID])
    assert json.loads(adapter["properties"]["lora_coverage"]) == coverage
    cov = coverage[0]
    assert adapter["lines"][0]["text"].startswith(f"{cov['matched']}/{cov['file_layers']} layers · "
                                                  f"{short_name(editor_assets['adapter_name'])}"), adapter["lines"]
    assert editor_assets["adapter_name"] in adapter["lines"][0]["title"]  # whole on hover
    shot = Path(editor_session["config"]["docsScreenshot"])
    assert st["docsClip"] and shot.is_file() and shot.stat().st_size < DOCS_MAX_BYTES, f"{shot}: {shot.stat().st_size} bytes"


def test_layout_after_run_no_overlap_no_widening_no_cut_labels(editor_session):
    run = _ok(editor_session, "run")
    st = _ok(editor_session, "layout")
    before, after = run["layoutBefore"], st["after"]
    assert not st["overlapsBefore"], "the workflow's nodes overlap before any run: " + json.dumps(st["overlapsBefore"])
    assert {str(n["id"]) for n in after["nodes"]} == {str(n["id"]) for n in before["nodes"]}
    _check_layout(before, after, st["overlaps"])
    # the nodes with a report grew downwards only
    for nid in (SAMPLER_ID, ADAPTER_ID):
        assert _layout_node(after, nid)["size"][1] >= _layout_node(before, nid)["size"][1]
    # every widget label of our nodes was drawn (whole or, for the core's own cut, cut)
    for nid in (ADAPTER_ID, MODE_ID, TIER_ID, SAMPLER_ID):
        node = _layout_node(after, nid)
        assert node["drewWidgets"] and node["labels"], node
        assert all(lb["state"] in ("whole", "cut") for lb in node["labels"]), node["labels"]


def test_report_folds_to_one_line_above_a_node_and_a_click_shows_every_line(editor_session):
    st = _ok(editor_session, "fold")
    full, folded, unfolded, refolded, back = st["full"], st["folded"], st["unfolded"], st["refolded"], st["back"]
    n = len(full["lines"])
    assert n > 1 and not full["collapsed"]
    # folded: one line, warnings first then the lines joined, hover text with every line
    assert folded["collapsed"] and folded["clickable"] and len(folded["lines"]) == 1, folded["lines"]
    badge = folded["lines"][0]
    assert badge["collapsed"] and badge["text"].startswith("\u25b8 "), badge
    assert all(ln["text"] in badge["title"] for ln in full["lines"]), badge["title"]
    assert folded["visible"] and folded["insideNodeBox"], folded
    assert folded["nodeSize"][0] == full["nodeSize"][0] and folded["nodeSize"][1] < full["nodeSize"][1]
    assert not st["foldedOverlaps"], "folded report still overlaps: " + json.dumps(st["foldedOverlaps"])
    # the user's click: every line (over the node below: their choice), another click folds again
    assert not unfolded["collapsed"] and [ln["text"] for ln in unfolded["lines"]] == [ln["text"] for ln in full["lines"]]
    assert refolded["collapsed"] and len(refolded["lines"]) == 1
    # the neighbour back in its place: every line again, nothing overlaps
    assert not back["collapsed"] and back["text"] == full["text"] and not back["clickable"]
    assert not st["backOverlaps"], st["backOverlaps"]
    # the stored report is the whole report all along
    assert folded["properties"]["lora_runtime_report"] == full["properties"]["lora_runtime_report"]


def test_show_badges_setting_hides_and_shows_the_report(editor_session):
    st = _ok(editor_session, "toggle")
    assert st["on0"]["visible"]
    assert st["offValue"] is False and st["onValue"] is True
    off, on = st["off"], st["on"]
    assert not off["visible"] and off["bodyDisplay"] == "none", off
    assert not st["offAdapter"]["visible"], st["offAdapter"]
    assert off["nodeSize"][1] < st["on0"]["nodeSize"][1], "the node did not shrink with the report hidden"
    assert on["visible"] and on["text"] == st["on0"]["text"], on
    assert st["onAdapter"]["visible"]
    assert on["nodeSize"][1] >= st["on0"]["nodeSize"][1] - 1
    # the report is kept while hidden
    assert off["properties"]["lora_runtime_report"] == st["on0"]["properties"]["lora_runtime_report"]


def test_report_comes_back_when_the_saved_workflow_is_loaded(editor_session):
    run = _ok(editor_session, "run")
    st = _ok(editor_session, "restore")
    assert st["savedProperties"]["lora_runtime_report"] == run["sampler"]["properties"]["lora_runtime_report"]
    assert st["sampler"]["visible"] and st["sampler"]["text"] == run["sampler"]["text"]
    assert st["adapter"]["visible"] and st["adapter"]["text"] == run["adapter"]["text"]
    # the DOM widget is not serialized: widgets_values and the prompt are the workflow's own
    assert st["problems"] == []
    assert "lora_runtime_report" not in st["promptInputs"], st["promptInputs"]
    assert {"seed", "steps", "cfg", "sampler_name", "scheduler", "denoise", "model"} <= set(st["promptInputs"])


def test_vue_nodes_run_updates_the_report(editor_session, comfy):
    st = _ok(editor_session, "vue")
    if not st["available"]:
        pytest.skip("this frontend has no Comfy.VueNodes.Enabled setting (no Vue node renderer)")
    assert st["enabledValue"] is True and st["vueNodeCount"] >= 10
    run = st["run"]
    assert run["outcome"] == "execution_success" and run["queuedVia"].startswith("click ")
    report = _history_outputs(comfy, run["promptId"])[str(SAMPLER_ID)]["lora_report"][0]
    props = st["afterRun"]["properties"]
    assert json.loads(props["lora_runtime_report"]) == report
    assert props["lora_runtime_report"] != st["afterSwitch"]["properties"]["lora_runtime_report"]


def test_vue_nodes_show_the_report_inside_the_node(editor_session, editor_assets, comfy):
    st = _ok(editor_session, "vue")
    if not st["available"]:
        pytest.skip("this frontend has no Comfy.VueNodes.Enabled setting (no Vue node renderer)")
    assert not st.get("waitErrors"), st["waitErrors"]
    for key in ("afterSwitch", "afterRun", "on"):
        _check_vue_report(st[key], key)
    _check_vue_report(st["adapterAfterSwitch"], "adapterAfterSwitch")
    _check_vue_report(st["adapterAfterRun"], "adapterAfterRun")
    # after the run in Vue mode it shows the new report (the summary is stored from it)
    report = _history_outputs(comfy, st["run"]["promptId"])[str(SAMPLER_ID)]["lora_report"][0]
    assert json.loads(st["afterRun"]["properties"]["lora_runtime_report"]) == report
    _check_report_text(st["afterRun"], report, editor_assets["adapter_name"])
    assert st["on"]["text"] == st["afterRun"]["text"]
    # hidden with the setting off; the report never makes the Vue node wider (same width off and on)
    assert not st["off"]["visible"], st["off"]
    assert st["off"]["vueNodeRect"]["w"] == st["on"]["vueNodeRect"]["w"], (st["off"]["vueNodeRect"], st["on"]["vueNodeRect"])
    for key in ("afterRun", "adapterAfterRun"):
        el, node = st[key]["elementRect"], st[key]["vueNodeRect"]
        assert el["x"] >= node["x"] and el["x"] + el["w"] <= node["x"] + node["w"], (key, el, node)
        assert all(ln["whiteSpace"] == "nowrap" and ln["textOverflow"] == "ellipsis" for ln in st[key]["lines"])
    # nothing was added to the node's widgets for it, nothing goes into the prompt / widgets_values
    assert st["afterRun"]["widgetCount"] == st["afterSwitch"]["widgetCount"]
    assert "lora_runtime_report" not in st["promptInputs"]["inputs"], st["promptInputs"]
    n_values = len(next(n for n in editor_assets["workflow"]["nodes"] if n["id"] == SAMPLER_ID)["widgets_values"])
    assert len(st["promptInputs"]["widgetsValues"]) == n_values, st["promptInputs"]


def test_classic_canvas_shows_the_report_again(editor_session):
    st = _ok(editor_session, "classic_again")
    assert st["vueValue"] is False
    assert st["sampler"]["shownBy"] == "dom-widget", st["sampler"]
    assert st["sampler"]["visible"] and st["sampler"]["insideNodeBox"], st["sampler"]
    assert st["adapter"]["visible"], st["adapter"]
    vue = _ok(editor_session, "vue")
    if vue["available"]:
        # the lines of the run made in Vue mode
        assert st["sampler"]["text"] == vue["afterRun"]["text"], (st["sampler"]["text"], vue["afterRun"]["text"])


def test_stock_ksampler_shows_the_report_and_the_report_node_matches_history(editor_session, editor_assets,
                                                                            comfy):
    st = _ok(editor_session, "stock")
    assert st["problems"] == []
    assert st["queuedVia"].startswith("click "), f"queued via {st['queuedVia']} (Run button not clickable)"
    assert st["outcome"] == "execution_success"
    assert str(STOCK_REPORT_ID) in st["executedNodes"], st["executedNodes"]
    # the server's event, for the KSampler of this prompt
    events = [e for e in st["reportEvents"] if e["prompt_id"] == st["promptId"]]
    assert [str(e["node"]) for e in events] == [str(STOCK_SAMPLER_ID)], st["reportEvents"]

    before = st["before"]
    assert before["type"] == "KSampler" and not before["hasWidget"], before
    assert "lora_runtime_report" not in before["properties"], before["properties"]
    sampler = st["sampler"]
    assert sampler["type"] == "KSampler"
    assert sampler["hasWidget"] and sampler["widgetType"] == "lora_runtime_report", sampler
    assert sampler["connected"] and sampler["visible"] and sampler["insideNodeBox"], sampler
    held = json.loads(sampler["properties"]["lora_runtime_report"])
    _check_report_text(sampler, held, editor_assets["adapter_name"])

    report_node = st["report"]
    assert report_node["type"] == "LoraRuntimeReport"
    assert report_node["visible"] and report_node["insideNodeBox"], report_node
    history = _history_outputs(comfy, st["promptId"])
    assert str(STOCK_SAMPLER_ID) not in history or "lora_report" not in history[str(STOCK_SAMPLER_ID)]
    from_history = history[str(STOCK_REPORT_ID)]["lora_report"][0]
    assert from_history == held, "the report node's /history output differs from the KSampler's properties"
    assert json.loads(report_node["properties"]["lora_runtime_report"]) == from_history
    assert [ln["text"] for ln in report_node["lines"]] == [ln["text"] for ln in sampler["lines"]]
    assert from_history["decision"]["chosen"] in ("merge", "dynamic")

    # the layout: no overlap, no widening, no label newly cut; the KSampler grew downwards only
    _check_layout(st["layoutBefore"], st["layout"], st["overlaps"])
    widths = {int(n["id"]): n["size"][0] for n in st["layoutBefore"]["nodes"]}
    _check_lines_clamped(sampler, widths[STOCK_SAMPLER_ID])
    _check_lines_clamped(report_node, widths[STOCK_REPORT_ID])
    # nothing of ours in the KSampler's prompt inputs / widgets_values
    assert st["promptInputs"]["classType"] == "KSampler"
    assert "lora_runtime_report" not in st["promptInputs"]["inputs"], st["promptInputs"]
    n_values = len(next(n for n in editor_assets["stock_workflow"]["nodes"]
                        if n["id"] == STOCK_SAMPLER_ID)["widgets_values"])
    assert len(st["promptInputs"]["widgetsValues"]) == n_values, st["promptInputs"]
    # saved and re-loaded: the KSampler shows it again (the extension's loadedGraphNode hook)
    assert st["savedProperties"]["lora_runtime_report"] == sampler["properties"]["lora_runtime_report"]
    assert st["restored"]["visible"] and st["restored"]["text"] == sampler["text"], st["restored"]


def test_browse_templates_opens_our_workflow_and_it_runs(editor_session, editor_assets):
    """After the drag-and-drop stages: ComfyUI's Browse Templates dialog (its own command) lists the
    pack's workflows from workflows/ (never the API prompts of workflows/api/); clicking
    embedded_style's card loads it with its saved widget values and closes the dialog, and with
    the embedded model in the server's folders the Run button runs it and the sampler shows its report."""
    st = _ok(editor_session, "template")
    assert sorted(st["listed"]) == sorted(p.stem for p in WORKFLOW.parent.glob("*.json")), st["listed"]
    assert not st["problems"] and not st["dialogOpen"], st
    if editor_assets["mode"] == "embedded":
        assert st["outcome"] == "execution_success" and st["sampler"]["visible"], st


def test_no_console_or_page_errors(editor_session):
    assert editor_session.get("finished"), f"the driver did not finish: {editor_session.get('error')}"
    errors = [c for c in editor_session["console"] if c["type"] == "error" and not _is_benign_console(c)]
    ours = [c for c in editor_session["console"]
            if c["type"] in ("error", "warning") and OUR_EXTENSION_URL in (c.get("url") or "")]
    page_errors = [e for e in editor_session["pageErrors"] if not _is_benign_page_error(e)]
    assert not ours, json.dumps(ours, indent=1)
    stacks = editor_session.get("consoleStacks")
    assert stacks is not None, "the driver recorded no console stacks (CDP)"
    ours_on_stack = [c for c in stacks if any(OUR_EXTENSION_URL in (f.get("url") or "") for f in c["frames"])]
    assert not ours_on_stack, json.dumps(ours_on_stack, indent=1)
    assert not errors, json.dumps(errors, indent=1)
    assert not page_errors, json.dumps(page_errors, indent=1)
    ext_failures = [r for r in editor_session["requestFailures"] if OUR_EXTENSION_URL in r["url"]]
    ext_bad = [r for r in editor_session["badResponses"] if OUR_EXTENSION_URL in r["url"]]
    assert not ext_failures and not ext_bad, (ext_failures, ext_bad)


def test_every_stage_left_a_screenshot(editor_session):
    shots = editor_session["screenshots"]
    missing = [s for s in shots if not s.get("path") or not Path(s["path"]).is_file()]
    assert not missing, missing
    names = [s["name"] for s in shots]
    for name in ("editor_loaded", "dropped_ui_workflow", "dropped_png", "report_after_run", "layout_after_run",
                 "report_folded_above_a_node", "report_unfolded_by_click", "badges_off", "badges_on_again",
                 "report_restored_from_properties", "classic_canvas_again", "stock_ksampler_report_after_run",
                 "stock_ksampler_report_restored", "docs"):
        assert name in names, f"no {name} screenshot: {names}"


# ---------------------------------------------------------------------------
# the LoRA Stack in the Vue node renderer (its own browser session: editor_vue_stack.cjs)
# ---------------------------------------------------------------------------
def stack_workflow(mode: str) -> dict:
    """workflows/embedded_style_stack.json; on the reference tiny Wan, with the generated adapter in
    every row (as editor_assets does for the single-adapter workflow)."""
    wf = json.loads(STACK_WORKFLOW.read_text(encoding="utf-8"))
    if mode == "reference":
        for n in wf["nodes"]:
            if n["type"] == "UNETLoader":
                n["widgets_values"][0] = REFERENCE_MODEL
            elif n["type"] == "LoraRuntimeStack":
                rows = json.loads(n["widgets_values"][0])
                for r in rows:
                    r["lora"] = FALLBACK_LORA
                n["widgets_values"][0] = json.dumps(rows)
    return wf


@pytest.fixture(scope="module")
def vue_stack_session(browser_tools, comfy, editor_assets, tmp_path_factory) -> dict:
    """One run of editor_vue_stack.cjs: the stack workflow in the Vue node renderer, edited through
    the Vue node's controls and run from the Run button."""
    work = tmp_path_factory.mktemp("browser-vue-stack")
    shots = SCREENSHOT_DIR / "vue_stack"
    if shots.exists():
        shutil.rmtree(shots)
    shots.mkdir(parents=True)
    wf = stack_workflow(editor_assets["mode"])
    wf_path = work / STACK_WORKFLOW.name
    wf_path.write_text(json.dumps(wf, indent=1), encoding="utf-8")
    cfg = _driver_base(browser_tools, comfy, work, shots) | {
        "workflow": {"path": str(wf_path), "name": wf_path.name, "expected": expected_nodes(wf)},
        "stackId": STACK_ID,
        "samplerId": STACK_SAMPLER_ID,
        "timeouts": {"action": 30_000, "load": 120_000, "run": int(PROMPT_TIMEOUT_S * 1000)},
        "hardStopSeconds": int(300 + PROMPT_TIMEOUT_S),
        "minFrontend": {"version": "1.49", "reason": VUE_STACK_OLD_FRONTEND},
    }
    results = _run_driver(browser_tools, comfy, VUE_STACK_DRIVER, cfg, work)
    results["workflow"] = wf
    (shots / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    return results


def _vue_stack_stage(session: dict, name: str) -> dict:
    if session.get("skipped"):
        pytest.skip(session["skipped"])
    if session.get("available") is False:
        pytest.skip(f"frontend {session['versions'].get('frontend')} has no Comfy.VueNodes.Enabled setting "
                    "(no Vue node renderer)")
    return _ok(session, name)


def _toggle_shown(value) -> bool | None:
    """What a Vue toggle shows: the pressed button's label (1.58: off / on) or a switch's state."""
    return {"on": True, "true": True, "off": False, "false": False}.get(str(value).strip().lower())


def _check_stack_shows(state: dict, rows: list[dict], key: str) -> None:
    """The rows JSON the node sends, its row widgets and its Vue element all say `rows` (on, file)."""
    sent = json.loads(state["rows"])
    assert [(r["on"], r["lora"]) for r in sent] == [(r["on"], r["lora"]) for r in rows], (key, sent)
    widgets = {w["name"]: w.get("value") for w in state["widgets"]}
    shown = {w["name"]: w["value"] for w in state["shown"]}
    for i, r in enumerate(rows, 1):
        assert widgets[f"LoRA {i}"] is r["on"] and widgets[f"{i} file"] == r["lora"], (key, i, widgets)
        assert _toggle_shown(shown.get(f"LoRA {i}")) is r["on"], f"{key}: row {i} shows {shown.get(f'LoRA {i}')!r}"
        assert shown.get(f"{i} file") == r["lora"], f"{key}: row {i} shows file {shown.get(f'{i} file')!r}"
    n = len(rows)
    assert f"LoRA {n + 1}" not in shown and f"{n + 1} file" not in shown, (key, sorted(shown))
    assert "+ Add LoRA" in shown and "rows" not in shown, (key, sorted(shown))


def test_vue_nodes_stack_rows_are_added_toggled_and_removed_through_the_node(vue_stack_session):
    st = _vue_stack_stage(vue_stack_session, "vue")
    wf = vue_stack_session["workflow"]
    assert st["enabledValue"] is True and st["vueNodeCount"] == len(wf["nodes"]), st
    events = st["dispatch"]["events"]
    assert [e["type"] for e in events] == ["dragenter", "dragover", "drop"] and events[-1]["defaultPrevented"]
    saved = json.loads(next(n for n in wf["nodes"] if n["id"] == STACK_ID)["widgets_values"][0])
    a, b = saved[0]["lora"], saved[1]["lora"]
    _check_stack_shows(st["stack"], saved, "loaded")

    rows = _vue_stack_stage(vue_stack_session, "rows")
    steps = [("added", [(True, a), (False, b), (True, b)]),  # the new row takes the last row's file
             ("toggledOff", [(False, a), (False, b), (True, b)]),
             ("toggledOn", [(True, a), (False, b), (True, b)]),
             # row 2 removed: the row after it moves up and shows its own values, not row 2's
             ("removed", [(True, a), (True, b)])]
    for key, want in steps:
        _check_stack_shows(rows[key], [{"on": on, "lora": lora} for on, lora in want], key)
    assert json.loads(rows["promptRows"]) == json.loads(rows["removed"]["rows"]), rows["promptRows"]
    # the node follows its rows: taller with three, shorter again with two
    assert rows["removed"]["size"][1] < rows["added"]["size"][1], (rows["added"]["size"], rows["removed"]["size"])
    assert rows["removed"]["vueRect"]["h"] < rows["added"]["vueRect"]["h"]


def test_vue_nodes_stack_run_shows_the_reports_in_the_nodes(vue_stack_session, comfy):
    run = _vue_stack_stage(vue_stack_session, "run")
    assert run["outcome"] == "execution_success" and run["queuedVia"].startswith("click "), run
    outputs = _history_outputs(comfy, run["promptId"])
    report = outputs[str(STACK_SAMPLER_ID)]["lora_report"][0]
    coverage = outputs[str(STACK_ID)]["lora_coverage"]
    rows = json.loads(run["stackAfter"]["rows"])
    assert [ad["name"] for ad in report["adapters"]] == [r["lora"] for r in rows if r["on"]], report["adapters"]
    assert len(coverage) == sum(r["on"] for r in rows)
    for key, prop, payload in (("sampler", "lora_runtime_report", report), ("stack", "lora_coverage", coverage)):
        shown = run[key]
        assert shown["visibleReports"] == 1 and shown["lines"], (key, shown)
        assert json.loads(shown["properties"][prop]) == payload, key
        assert " | ".join(ln["text"] for ln in shown["lines"]) == shown["properties"]["lora_runtime_summary"], key
    assert run["sampler"]["lines"][0]["text"].split()[0] in ("merged", "dynamic", "mixed"), run["sampler"]["lines"]


def test_vue_nodes_stack_session_has_no_console_or_page_errors(vue_stack_session):
    if vue_stack_session.get("available") is False or vue_stack_session.get("skipped"):
        pytest.skip(vue_stack_session.get("skipped") or "no Vue node renderer in this frontend: nothing ran")
    assert vue_stack_session.get("finished"), f"the Vue stack driver did not finish: {vue_stack_session.get('error')}"
    errors = [c for c in vue_stack_session["console"] if c["type"] == "error" and not _is_benign_console(c)]
    ours = [c for c in vue_stack_session["console"]
            if c["type"] in ("error", "warning") and OUR_EXTENSION_URL in (c.get("url") or "")]
    stacks = vue_stack_session.get("consoleStacks")
    assert stacks is not None, "the driver recorded no console stacks (CDP)"
    ours += [c for c in stacks if any(OUR_EXTENSION_URL in (f.get("url") or "") for f in c["frames"])]
    page_errors = [e for e in vue_stack_session["pageErrors"] if not _is_benign_page_error(e)]
    assert not ours, json.dumps(ours, indent=1)
    assert not errors, json.dumps(errors, indent=1)
    assert not page_errors, json.dumps(page_errors, indent=1)
