"""Opt-in integration suite: the pack inside a real ComfyUI server.

Runs only when ``COMFYUI_DIR`` points at a ComfyUI checkout (a folder with
``main.py`` and ``comfy/``); otherwise every test in this folder is skipped at
collection. Nothing of ComfyUI is part of this repo: the suite starts the
user's checkout as a subprocess and talks to it over HTTP / websocket.

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

The server runs with ``--base-directory <tmp>`` (custom_nodes, models, input,
output, temp and user folders all in a temp dir; the checkout is not written
to), ``--database-url sqlite:///<tmp>/user/comfyui.db`` (the default database
lives inside the checkout), ``--cpu`` and ``--listen 127.0.0.1`` on a free port. The temp
``custom_nodes`` holds a symlink to this repo and a small test-only node pack
(``zz_lora_runtime_it_nodes``) with a conditioning loader (the reference
``cond_pos`` tensor, or zeros), so the workflows need no text encoder, and a few
probes of ComfyUI's model management (see ``HELPER_PROBE_SOURCE``): a LATENT
pass-through with a tag (defeats the output cache without touching the model),
forced ``load_models_gpu`` + ``partially_unload`` / ``partially_load`` between
runs and in the middle of a run (a DIFFUSION_MODEL wrapper), and the weights'
hash / state_dict keys after ``unload_all_models``.
"""
from __future__ import annotations

import base64
import hashlib
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

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PACK_LINK_NAME = "comfyui-lora-runtime"
HELPER_PACK_NAME = "zz_lora_runtime_it_nodes"
HELPER_COND_CLASS = "ZZLoraRuntimeTestConditioning"
HELPER_LATENT_TAG_CLASS = "ZZLoraRuntimeTestLatentTag"
HELPER_PARTIAL_CLASS = "ZZLoraRuntimeTestPartialLoad"
HELPER_MIDRUN_CLASS = "ZZLoraRuntimeTestUnloadMidRun"
HELPER_STATE_CLASS = "ZZLoraRuntimeTestWeightState"

ENV_DIR = "COMFYUI_DIR"
ENV_PYTHON = "COMFYUI_PYTHON"
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


def _skip_reason() -> str:
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


def reference_dir() -> Path:
    env = os.environ.get("LORA_RUNTIME_REFERENCE_DIR")
    return Path(env) if env else REPO.parent / "shared" / "reference"


def pytest_collection_modifyitems(config, items):
    if comfyui_dir() is not None:
        return
    marker = pytest.mark.skip(reason=_skip_reason())
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(marker)


# ---------------------------------------------------------------------------
# the test-only helper node pack (written into the temp custom_nodes at run time)
# ---------------------------------------------------------------------------
HELPER_NODE_SOURCE = f'''"""Test-only nodes written by comfyui-lora-runtime's integration tests (not part of the pack).

{HELPER_COND_CLASS}: CONDITIONING [[cond, {{}}]] with cond = the reference cond_pos
tensor [1, 4, 4096] stored beside this file ("positive"), or zeros of that shape ("zeros").
"""
import os

import torch
from safetensors.torch import load_file

_HERE = os.path.dirname(os.path.abspath(__file__))


class {HELPER_COND_CLASS}:
    @classmethod
    def INPUT_TYPES(cls):
        return {{"required": {{"which": (["positive", "zeros"],)}}}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "_for_testing"

    def make(self, which):
        pos = load_file(os.path.join(_HERE, "cond_pos.safetensors"))["cond_pos"].to(torch.float32)
        cond = pos.clone() if which == "positive" else torch.zeros_like(pos)
        return ([[cond, {{}}]],)


NODE_CLASS_MAPPINGS = {{"{HELPER_COND_CLASS}": {HELPER_COND_CLASS}}}
NODE_DISPLAY_NAME_MAPPINGS = {{"{HELPER_COND_CLASS}": "ZZ Test Conditioning (lora-runtime IT)"}}
'''


