"""The bundled host's loaded-model list, with ComfyUI's load and unload order.

ComfyUI keeps a model loaded between samplings. `load_models_gpu([patcher])` first detaches
(``detach(unpatch_all=False)``) every loaded patcher that shares the base model with it (the
patcher itself too, when it is loaded again), then puts it first in the list; `unload_all_models`
detaches every loaded patcher with ``unpatch_all=True`` and empties the list. The bundled host runs
everything on one device, so a load moves nothing; what matters is the callbacks' order.
Patchers are held weakly: a patcher nobody holds any more drops out of the list.
"""
from __future__ import annotations

import weakref

_LOADED: list = []   # weakref.ref(patcher), most recently loaded first


def loaded_models() -> list:
    """The loaded patchers, most recently loaded first."""
    out = []
    for ref in list(_LOADED):
        m = ref()
        if m is None:
            _LOADED.remove(ref)
        else:
            out.append(m)
    return out


def load_models_gpu(models) -> None:
    for model in models:
        for other in loaded_models():
            if model.is_clone(other):
                _LOADED[:] = [r for r in _LOADED if r() is not other]
                other.detach(unpatch_all=False)
        _LOADED.insert(0, weakref.ref(model))


def unload_all_models() -> None:
    """ComfyUI's unload_all_models (the "Unload models" button, ``/free``): every loaded patcher
    detached with ``unpatch_all=True``."""
    models = loaded_models()
    _LOADED.clear()
    for m in models:
        m.detach(unpatch_all=True)
