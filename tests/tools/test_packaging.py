"""What installing and publishing the pack relies on: the test extra holds every module the
tests import (0 skips outside the CUDA tests and the opt-in suite), installing never
reinstalls torch, the registry icon and the template folder are in the repo, and the
README's commands are the ones CI runs."""
import ast
import fnmatch
import json
import re
import tomllib
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TORCH_FAMILY = ("torch", "torchvision", "torchaudio")


def _dist(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req.strip(), maxsplit=1)[0].lower()


def _test_imports() -> set[str]:
    """Top-level modules the tests import, importorskip or hf_import (the opt-in integration suite aside)."""
    found = set()
    for f in (ROOT / "tests").rglob("*.py"):
        if "integration" in f.parts:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                    and (getattr(node.func, "attr", "") == "importorskip" or getattr(node.func, "id", "") == "hf_import"):
                found.add(str(node.args[0].value).split(".")[0])
    return found


def test_test_extra_has_every_third_party_module_the_tests_use():
    declared = {_dist(r) for r in PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["test"]}
    third_party = {"peft", "diffusers", "jsonschema", "scipy", "triton", "pytest", "safetensors", "numpy", "torch"}
    used = _test_imports() & (third_party | {"PIL"})
    assert {"scipy", "peft", "diffusers", "jsonschema"} <= used  # the scan sees the gated imports
    wanted = {"pillow" if m == "PIL" else m for m in used}
    assert wanted <= declared, sorted(wanted - declared)


def test_installing_the_pack_never_reinstalls_torch():
    reqs = [l.split("#")[0].strip() for l in (ROOT / "requirements.txt").read_text().splitlines()]
    assert not [r for r in reqs if r and _dist(r) in TORCH_FAMILY], "ComfyUI brings torch: not in requirements.txt"
    for r in PYPROJECT["project"]["dependencies"]:
        if _dist(r) in TORCH_FAMILY:  # a lower bound every ComfyUI install meets; no pin, no upper bound
            spec = r[len(_dist(r)):].replace(" ", "")
            assert re.fullmatch(r">=2\.[0-4](\.\d+)?", spec), r


def test_registry_icon_and_comfyui_versions():
    comfy = PYPROJECT["tool"]["comfy"]
    repo = PYPROJECT["project"]["urls"]["Repository"].removeprefix("https://github.com/")
    m = re.fullmatch(rf"https://raw\.githubusercontent\.com/{re.escape(repo)}/main/(.+)", comfy["Icon"])
    assert m, comfy["Icon"]
    icon = ROOT / m.group(1)
    with Image.open(icon) as im:
        assert im.format == "PNG" and im.size[0] == im.size[1] <= 400
    assert icon.stat().st_size < 100_000
    assert re.fullmatch(r">=\d+\.\d+\.\d+", comfy["requires-comfyui"])


def test_example_workflows_are_the_ui_workflows_with_a_thumbnail_each():
    api = sorted(p.name[:-len(".api.json")] for p in (ROOT / "workflows" / "api").glob("*.api.json"))
    ex = ROOT / "workflows"
    assert sorted(p.stem for p in ex.glob("*.json")) == api
    for name in api:
        saved = json.loads((ex / f"{name}.json").read_text())
        assert "nodes" in saved and "links" in saved  # the UI format the template browser opens
        with Image.open(ex / f"{name}.jpg") as im:  # ComfyUI shows NAME.jpg as the template's thumbnail
            assert im.format == "JPEG" and im.size == (256, 256)


# The folders ComfyUI 0.3.64 lists a pack's templates from (app/custom_node_manager.py: every
# <pack>/<folder>/*.json, in this order, each file a template named by its stem).
TEMPLATE_FOLDERS = ("example_workflows", "example", "examples", "workflow", "workflows")


def comfyui_template_listing(pack: Path) -> list[str]:
    """The names ComfyUI's /workflow_templates lists for a pack folder (its glob, as the server does)."""
    return [p.stem for folder in TEMPLATE_FOLDERS for p in sorted((pack / folder).glob("*.json"))]


def test_the_template_browser_lists_each_example_workflow_once():
    listed = comfyui_template_listing(ROOT)
    examples = sorted(p.stem for p in (ROOT / "workflows").glob("*.json"))
    assert sorted(listed) == examples, "a template folder other than workflows/ holds .json files " \
                                       "(API-format files belong in workflows/api/)"
    assert len(set(listed)) == len(listed)


def test_the_template_listing_sees_a_json_in_a_scanned_folder(tmp_path):
    """The scan above is the server's: a .json left in workflows/ would be listed (twice the name)."""
    (tmp_path / "example_workflows").mkdir()
    (tmp_path / "workflows").mkdir()
    (tmp_path / "example_workflows" / "a.json").write_text("{}")
    (tmp_path / "workflows" / "a.json").write_text("{}")
    (tmp_path / "workflows" / "a.api.json").write_text("{}")
    assert sorted(comfyui_template_listing(tmp_path)) == ["a", "a", "a.api"]