# Probes of ComfyUI's model management (test-only; plain string, appended to the pack).
HELPER_PROBE_SOURCE = r"""

import hashlib
import logging
import threading

try:  # ComfyUI's modules; absent when test_workflows_real.py execs this file for the bundled host
    import comfy.model_management
    import comfy.patcher_extension
except ImportError:
    comfy = None

_LOG = logging.getLogger("zz_lora_runtime_it")
_EVENTS = []  # what the mid-run wrappers did; drained by the weight-state node
_EVENTS_LOCK = threading.Lock()


def _record(event):
    with _EVENTS_LOCK:
        _EVENTS.append(event)
    _LOG.info("zz_lora_runtime_it: %s", event)


def _lowvram_state(patcher):
    m = patcher.model
    dm = m.diffusion_model
    return {
        "model_lowvram": bool(getattr(m, "model_lowvram", False)),
        "loaded_bytes": int(patcher.loaded_size()),
        "model_bytes": int(patcher.model_size()),
        "cast_modules": sum(1 for mod in dm.modules() if getattr(mod, "comfy_cast_weights", False)),
        "weight_function_modules": sum(1 for mod in dm.modules() if getattr(mod, "weight_function", None)),
    }


class ZZLoraRuntimeTestLatentTag:
    # The same LATENT dict back; the tag only changes the cache key of what follows.
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "tag": ("STRING", {"default": ""})}}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "tag"
    CATEGORY = "_for_testing"

    def tag(self, samples, tag):
        return (samples,)


class ZZLoraRuntimeTestPartialLoad:
    # load_models_gpu([model]), partially_unload(offload_device, fraction of the model size),
    # then (reload) partially_load(load_device, extra_memory=model size); the same MODEL back.
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "fraction": ("FLOAT", {"default": 0.5, "min": 0.0, "max": 1.0, "step": 0.01}),
                             "reload": ("BOOLEAN", {"default": True})}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "run"
    CATEGORY = "_for_testing"
    OUTPUT_NODE = True

    def run(self, model, fraction, reload):
        comfy.model_management.load_models_gpu([model])
        size = model.model_size()
        info = {"after_load": _lowvram_state(model)}
        info["freed"] = int(model.partially_unload(model.offload_device, memory_to_free=int(size * fraction)))
        info["after_unload"] = _lowvram_state(model)
        if reload:
            info["loaded"] = int(model.partially_load(model.load_device, extra_memory=size))
            info["after_reload"] = _lowvram_state(model)
        _record({"node": "partial_load", **info})
        return {"ui": {"zz_partial": [info]}, "result": (model,)}


def _sampled_patcher(diffusion_model):
    for lm in comfy.model_management.current_loaded_models:
        mp = lm.model
        if mp is not None and getattr(mp.model, "diffusion_model", None) is diffusion_model:
            return getattr(mp.model, "current_patcher", None) or mp
    return None


class ZZLoraRuntimeTestUnloadMidRun:
    # A clone with a DIFFUSION_MODEL wrapper: at model call `unload_at` (1-based) it calls
    # partially_unload(offload_device, fraction of the model size) on the patcher being sampled,
    # and at call `reload_at` (0: never) partially_load(load_device, extra_memory=model size).
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "unload_at": ("INT", {"default": 2, "min": 1, "max": 10000}),
                             "reload_at": ("INT", {"default": 0, "min": 0, "max": 10000}),
                             "fraction": ("FLOAT", {"default": 0.5, "min": 0.0, "max": 1.0, "step": 0.01})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "run"
    CATEGORY = "_for_testing"

    def run(self, model, unload_at, reload_at, fraction):
        calls = [0]

        def wrapper(executor, *args, **kwargs):
            calls[0] += 1
            n = calls[0]
            if n in (unload_at, reload_at):
                dm = executor.class_obj
                # while the sampler runs: the keys and the modules carrying a LoRA runtime adapter
                _record({"node": "mid_run", "call": n, "keys": sorted(dm.state_dict()),
                         "attached": sorted(name for name, mod in dm.named_modules() if "_lora_runtime" in mod.__dict__)})
                mp = _sampled_patcher(executor.class_obj)
                if mp is None:
                    _record({"node": "mid_run", "call": n, "error": "no loaded patcher for this diffusion model"})
                else:
                    size = mp.model_size()
                    if n == unload_at:
                        freed = mp.partially_unload(mp.offload_device, memory_to_free=int(size * fraction))
                        _record({"node": "mid_run", "call": n, "op": "partially_unload", "freed": int(freed),
                                 "state": _lowvram_state(mp)})
                    else:
                        loaded = mp.partially_load(mp.load_device, extra_memory=size)
                        _record({"node": "mid_run", "call": n, "op": "partially_load", "loaded": int(loaded),
                                 "state": _lowvram_state(mp)})
            return executor(*args, **kwargs)

        out = model.clone()
        out.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "zz_lora_runtime_it", wrapper)
        return (out,)


class ZZLoraRuntimeTestWeightState:
    # Optionally unload_all_models(), then the diffusion model's state: a hash of every
    # state_dict tensor (name, dtype, shape, bytes), the key list, modules still carrying an
    # instance forward / LoRA runtime attribute / cast or weight-function state, and the
    # mid-run events recorded since the last call.
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "unload_all": ("BOOLEAN", {"default": True})}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")

    RETURN_TYPES = ()
    FUNCTION = "run"
    CATEGORY = "_for_testing"
    OUTPUT_NODE = True

    def run(self, model, unload_all):
        if unload_all:
            comfy.model_management.unload_all_models()
        dm = model.model.diffusion_model
        sd = dm.state_dict()
        h = hashlib.sha256()
        for k in sorted(sd):
            t = sd[k].detach().to("cpu").contiguous()
            h.update(k.encode())
            h.update(str(t.dtype).encode())
            h.update(str(tuple(t.shape)).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        leftovers = []
        for name, mod in dm.named_modules():
            extra = [a for a in ("forward", "_lora_runtime") if a in mod.__dict__]
            if getattr(mod, "weight_function", None):
                extra.append("weight_function")
            if getattr(mod, "bias_function", None):
                extra.append("bias_function")
            if "prev_comfy_cast_weights" in mod.__dict__ or mod.__dict__.get("comfy_cast_weights"):
                extra.append("comfy_cast_weights")
            if extra:
                leftovers.append(name + ": " + ",".join(extra))
        with _EVENTS_LOCK:
            events = list(_EVENTS)
            _EVENTS.clear()
        state = {"hash": h.hexdigest(), "keys": sorted(sd), "leftovers": leftovers, "events": events,
                 "loaded_models": len(comfy.model_management.current_loaded_models),
                 "backup_keys": len(getattr(model, "backup", {}) or {})}
        return {"ui": {"zz_weight_state": [state]}}


class ZZLoraRuntimeTestFloatList:
    # A whole list of floats as one FLOAT value, as other packs' float-list nodes send it.
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"values": ("STRING", {"default": "1.0"})}}

    RETURN_TYPES = ("FLOAT",)
    FUNCTION = "run"
    CATEGORY = "_for_testing"

    def run(self, values):
        return ([float(v) for v in values.split(",")],)


NODE_CLASS_MAPPINGS.update({
    "ZZLoraRuntimeTestFloatList": ZZLoraRuntimeTestFloatList,
    "ZZLoraRuntimeTestLatentTag": ZZLoraRuntimeTestLatentTag,
    "ZZLoraRuntimeTestPartialLoad": ZZLoraRuntimeTestPartialLoad,
    "ZZLoraRuntimeTestUnloadMidRun": ZZLoraRuntimeTestUnloadMidRun,
    "ZZLoraRuntimeTestWeightState": ZZLoraRuntimeTestWeightState,
})
"""


