"""The integration suite's ComfyUI: a server subprocess on 127.0.0.1 and a small client for it.

Nothing of ComfyUI is part of this repo: the suite starts the user's checkout as a
subprocess and talks to it over HTTP / websocket.

Environment:

- ``COMFYUI_DIR``: the ComfyUI checkout (required to run).
- ``COMFYUI_PYTHON``: the python that runs ComfyUI; default
  ``$COMFYUI_DIR/../comfyui-venv/bin/python`` if it exists, else ``sys.executable``.
- ``COMFYUI_STARTUP_TIMEOUT`` (seconds, default 300), ``COMFYUI_PROMPT_TIMEOUT``
  (seconds per prompt, default 300).
- ``LORA_RUNTIME_REFERENCE_DIR``: the ComfyUI reference vectors (default
  ``<repo>/../shared/reference``).
- ``LORA_RUNTIME_IT_WS=builtin``: use the built-in websocket client even when
  ``websocket-client`` is installed.
- ``LORA_RUNTIME_FRONTEND_ROOT``: a frontend build to serve instead of the one the ComfyUI
  install pins (the folder with ``index.html``, e.g. the ``static`` folder of a
  ``comfyui_frontend_package`` wheel); the server is started with ``--front-end-root`` on it.

The server runs with ``--base-directory <tmp>`` (custom_nodes, models, input,
output, temp and user folders all in a temp dir; the checkout is not written
to), ``--database-url sqlite:///<tmp>/user/comfyui.db`` (the default database
lives inside the checkout), ``--cpu`` and ``--listen 127.0.0.1`` on a free port. The temp
``custom_nodes`` holds a symlink to this repo and a small test-only node pack
(``zz_lora_runtime_it_nodes``: a copy of ``helper_nodes.py`` beside this file) with a
conditioning loader (the reference ``cond_pos`` tensor, or zeros), so the workflows need
no text encoder, and a few probes of ComfyUI's model management.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

from testkit.comfyui.ws_client import open_websocket

REPO = Path(__file__).resolve().parents[3]
HELPER_NODES = Path(__file__).resolve().parent / "helper_nodes.py"
PACK_LINK_NAME = "comfyui-lora-runtime"
HELPER_PACK_NAME = "zz_lora_runtime_it_nodes"
HELPER_COND_CLASS = "ZZLoraRuntimeTestConditioning"  # the helper pack's classes (helper_nodes.py)
HELPER_LATENT_TAG_CLASS = "ZZLoraRuntimeTestLatentTag"
HELPER_PARTIAL_CLASS = "ZZLoraRuntimeTestPartialLoad"
HELPER_MIDRUN_CLASS = "ZZLoraRuntimeTestUnloadMidRun"
HELPER_STATE_CLASS = "ZZLoraRuntimeTestWeightState"

ENV_DIR = "COMFYUI_DIR"
ENV_PYTHON = "COMFYUI_PYTHON"
ENV_FRONTEND_ROOT = "LORA_RUNTIME_FRONTEND_ROOT"
HOST = "127.0.0.1"

STARTUP_TIMEOUT = float(os.environ.get("COMFYUI_STARTUP_TIMEOUT", "300"))
PROMPT_TIMEOUT = float(os.environ.get("COMFYUI_PROMPT_TIMEOUT", "300"))
HTTP_TIMEOUT = 60.0
MAX_WS_MESSAGES = 200_000  # per wait(); a bound, far above what a tiny prompt sends
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 only, never a proxy


def comfyui_dir() -> Path | None:
    """The ComfyUI checkout named by COMFYUI_DIR, or None (suite skipped)."""
    value = os.environ.get(ENV_DIR)
    if not value:
        return None
    d = Path(value).expanduser().resolve()
    if (d / "main.py").is_file() and (d / "comfy").is_dir():
        return d
    return None


def skip_reason() -> str:
    value = os.environ.get(ENV_DIR)
    if not value:
        return f"integration tests need a ComfyUI checkout: set {ENV_DIR} (and optionally {ENV_PYTHON})"
    return f"{ENV_DIR}={value!r} is not a ComfyUI checkout (no main.py and comfy/ there)"


def comfyui_python(comfy_dir: Path) -> str:
    value = os.environ.get(ENV_PYTHON)
    if value:
        return value
    venv = comfy_dir.parent / "comfyui-venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def frontend_root() -> Path | None:
    """The frontend build named by LORA_RUNTIME_FRONTEND_ROOT (None: the install's own).
    A value that is not a built frontend (no index.html) is an error, not a silent fallback."""
    value = os.environ.get(ENV_FRONTEND_ROOT)
    if not value:
        return None
    d = Path(value).expanduser().resolve()
    if not (d / "index.html").is_file():
        raise RuntimeError(f"{ENV_FRONTEND_ROOT}={value!r} has no index.html: name the folder of a built "
                           f"frontend (the static/ folder of a comfyui_frontend_package wheel)")
    return d


def reference_dir() -> Path:
    env = os.environ.get("LORA_RUNTIME_REFERENCE_DIR")
    return Path(env) if env else REPO.parent / "shared" / "reference"


class PromptFailed(AssertionError):
    """ComfyUI reported execution_error (or execution_interrupted) for a prompt."""

    def __init__(self, prompt_id: str, data: dict, kind: str = "execution_error"):
        self.prompt_id = prompt_id
        self.data = data
        self.kind = kind
        super().__init__(f"prompt {prompt_id}: {kind} at node {data.get('node_id')} ({data.get('node_type')}): "
                         f"{data.get('exception_type')}: {data.get('exception_message')}\n"
                         + "".join(data.get("traceback") or []))


class ComfyServer:
    """A ComfyUI subprocess on 127.0.0.1 and a small client for it.

    `queue(prompt) -> prompt_id`, `wait(prompt_id) -> run record` (follows /ws),
    `history(prompt_id)`, `fetch_view(...)` / `fetch_image(...)` (GET /view),
    `run(prompt)` (queue + wait + history).
    """

    def __init__(self, comfy_dir: Path, python: str, base: Path, port: int, env: dict | None = None):
        self.comfy_dir = comfy_dir
        self.extra_env = dict(env or {})  # set for the server process only (e.g. a shared cache folder)
        self.python = python
        self.base = base
        self.port = port
        self.url = f"http://{HOST}:{port}"
        self.client_id = uuid.uuid4().hex
        self.pack_link_name = PACK_LINK_NAME
        self.helper_pack_name = HELPER_PACK_NAME
        self.helper_cond_class = HELPER_COND_CLASS
        self.custom_nodes_dir = base / "custom_nodes"
        self.models_dir = base / "models"
        self.diffusion_models_dir = self.models_dir / "diffusion_models"
        self.loras_dir = self.models_dir / "loras"
        self.output_dir = base / "output"
        self.log_path = base / "comfyui.log"
        self.proc: subprocess.Popen | None = None
        self._log_file = None
        self._ws = None
        self._events: dict[str, list[dict]] = {}  # prompt_id -> ws messages, in order
        self.frontend_root = frontend_root()  # None: the frontend the install pins

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        cmd = [self.python, "main.py", "--cpu", "--listen", HOST, "--port", str(self.port),
               "--base-directory", str(self.base), "--output-directory", str(self.output_dir),
               "--database-url", f"sqlite:///{self.base / 'user' / 'comfyui.db'}"]
        if self.frontend_root is not None:
            cmd += ["--front-end-root", str(self.frontend_root)]
        env = dict(os.environ)
        env.update(self.extra_env)
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("TRITON_INTERPRET", None)  # set by tests/conftest.py for the test process only
        self._log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=str(self.comfy_dir), stdout=self._log_file,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for _ in range(int(STARTUP_TIMEOUT / 0.5) + 10):
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with code {self.proc.returncode} while starting:\n"
                                   f"{self.log_tail()}")
            try:
                status, _ = self.get_json("/system_stats", timeout=5)
                if status == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"ComfyUI did not answer /system_stats within {STARTUP_TIMEOUT:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.5)
        else:
            raise RuntimeError(f"ComfyUI did not answer /system_stats:\n{self.log_tail()}")
        self._ws = open_websocket(HOST, self.port, f"/ws?clientId={self.client_id}")

    def stop(self) -> None:
        if self._ws is not None:
            try:
                self._ws.close()
            except OSError:
                pass
            self._ws = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def log_text(self) -> str:
        if self._log_file is not None:
            self._log_file.flush()
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    # -- HTTP ------------------------------------------------------------------
    def _request(self, method: str, path: str, body: bytes | None = None, timeout: float = HTTP_TIMEOUT):
        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers={"Content-Type": "application/json"} if body is not None else {})
        try:
            with _NO_PROXY.open(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def get_json(self, path: str, timeout: float = HTTP_TIMEOUT):
        status, raw = self._request("GET", path, timeout=timeout)
        return status, (json.loads(raw) if raw else None)

    def post_json(self, path: str, data, timeout: float = HTTP_TIMEOUT):
        status, raw = self._request("POST", path, json.dumps(data).encode(), timeout=timeout)
        try:
            return status, (json.loads(raw) if raw else None)
        except json.JSONDecodeError:
            return status, raw.decode("utf-8", errors="replace")

    def post_prompt(self, prompt: dict):
        """POST /prompt as is: (HTTP status, answer JSON)."""
        return self.post_json("/prompt", {"prompt": prompt, "client_id": self.client_id})

    def queue(self, prompt: dict) -> str:
        status, answer = self.post_prompt(prompt)
        if status != 200:
            raise AssertionError(f"POST /prompt answered {status}: {json.dumps(answer, indent=1)}")
        if answer.get("node_errors"):
            raise AssertionError(f"POST /prompt accepted with node errors: {answer['node_errors']}")
        return answer["prompt_id"]

    def free(self) -> None:
        """Ask the worker to unload models and drop every cached node output, and return once it has.

        /free only sets flags; the worker handles them after its next wake-up, which may come with a
        prompt already queued (run first, on the old cache). A barrier prompt run to its end closes that
        gap: the worker handles the flags after it, before it takes the next prompt."""
        status, _ = self.post_json("/free", {"unload_models": True, "free_memory": True})
        assert status == 200
        self.run({"zz_barrier": {"class_type": "ZZLoraRuntimeTestBarrier", "inputs": {}}})

    def history(self, prompt_id: str, timeout: float = 30.0) -> dict:
        """The /history entry of a finished prompt. The worker files it just after
        execution_success, so this polls (bounded) until the entry is there."""
        deadline = time.monotonic() + timeout
        for _ in range(10_000):
            status, answer = self.get_json(f"/history/{prompt_id}")
            assert status == 200, f"GET /history/{prompt_id} answered {status}"
            entry = (answer or {}).get(prompt_id) or {}
            if entry.get("status") or time.monotonic() > deadline:
                return entry
            time.sleep(0.05)
        return {}

    def fetch_view(self, filename: str, subfolder: str = "", type: str = "output") -> bytes:
        q = urllib.parse.urlencode({"filename": filename, "subfolder": subfolder, "type": type})
        status, raw = self._request("GET", f"/view?{q}")
        assert status == 200, f"GET /view?{q} answered {status}"
        return raw

    fetch_image = fetch_view

    # -- websocket ---------------------------------------------------------------
    def _pump(self, timeout: float) -> bool:
        """File the next websocket message under its prompt id; False after `timeout` s
        with none. Raises ConnectionError/OSError when the socket breaks."""
        msg = self._ws.recv(timeout=timeout)
        if msg is None:
            return False
        if isinstance(msg, str):  # binary frames are previews: not needed here
            data = json.loads(msg)
            pid = (data.get("data") or {}).get("prompt_id")
            if pid is not None:
                self._events.setdefault(pid, []).append(data)
        return True

    def wait_for_event(self, prompt_id: str, predicate, timeout: float = PROMPT_TIMEOUT) -> dict:
        """Follow /ws until a message of `prompt_id` satisfies `predicate` (it stays filed
        for wait()); fails the test if the prompt ends first or after `timeout` s."""
        deadline = time.monotonic() + timeout
        for _ in range(MAX_WS_MESSAGES):
            for ev in self._events.get(prompt_id, []):
                if predicate(ev):
                    return ev
                if ev["type"] in ("execution_success", "execution_error", "execution_interrupted"):
                    pytest.fail(f"prompt {prompt_id} ended ({ev['type']}) before the awaited message")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._pump(min(remaining, 5.0))
        pytest.fail(f"no awaited message for prompt {prompt_id} within {timeout:.0f} s\n{self.log_tail()}")

    def interrupt(self, prompt_id: str | None = None) -> None:
        status, _ = self.post_json("/interrupt", {"prompt_id": prompt_id} if prompt_id else {})
        assert status == 200

    def wait(self, prompt_id: str, timeout: float = PROMPT_TIMEOUT) -> dict:
        """Follow /ws until `prompt_id` finishes. Returns its run record:
        {"events": [...], "cached": [node ids], "executing": [node ids], "executed": {node: ui output}}.
        execution_error / execution_interrupted raise PromptFailed; no end within
        `timeout` s fails the test. Falls back to polling /history if the websocket breaks."""
        deadline = time.monotonic() + timeout
        for _ in range(MAX_WS_MESSAGES):
            record = self._finished(prompt_id)
            if record is not None:
                return record
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                self._pump(min(remaining, 5.0))
            except (ConnectionError, OSError):
                return self._poll_history(prompt_id, deadline)
        else:
            pytest.fail(f"more than {MAX_WS_MESSAGES} websocket messages while waiting for {prompt_id}")
        pytest.fail(f"prompt {prompt_id} did not finish within {timeout:.0f} s\n{self.log_tail()}")

    def _finished(self, prompt_id: str) -> dict | None:
        events = self._events.get(prompt_id, [])
        for ev in events:
            if ev["type"] in ("execution_error", "execution_interrupted"):
                self._events.pop(prompt_id, None)
                raise PromptFailed(prompt_id, ev["data"], ev["type"])
            if ev["type"] == "execution_success":
                self._events.pop(prompt_id, None)
                record = {"events": events, "cached": [], "executing": [], "executed": {}}
                for e in events:
                    if e["type"] == "execution_cached":
                        record["cached"].extend(e["data"].get("nodes") or [])
                    elif e["type"] == "executing" and e["data"].get("node") is not None:
                        record["executing"].append(e["data"]["node"])
                    elif e["type"] == "executed":
                        record["executed"][e["data"]["node"]] = e["data"].get("output")
                return record
        return None

    def _poll_history(self, prompt_id: str, deadline: float) -> dict:
        for _ in range(100_000):
            entry = self.history(prompt_id, timeout=0)
            status = entry.get("status") or {}
            if status.get("completed"):
                return {"events": [], "cached": None, "executing": None, "executed": entry.get("outputs", {})}
            if status.get("status_str") == "error":
                msgs = [m for m in status.get("messages", [])
                        if m[0] in ("execution_error", "execution_interrupted")]
                kind, data = msgs[-1] if msgs else ("execution_error", {})
                raise PromptFailed(prompt_id, data, kind)
            if time.monotonic() > deadline:
                break
            time.sleep(0.25)
        pytest.fail(f"prompt {prompt_id} did not finish (polled /history)\n{self.log_tail()}")

    def run(self, prompt: dict, timeout: float = PROMPT_TIMEOUT) -> dict:
        """Queue `prompt`, wait for it; its run record plus "prompt_id" and "history"."""
        pid = self.queue(prompt)
        record = self.wait(pid, timeout)
        record["prompt_id"] = pid
        record["history"] = self.history(pid)
        return record


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def prepare_base(base: Path, reference: Path) -> Path:
    """The server's base directory: its folders, this repo linked into custom_nodes, and the
    test-only helper pack with the reference cond_pos beside it."""
    for sub in ("custom_nodes", "models/diffusion_models", "models/loras", "input", "output", "temp", "user"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes" / PACK_LINK_NAME).symlink_to(REPO, target_is_directory=True)
    helper = base / "custom_nodes" / HELPER_PACK_NAME
    helper.mkdir()
    shutil.copyfile(HELPER_NODES, helper / "__init__.py")
    shutil.copyfile(reference / "cond_pos.safetensors", helper / "cond_pos.safetensors")
    return base