def test_the_api_prompts_in_workflows_api_are_not_templates(tmp_path):
    """ComfyUI lists <pack>/<folder>/*.json, not a subfolder's: the API files in workflows/api/
    stay out of the template browser while the editor workflows beside them are listed."""
    (tmp_path / "workflows" / "api").mkdir(parents=True)
    (tmp_path / "workflows" / "a.json").write_text("{}")
    (tmp_path / "workflows" / "api" / "a.api.json").write_text("{}")
    assert comfyui_template_listing(tmp_path) == ["a"]
    api = sorted((ROOT / "workflows" / "api").glob("*.api.json"))
    assert api and not [n for n in comfyui_template_listing(ROOT) if n.endswith(".api")], api


# What the ComfyUI registry archive leaves out (.comfyignore), and what it must keep: ComfyUI
# imports __init__.py -> nodes/ -> lora_runtime/, kernels/; serves web/ and workflows/; the demo
# nodes and the embedded_* workflows use standalone/ (docs/layout.md).
REGISTRY_KEEPS = ("__init__.py", "nodes/", "lora_runtime/", "kernels/", "web/", "workflows/", "standalone/",
                  "standalone/models/", "requirements.txt", "pyproject.toml", "README.md", "LICENSE")
REGISTRY_DROPS = ("tests/", "bench/", "tools/", ".ci/")


def test_the_registry_archive_keeps_what_comfyui_loads_and_drops_the_rest():
    patterns = [l.strip() for l in (ROOT / ".comfyignore").read_text().splitlines()
                if l.strip() and not l.lstrip().startswith("#")]
    # plain top-level folders only, so this prefix match is exactly the registry's gitwildmatch
    assert all(re.fullmatch(r"\.?[a-z_]+/", p) for p in patterns), patterns
    ignored = lambda path: any(path.startswith(p) for p in patterns)  # noqa: E731
    assert not [k for k in REGISTRY_KEEPS if ignored(k)], patterns
    assert all(ignored(d) for d in REGISTRY_DROPS), patterns
    for keep in REGISTRY_KEEPS:
        assert (ROOT / keep).exists(), keep


def test_the_wheel_lists_every_package_and_carries_the_data_the_pack_reads():
    setup = PYPROJECT["tool"]["setuptools"]
    listed = set(setup["packages"])
    found = {"comfyui_lora_runtime"} | {
        "comfyui_lora_runtime." + ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("nodes", "lora_runtime", "kernels", "standalone") for init in (ROOT / top).rglob("__init__.py")}
    assert listed == found, (sorted(found - listed), sorted(listed - found))
    data = setup["package-data"]["comfyui_lora_runtime"]
    for needed in ("web/**/*", "workflows/**/*", "standalone/models/**/*", "kernels/tuned/*.json"):
        assert needed in data, needed
        assert list(ROOT.glob(needed)), f"{needed} matches no file"
    from comfyui_lora_runtime.standalone import embedded
    assert all(p.is_relative_to(ROOT / "standalone" / "models") and p.is_file() for p in embedded.COMMITTED)


# The top level: what ComfyUI needs, one home for what runs without it, docs/bench/tools (docs/layout.md).
ROOT_DIRS = {"nodes", "kernels", "lora_runtime", "web", "workflows", "tests", "standalone", "docs", "bench", "tools"}
ROOT_FILES = {"__init__.py", "__main__.py", "README.md", "LICENSE", "pyproject.toml", "requirements.txt"}


def test_the_root_holds_only_the_documented_entries():
    ignored = [l.strip().rstrip("/") for l in (ROOT / ".gitignore").read_text().splitlines() if l.strip()]
    entries = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")
               and not any(fnmatch.fnmatch(p.name, pat) for pat in ignored)}
    assert entries <= ROOT_DIRS | ROOT_FILES, sorted(entries - ROOT_DIRS - ROOT_FILES)
    assert ROOT_DIRS <= entries and len(ROOT_DIRS) <= 10
    layout = (ROOT / "docs" / "layout.md").read_text()
    assert all(f"`{d}/`" in layout for d in ROOT_DIRS), "docs/layout.md names every top-level folder"


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = ci[ci.index("# --- the README's test command ---") + 1].replace("python3 ", "python ")
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):]
    quick = quick[:quick.index("\n## ", 4)]
    assert command in quick, command
    # the main job's install needs no test extra (no Triton, no diffusers to run the demo)
    install_line = next(l for l in quick.splitlines() if "comfyui_lora_runtime demo" in l)
    assert "[test]" not in install_line and "pip install" in install_line