# ---------------------------------------------------------------------------
# websocket: websocket-client when installed, else a minimal RFC 6455 client
# ---------------------------------------------------------------------------
class _BuiltinWebSocket:
    """Just enough of a websocket client for ComfyUI's /ws: unmasked server frames
    (text, binary, continuation, ping, close), masked client frames (pong, close)."""

    GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

    def __init__(self, host: str, port: int, path: str, timeout: float):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        req = (f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
        self.sock.sendall(req.encode())
        self._buf = b""
        deadline = time.monotonic() + timeout
        while b"\r\n\r\n" not in self._buf:
            if len(self._buf) > 65536 or not self._fill(deadline):
                raise ConnectionError("websocket handshake: no complete answer from the server")
        head, self._buf = self._buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        if " 101 " not in lines[0] + " ":
            raise ConnectionError(f"websocket handshake refused: {lines[0]!r}")
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        want = base64.b64encode(hashlib.sha1((key + self.GUID).encode()).digest()).decode()
        if headers.get("sec-websocket-accept") != want:
            raise ConnectionError("websocket handshake: bad Sec-WebSocket-Accept")
        self._fragments: list[bytes] = []
        self._frag_opcode = 0

    def _fill(self, deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self.sock.settimeout(remaining)
        try:
            chunk = self.sock.recv(65536)
        except (socket.timeout, TimeoutError):
            return False
        if not chunk:
            raise ConnectionError("websocket closed by the server")
        self._buf += chunk
        return True

    def _frame(self):
        """One complete frame from the buffer, or None (buffer untouched)."""
        b = self._buf
        if len(b) < 2:
            return None
        fin, opcode, masked, n = b[0] & 0x80, b[0] & 0x0F, b[1] & 0x80, b[1] & 0x7F
        pos = 2
        if n == 126:
            if len(b) < 4:
                return None
            n, pos = int.from_bytes(b[2:4], "big"), 4
        elif n == 127:
            if len(b) < 10:
                return None
            n, pos = int.from_bytes(b[2:10], "big"), 10
        mask = b""
        if masked:
            if len(b) < pos + 4:
                return None
            mask, pos = b[pos:pos + 4], pos + 4
        if len(b) < pos + n:
            return None
        payload = b[pos:pos + n]
        if masked:
            payload = bytes(c ^ mask[i % 4] for i, c in enumerate(payload))
        self._buf = b[pos + n:]
        return bool(fin), opcode, payload

    def _send(self, opcode: int, payload: bytes = b"") -> None:
        mask = os.urandom(4)
        n = len(payload)
        head = bytes([0x80 | opcode])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 65536:
            head += bytes([0x80 | 126]) + n.to_bytes(2, "big")
        else:
            head += bytes([0x80 | 127]) + n.to_bytes(8, "big")
        self.sock.sendall(head + mask + bytes(c ^ mask[i % 4] for i, c in enumerate(payload)))

    def recv(self, timeout: float):
        """The next message (str for text, bytes for binary), or None after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            frame = self._frame()
            if frame is None:
                if not self._fill(deadline):
                    return None
                continue
            fin, opcode, payload = frame
            if opcode == 0x9:  # ping
                self._send(0xA, payload)
            elif opcode == 0x8:
                raise ConnectionError("websocket closed by the server")
            elif opcode in (0x0, 0x1, 0x2):
                if opcode:
                    self._frag_opcode, self._fragments = opcode, []
                self._fragments.append(payload)
                if fin:
                    data = b"".join(self._fragments)
                    self._fragments = []
                    return data.decode("utf-8") if self._frag_opcode == 0x1 else data

    def close(self) -> None:
        try:
            self._send(0x8, (1000).to_bytes(2, "big"))
        except OSError:
            pass
        self.sock.close()


class _LibWebSocket:
    """websocket-client behind the same recv(timeout) / close() interface."""

    def __init__(self, host: str, port: int, path: str, timeout: float):
        import websocket  # websocket-client

        self._exc = websocket.WebSocketTimeoutException
        self.ws = websocket.create_connection(f"ws://{host}:{port}{path}", timeout=timeout,
                                              http_no_proxy=[host])  # never through a proxy

    def recv(self, timeout: float):
        self.ws.settimeout(max(timeout, 0.001))
        try:
            return self.ws.recv()
        except (self._exc, socket.timeout, TimeoutError):
            return None

    def close(self) -> None:
        self.ws.close()


def open_websocket(host: str, port: int, path: str, timeout: float = 30.0):
    if os.environ.get("LORA_RUNTIME_IT_WS", "").lower() != "builtin":
        try:
            import websocket  # noqa: F401
            if hasattr(websocket, "create_connection"):
                return _LibWebSocket(host, port, path, timeout)
        except ImportError:
            pass
    return _BuiltinWebSocket(host, port, path, timeout)


# ---------------------------------------------------------------------------
# the server and its client
# ---------------------------------------------------------------------------
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

    def __init__(self, comfy_dir: Path, python: str, base: Path, port: int):
        self.comfy_dir = comfy_dir
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

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        cmd = [self.python, "main.py", "--cpu", "--listen", HOST, "--port", str(self.port),
               "--base-directory", str(self.base), "--output-directory", str(self.output_dir),
               "--database-url", f"sqlite:///{self.base / 'user' / 'comfyui.db'}"]
        env = dict(os.environ)
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
        """Ask the worker to unload models and drop every cached node output."""
        status, _ = self.post_json("/free", {"unload_models": True, "free_memory": True})
        assert status == 200

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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


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
        pytest.skip(_skip_reason())
    base = tmp_path_factory.mktemp("comfyui-base")
    for sub in ("custom_nodes", "models/diffusion_models", "models/loras", "input", "output", "temp", "user"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes" / PACK_LINK_NAME).symlink_to(REPO, target_is_directory=True)
    helper = base / "custom_nodes" / HELPER_PACK_NAME
    helper.mkdir()
    (helper / "__init__.py").write_text(HELPER_NODE_SOURCE + HELPER_PROBE_SOURCE, encoding="utf-8")
    shutil.copyfile(reference / "cond_pos.safetensors", helper / "cond_pos.safetensors")

    server = ComfyServer(comfy_dir, comfyui_python(comfy_dir), base, _free_port())
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
        pytest.skip(_skip_reason())
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
