"""User-facing errors of the engine.

Every message names the file, key, layer or value at fault and says what to do;
the nodes turn these into ComfyUI validation errors unchanged.
"""


class LoraRuntimeError(Exception):
    """Base class: anything the user can fix by changing an input."""


class AdapterFileError(LoraRuntimeError):
    """The adapter file cannot be read (not safetensors, truncated, corrupt)."""


class AdapterFormatError(LoraRuntimeError):
    """The file reads, but its keys or tensors are not a usable adapter."""


class AdapterMatchError(LoraRuntimeError):
    """The adapter targets no layer of the model."""


class MergeRefusedError(LoraRuntimeError):
    """`merge` was asked for on a weight that cannot take a merge."""


class NonFiniteMergeError(LoraRuntimeError):
    """A merge would write NaN/Inf; nothing was written."""


class RestoreError(LoraRuntimeError):
    """A restore did not reproduce the original weight (an engine bug)."""


class ConfigError(LoraRuntimeError, ValueError):
    """Unknown tier or mode, strength out of range, and similar bad settings."""
