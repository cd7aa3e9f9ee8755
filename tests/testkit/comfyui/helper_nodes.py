"""Test-only nodes of comfyui-lora-runtime's integration tests (not part of the pack).

testkit/comfyui/server.py copies this file into the server's temp custom_nodes as
zz_lora_runtime_it_nodes/__init__.py, beside the reference cond_pos tensor; the test process
never imports it (test_workflows_real.py execs that copy for the bundled host).

ZZLoraRuntimeTestConditioning: CONDITIONING [[cond, {}]] with cond = the reference cond_pos
tensor [1, 4, 4096] stored beside this file ("positive"), or zeros of that shape ("zeros").

Probes of ComfyUI's model management: a LATENT pass-through with a tag (defeats the output
cache without touching the model), forced load_models_gpu + partially_unload / partially_load
between runs and in the middle of a run (a DIFFUSION_MODEL wrapper), the weights' hash /
state_dict keys after unload_all_models, and a FLOAT list as one value.
"""
import hashlib
import logging
import os
import threading

import torch
from safetensors.torch import load_file

try:  # ComfyUI's modules; absent when test_workflows_real.py execs this file for the bundled host
    import comfy.model_management
    import comfy.patcher_extension
except ImportError:
    comfy = None

_HERE = os.path.dirname(os.path.abspath(__file__))


class ZZLoraRuntimeTestConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"which": (["positive", "zeros"],)}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "_for_testing"

    def make(self, which):
        pos = load_file(os.path.join(_HERE, "cond_pos.safetensors"))["cond_pos"].to(torch.float32)
        cond = pos.clone() if which == "positive" else torch.zeros_like(pos)
        return ([[cond, {}]],)


NODE_CLASS_MAPPINGS = {"ZZLoraRuntimeTestConditioning": ZZLoraRuntimeTestConditioning}
NODE_DISPLAY_NAME_MAPPINGS = {"ZZLoraRuntimeTestConditioning": "ZZ Test Conditioning (lora-runtime IT)"}


# probes of ComfyUI's model management
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


class _AlwaysRunOutput:
    # An output node that runs in every prompt (never taken from ComfyUI's cache), through run().
    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")

    FUNCTION = "run"
    CATEGORY = "_for_testing"
    OUTPUT_NODE = True


class ZZLoraRuntimeTestPartialLoad(_AlwaysRunOutput):
    # load_models_gpu([model]), partially_unload(offload_device, fraction of the model size),
    # then (reload) partially_load(load_device, extra_memory=model size); the same MODEL back.
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "fraction": ("FLOAT", {"default": 0.5, "min": 0.0, "max": 1.0, "step": 0.01}),
                             "reload": ("BOOLEAN", {"default": True})}}

    RETURN_TYPES = ("MODEL",)

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


class ZZLoraRuntimeTestWeightState(_AlwaysRunOutput):
    # Optionally unload_all_models(), then the diffusion model's state: a hash of every
    # state_dict tensor (name, dtype, shape, bytes), the key list, modules still carrying an
    # instance forward / LoRA runtime attribute / cast or weight-function state, and the
    # mid-run events recorded since the last call.
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "unload_all": ("BOOLEAN", {"default": True})}}

    RETURN_TYPES = ()

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


class ZZLoraRuntimeTestBarrier(_AlwaysRunOutput):
    # Does nothing, never cached: a prompt the worker runs after /free, so that its flags (handled
    # after the worker's next wake-up, possibly after one more prompt) are handled before the next one.
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    RETURN_TYPES = ()

    def run(self):
        return {"ui": {"zz_barrier": [True]}}


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
    "ZZLoraRuntimeTestBarrier": ZZLoraRuntimeTestBarrier,
    "ZZLoraRuntimeTestFloatList": ZZLoraRuntimeTestFloatList,
    "ZZLoraRuntimeTestLatentTag": ZZLoraRuntimeTestLatentTag,
    "ZZLoraRuntimeTestPartialLoad": ZZLoraRuntimeTestPartialLoad,
    "ZZLoraRuntimeTestUnloadMidRun": ZZLoraRuntimeTestUnloadMidRun,
    "ZZLoraRuntimeTestWeightState": ZZLoraRuntimeTestWeightState,
})
