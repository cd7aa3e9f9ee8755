"""A ModelPatcher-shaped MODEL for the bundled host.

ComfyUI passes MODEL between nodes as a `ModelPatcher`: a light handle around a
shared `BaseModel`. Nodes that change the model clone the patcher and record
the change on the clone (object patches, `model_options`), so the base weights
are shared and an upstream MODEL that feeds two branches stays clean. This module
keeps that shape with only what the pack uses:

- `BundledModel`: the shared model (`diffusion_model`, `model_sampling`,
  `latent_format`), analogous to comfy's BaseModel.
- `BundledModelPatcher`: `.model`, `.model_options` (with
  "transformer_options"), `.clone()`, `add_object_patch`, `get_model_object`,
  `is_clone`, and ComfyUI's wrapper registry (`add_wrapper_with_key`,
  `get_wrappers`, `remove_wrappers_with_key`, copied on clone like ComfyUI's), its callback
  registry (`add_callback_with_key`, `get_callbacks`, `get_all_callbacks`) and `detach(unpatch_all)`,
  which runs the ON_DETACH callbacks (`model_management` loads and unloads as ComfyUI does).
- `run_wrapped(original, class_obj, wrappers, *args)`: ComfyUI's WrapperExecutor
  semantics (the first wrapper is the outermost; each calls ``executor(*args)``).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

SAMPLER_SAMPLE = "sampler_sample"  # comfy.patcher_extension.WrappersMP.SAMPLER_SAMPLE
OUTER_SAMPLE = "outer_sample"      # comfy.patcher_extension.WrappersMP.OUTER_SAMPLE (the whole sampling)
PREPARE_SAMPLING = "prepare_sampling"  # comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING (model load)
APPLY_MODEL = "apply_model"        # comfy.patcher_extension.WrappersMP.APPLY_MODEL (once per model call)
ON_DETACH = "on_detach_after"      # comfy.patcher_extension.CallbacksMP.ON_DETACH: fn(patcher, unpatch_all)
# comfy.patcher_extension.CallbacksMP.ON_DEEPCLONE_MULTIGPU: fn(patcher, clone); the bundled host has one device
# and never deep-clones, so these callbacks are kept (clones inherit them) but never run
ON_DEEPCLONE_MULTIGPU = "on_deepclone_multigpu"


class WrapperExecutor:
    """One link of a wrapper chain: calling it runs the next wrapper, or the original."""

    def __init__(self, original, class_obj, wrappers: list, idx: int = 0):
        self.original, self.class_obj, self.wrappers, self.idx = original, class_obj, wrappers, idx

    def __call__(self, *args, **kwargs):
        if self.idx >= len(self.wrappers):
            return self.original(*args, **kwargs)
        nxt = WrapperExecutor(self.original, self.class_obj, self.wrappers, self.idx + 1)
        return self.wrappers[self.idx](nxt, *args, **kwargs)


def run_wrapped(original, class_obj, wrappers: list, *args, **kwargs):
    return WrapperExecutor(original, class_obj, list(wrappers))(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class ModelSamplingFlow:
    """Discrete-flow (CONST) model sampling settings: sigma(t) shifted by `shift`,
    model timestep = sigma * multiplier. Wan 2.1 T2V defaults to shift 8.0."""
    shift: float = 8.0
    multiplier: float = 1000.0

    def percent_to_sigma(self, percent: float) -> float:
        """ComfyUI's start_percent convention for flow models: 0 -> 1.0, 1 -> 0.0, else the
        shifted sigma of timestep 1 - percent."""
        if percent <= 0.0:
            return 1.0
        if percent >= 1.0:
            return 0.0
        t = 1.0 - percent
        return self.shift * t / (1 + (self.shift - 1) * t) if self.shift != 1.0 else t

    def __post_init__(self):
        if not self.shift >= 0.0:
            raise ValueError(f"model sampling shift must be >= 0, got {self.shift!r}")
        if not self.multiplier > 0.0:
            raise ValueError(f"model sampling multiplier must be > 0, got {self.multiplier!r}")


class BundledModel:
    """The shared model behind every patcher clone (comfy's BaseModel role)."""

    def __init__(self, diffusion_model: torch.nn.Module,
                 model_sampling: ModelSamplingFlow | None = None,
                 latent_format: Any = None, model_type: str = "wan21"):
        if not isinstance(diffusion_model, torch.nn.Module):
            raise TypeError(f"diffusion_model must be a torch.nn.Module, got {type(diffusion_model).__name__}")
        self.diffusion_model = diffusion_model
        self.model_sampling = model_sampling if model_sampling is not None else ModelSamplingFlow()
        self.latent_format = latent_format
        self.model_type = model_type

    def __repr__(self) -> str:
        return (f"BundledModel({type(self.diffusion_model).__name__}, {self.model_type}, "
                f"{self.model_sampling})")

    def get_dtype(self) -> torch.dtype:
        for p in self.diffusion_model.parameters():
            return p.dtype
        return torch.float32


class BundledModelPatcher:
    """ModelPatcher-like handle. Clones share `.model`; everything a node records
    (`model_options`, object patches) is per clone."""

    def __init__(self, model: BundledModel, load_device: torch.device | str = "cpu",
                 offload_device: torch.device | str = "cpu"):
        self.model = model
        self.load_device = torch.device(load_device)
        self.offload_device = torch.device(offload_device)
        self.model_options: dict[str, Any] = {"transformer_options": {}}
        self.object_patches: dict[str, Any] = {}
        self.wrappers: dict[str, dict[str, list]] = {}
        self.callbacks: dict[str, dict[str, list]] = {}
        self.parent: BundledModelPatcher | None = None

    def __repr__(self) -> str:
        return (f"BundledModelPatcher({self.model!r}, object_patches={sorted(self.object_patches)}, "
                f"model_options keys={sorted(self.model_options)})")

    def clone(self) -> "BundledModelPatcher":
        n = BundledModelPatcher(self.model, self.load_device, self.offload_device)
        # Deep copy, as ComfyUI does: a node editing a nested dict or list of a
        # clone must not reach back into its parent.
        n.model_options = copy.deepcopy(self.model_options)
        n.object_patches = dict(self.object_patches)
        n.wrappers = {t: {k: list(v) for k, v in keyed.items()} for t, keyed in self.wrappers.items()}
        n.callbacks = {t: {k: list(v) for k, v in keyed.items()} for t, keyed in self.callbacks.items()}
        n.parent = self
        return n

    # ComfyUI's wrapper registry (comfy/model_patcher.py, patcher_extension.py)
    def add_wrapper_with_key(self, wrapper_type: str, key: str, wrapper) -> None:
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

    def get_wrappers(self, wrapper_type: str, key: str) -> list:
        return self.wrappers.get(wrapper_type, {}).get(key, [])

    def remove_wrappers_with_key(self, wrapper_type: str, key: str) -> None:
        self.wrappers.get(wrapper_type, {}).pop(key, None)

    def get_all_wrappers(self, wrapper_type: str) -> list:
        return [w for keyed in self.wrappers.get(wrapper_type, {}).values() for w in keyed]

    # ComfyUI's callback registry
    def add_callback_with_key(self, call_type: str, key: str, callback) -> None:
        self.callbacks.setdefault(call_type, {}).setdefault(key, []).append(callback)

    def get_callbacks(self, call_type: str, key: str) -> list:
        return self.callbacks.get(call_type, {}).get(key, [])

    def get_all_callbacks(self, call_type: str) -> list:
        return [c for keyed in self.callbacks.get(call_type, {}).values() for c in keyed]

    def detach(self, unpatch_all: bool = True) -> None:
        """ComfyUI's detach: the bundled host patches no weights itself, so only the callbacks run."""
        for callback in self.get_all_callbacks(ON_DETACH):
            callback(self, unpatch_all)

    def is_clone(self, other: Any) -> bool:
        return getattr(other, "model", None) is self.model

    def add_object_patch(self, name: str, obj: Any) -> None:
        self.object_patches[name] = obj

    def get_model_object(self, name: str) -> Any:
        """The object patch `name` if set, else the attribute (dotted path) of the model."""
        if name in self.object_patches:
            return self.object_patches[name]
        obj: Any = self.model
        for part in name.split("."):
            if not hasattr(obj, part):
                raise AttributeError(f"model has no object {name!r} (no attribute {part!r} on "
                                     f"{type(obj).__name__})")
            obj = getattr(obj, part)
        return obj

    def model_dtype(self) -> torch.dtype:
        return self.model.get_dtype()

    # ComfyUI patchers expose these; the bundled host keeps everything on one device.
    def model_size(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.diffusion_model.parameters())

    def set_model_options_key(self, key: str, value: Any) -> None:
        """Helper for nodes: set one top-level model_options entry on this (cloned) patcher."""
        self.model_options[key] = value
