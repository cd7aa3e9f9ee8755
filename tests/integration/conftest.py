"""Opt-in integration suite: the pack inside a real ComfyUI server.

Runs only when ``COMFYUI_DIR`` points at a ComfyUI checkout (a folder with ``main.py`` and
``comfy/``); otherwise every test in this folder is skipped at collection. The server, its
client and its environment variables: tests/testkit/comfyui/server.py. Here: fixtures only.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from testkit.comfyui import prompts
from testkit.comfyui.server import (REPO, ComfyServer, comfyui_dir, comfyui_python, free_port, prepare_base,
                                    reference_dir, skip_reason)

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if comfyui_dir() is not None:
        return
    marker = pytest.mark.skip(reason=skip_reason())
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(marker)


@pytest.fixture(scope="session")
def reference() -> Path:
    d = reference_dir()
    if not (d / "tiny_wan_d128_l2.safetensors").is_file():
        pytest.skip(f"ComfyUI reference vectors not found at {d} (set LORA_RUNTIME_REFERENCE_DIR)")
    return d


@pytest.fixture(scope="session")
def comfy(tmp_path_factory, reference) -> ComfyServer:
    """A ComfyUI server with this pack (and the test-only helper nodes) loaded from a
    temp base directory; torn down at the end of the session."""
    comfy_dir = comfyui_dir()
    if comfy_dir is None:
        pytest.skip(skip_reason())
    base = prepare_base(tmp_path_factory.mktemp("comfyui-base"), reference)
    server = ComfyServer(comfy_dir, comfyui_python(comfy_dir), base, free_port())
    try:
        server.start()
    except Exception:
        server.stop()
        raise
    yield server
    server.stop()


@pytest.fixture(scope="session")
def comfy_checkout() -> tuple[Path, str]:
    """(the ComfyUI checkout, the python that runs it), for tests that run ComfyUI's code
    in a subprocess of their own instead of the server."""
    comfy_dir = comfyui_dir()
    if comfy_dir is None:
        pytest.skip(skip_reason())
    return comfy_dir, comfyui_python(comfy_dir)


@pytest.fixture(scope="session")
def pack():
    """The pack imported in the test process (bundled host): needs it installed here."""
    try:
        import comfyui_lora_runtime
    except ImportError as e:
        pytest.skip(f"this check imports the pack in the test process ({e}); run pytest with a python "
                    f"where it is installed (pip install -e {REPO})")
    return comfyui_lora_runtime


@pytest.fixture(scope="session")
def object_info(comfy) -> dict:
    status, info = comfy.get_json("/object_info")
    assert status == 200
    return info


# The sampler tests' shared state (test_any_sampler_real, test_compile_real); a module that
# writes other files defines its own `assets` (and `cond_class`), which wins.
@pytest.fixture(scope="module")
def cond_class(comfy) -> str:
    return comfy.helper_cond_class


@pytest.fixture(scope="module")
def assets(comfy, reference):
    return prompts.install_any_sampler_assets(comfy, reference)


@pytest.fixture(scope="module")
def fresh(assets) -> dict:
    """The weights of a freshly loaded model (every cache dropped first)."""
    return prompts.fresh_load_state(assets)


@pytest.fixture(scope="module")
def no_adapter(assets, cond_class, fresh):
    """KSampler on the bare model (the wrong answer for every adapter run)."""
    return prompts.no_adapter_latent(assets, cond_class)
