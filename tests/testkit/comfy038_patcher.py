"""A stand-in for the ModelPatcher of ComfyUI 0.38.1, on the bundled host (0.38.1 cannot run here).

What it simulates (read from ComfyUI 0.38.1's ``comfy/model_patcher.py``; docs/comfyui_versions.md):

- ``__init__(model, load_device, offload_device, size=0, weight_inplace_update=False, fast_disk=False)``
  and ``clone(disable_dynamic=False, model_override=None, force_deepcopy=False)``, which builds the
  clone through the constructor with ``fast_disk=self.fast_disk``;
- ``add_patches``: a ``("config", (cfg,))`` patch on ``<module>.config`` of a module that has
  ``with_config`` becomes an object patch of that module (``module.with_config(cfg)``), never a weight
  patch; any other patch on a weight of the model goes to ``patches[key]`` as
  ``(strength_patch, patch, strength_model, offset, function)``, whatever its type;
- when sampling loads the model (PREPARE_SAMPLING, outside the pack's own wrapper) the weight patches
  are written into the weights and the object patches set into the module tree; ``detach(unpatch_all=True)``
  puts both back (the weights bit for bit from a backup), then runs the ON_DETACH callbacks.

Weight patch types computed here: ``diff`` and ``fooocus`` (the ``(w_uint8, w_min, w_max)`` patch of
ComfyUI's older ``calculate_weight``: ``w / 255 * (w_max - w_min) + w_min``, added times the
strength). What is not simulated: offloading, lowvram cast-time patches, dynamic VRAM, hooks.
"""
from __future__ import annotations

import torch

from comfyui_lora_runtime.standalone.host.model_patcher import PREPARE_SAMPLING, BundledModelPatcher

KEY = "zz_host038"


def decode_fooocus(v) -> torch.Tensor:
    w, w_min, w_max = (t.to(torch.float32) for t in v)
    return (w / 255.0) * (w_max - w_min) + w_min


def patched_weight(weight: torch.Tensor, plist) -> torch.Tensor:
    """The weight after this stand-in host's patches (fp32 math, one rounding to the weight's dtype)."""
    w = weight.to(torch.float32, copy=True)
    for strength, patch, strength_model, _offset, _fn in plist:
        kind, v = patch
        if strength_model != 1.0:
            w *= strength_model
        if kind == "diff":
            w += strength * v[0].to(torch.float32)
        elif kind == "fooocus":
            w += strength * decode_fooocus(v)
        else:
            raise ValueError(f"stand-in host: patch type {kind!r} not simulated")
    return w.to(weight.dtype)


def _set(root, name: str, value) -> None:
    parent, _, attr = name.rpartition(".")
    obj = root
    for part in parent.split(".") if parent else ():
        obj = getattr(obj, part)
    setattr(obj, attr, value)


def _get(root, name: str):
    obj = root
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _unpatch(model) -> None:
    state = getattr(model, "_host038_state", None)
    if state is None:
        return
    _owner, weights, objects = state
    with torch.no_grad():
        for key, w in weights.items():
            _get(model, key).data.copy_(w)
    for name, obj in objects.items():
        _set(model, name, obj)
    model._host038_state = None


def _patch(patcher) -> None:
    model = patcher.model
    state = getattr(model, "_host038_state", None)
    if state is not None and state[0] is patcher:
        return
    _unpatch(model)
    objects = {}
    for name, obj in patcher.object_patches.items():
        objects[name] = _get(model, name)
        _set(model, name, obj)
    weights = {}
    with torch.no_grad():
        for key, plist in patcher.patches.items():
            p = _get(model, key)
            weights[key] = p.detach().clone()
            p.data.copy_(patched_weight(p.data, plist))
    model._host038_state = (patcher, weights, objects)


def _prepare_wrapper(executor, *args, **kwargs):
    patcher = args[0] if args else kwargs["model"]
    _patch(patcher)
    return executor(*args, **kwargs)


class Patcher038(BundledModelPatcher):
    def __init__(self, model, load_device="cpu", offload_device="cpu", size=0, weight_inplace_update=False,
                 fast_disk=False):
        super().__init__(model, load_device, offload_device)
        self.size = size
        self.weight_inplace_update = weight_inplace_update
        self.fast_disk = fast_disk
        self.patches: dict[str, list] = {}
        self.add_wrapper_with_key(PREPARE_SAMPLING, KEY, _prepare_wrapper)

    def clone(self, disable_dynamic=False, model_override=None, force_deepcopy=False):
        model = self.model if model_override is None else model_override[0]
        n = type(self)(model, self.load_device, self.offload_device, self.size,
                       weight_inplace_update=self.weight_inplace_update, fast_disk=self.fast_disk)
        shared = BundledModelPatcher.clone(self)
        n.model_options, n.object_patches = shared.model_options, shared.object_patches
        n.wrappers, n.callbacks, n.parent = shared.wrappers, shared.callbacks, self
        n.patches = {k: list(v) for k, v in self.patches.items()}
        return n

    def add_patches(self, patches: dict, strength_patch=1.0, strength_model=1.0) -> list:
        taken = []
        sd = self.model.diffusion_model.state_dict()
        for key, patch in patches.items():
            if isinstance(patch, tuple) and len(patch) == 2 and patch[0] == "config":
                module_name, _, attribute = key.rpartition(".")
                module = self.get_model_object(module_name)
                if attribute == "config" and hasattr(module, "with_config"):
                    taken.append(key)
                    if strength_patch != 0:
                        self.add_object_patch(module_name, module.with_config(patch[1][0]))
                continue
            if key.startswith("diffusion_model.") and key[len("diffusion_model."):] in sd:
                taken.append(key)
                self.patches.setdefault(key, []).append((strength_patch, patch, strength_model, None, None))
        return taken

    def detach(self, unpatch_all: bool = True) -> None:
        if unpatch_all and getattr(self.model, "_host038_state", None) is not None:
            _unpatch(self.model)
        super().detach(unpatch_all)
