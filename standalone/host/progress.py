"""Progress reporting and interruption for the bundled host.

Mirrors the names the pack uses from ComfyUI: `comfy.utils.ProgressBar` and
`set_progress_bar_global_hook`, and from `comfy.model_management`:
`interrupt_current_processing`, `processing_interrupted`,
`throw_exception_if_processing_interrupted`, `InterruptProcessingException`.

The hook is called as hook(value, total, preview, node_id=...) like ComfyUI's;
the node id is the one the executor is running (see `executing_node`).
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from typing import Any, Callable, Iterator, Optional

log = logging.getLogger(__name__)

ProgressHook = Callable[..., None]

_hook: Optional[ProgressHook] = None
_current_node: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "comfyui_lora_runtime_executing_node", default=None)

_interrupt_lock = threading.Lock()
_interrupt_flag = False


class InterruptProcessingException(Exception):
    """Raised at a check point after `interrupt_current_processing()` was called."""


def set_progress_bar_global_hook(hook: Optional[ProgressHook]) -> Optional[ProgressHook]:
    """Install the hook every new ProgressBar reports to; returns the previous one."""
    global _hook
    previous, _hook = _hook, hook
    return previous


def get_progress_bar_global_hook() -> Optional[ProgressHook]:
    return _hook


@contextlib.contextmanager
def progress_hook(hook: Optional[ProgressHook]) -> Iterator[None]:
    previous = set_progress_bar_global_hook(hook)
    try:
        yield
    finally:
        set_progress_bar_global_hook(previous)


@contextlib.contextmanager
def executing_node(node_id: str | None) -> Iterator[None]:
    """Executor use: progress reported inside this block is attributed to node_id."""
    token = _current_node.set(node_id)
    try:
        yield
    finally:
        _current_node.reset(token)


def current_node_id() -> str | None:
    return _current_node.get()


class ProgressBar:
    def __init__(self, total: int, node_id: str | None = None):
        self.total = int(total)
        self.current = 0
        self.node_id = node_id if node_id is not None else _current_node.get()
        self.hook = _hook

    def update_absolute(self, value: int, total: int | None = None, preview: Any = None) -> None:
        if total is not None:
            self.total = int(total)
        self.current = max(0, min(int(value), self.total)) if self.total > 0 else int(value)
        if self.hook is not None:
            self.hook(self.current, self.total, preview, node_id=self.node_id)

    def update(self, value: int = 1) -> None:
        self.update_absolute(self.current + value)


def interrupt_current_processing(value: bool = True) -> None:
    global _interrupt_flag
    with _interrupt_lock:
        _interrupt_flag = bool(value)


def processing_interrupted() -> bool:
    with _interrupt_lock:
        return _interrupt_flag


def throw_exception_if_processing_interrupted() -> None:
    """Raise InterruptProcessingException if an interrupt is pending (and clear it)."""
    global _interrupt_flag
    with _interrupt_lock:
        if _interrupt_flag:
            _interrupt_flag = False
            raise InterruptProcessingException("processing interrupted")


# --- custom events (ComfyUI's PromptServer.send_sync role) --------------------------
EventListener = Callable[[str, dict], None]
_listeners: list[EventListener] = []


def add_event_listener(fn: EventListener) -> None:
    _listeners.append(fn)


def remove_event_listener(fn: EventListener) -> None:
    if fn in _listeners:
        _listeners.remove(fn)


@contextlib.contextmanager
def listening(fn: EventListener) -> Iterator[None]:
    add_event_listener(fn)
    try:
        yield
    finally:
        remove_event_listener(fn)


def emit_event(event: str, data: dict) -> None:
    """Hand a custom event (e.g. a LoRA runtime report) to every listener; a listener
    that raises is logged, never breaks the run."""
    for fn in list(_listeners):
        try:
            fn(event, data)
        except Exception:  # a listener must not break sampling
            log.exception("event listener %r failed on %s", fn, event)
