"""Shared by the node tests: reference conditioning, a capturing output node, the node
classes of a bundled-host graph, weight snapshots and one LoRA Sampler call."""
import torch
from safetensors.torch import load_file

from comfyui_lora_runtime import NODE_CLASS_MAPPINGS
from comfyui_lora_runtime.standalone.host.core_nodes import CORE_NODE_CLASS_MAPPINGS
from comfyui_lora_runtime.nodes.lora_nodes import LoraSampler
from testkit.refdata import REF


class CondPos:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"which": (["pos", "neg"],)}}
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "go"

    def go(self, which):
        c = load_file(str(REF / "cond_pos.safetensors"))["cond_pos"]
        return ([[c if which == "pos" else torch.zeros_like(c), {}]],)


class Capture:
    OUTPUT_NODE = True
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",)}}
    RETURN_TYPES = ()
    FUNCTION = "go"
    seen = []

    def go(self, samples):
        Capture.seen.append(samples["samples"].clone())
        return {"ui": {"n": [1]}}


CLASSES = {**CORE_NODE_CLASS_MAPPINGS, **NODE_CLASS_MAPPINGS, "CondPos": CondPos, "Capture": Capture}


def _weights(patcher):
    return {k: v.detach().clone() for k, v in patcher.model.diffusion_model.state_dict().items()}


def _unloaded_weights(patcher):
    """The weights once the host unloaded the model: our adapters stay on a loaded model between
    samplings, as the host's own patches do, and come off when it unloads the model."""
    from comfyui_lora_runtime.standalone.host import model_management
    model_management.unload_all_models()
    return _weights(patcher)


def _sample(model, seed=42, steps=3):
    latent = {"samples": torch.zeros(1, 16, 1, 8, 8)}
    pos = CondPos().go("pos")[0]
    neg = CondPos().go("neg")[0]
    out = LoraSampler().sample(model, seed, steps, 5.0, "euler", "simple", pos, neg, latent, 1.0)
    return out["result"][0]["samples"], out["ui"]["lora_report"][0]


def sampling_graph(model_nodes: dict, last: str, mode="dynamic", tier="exact"):
    """An API prompt: the embedded model, `model_nodes` (ending at node `last`), merge mode, tier,
    a 4-step KSampler (seed 42, CFG 5), a Capture of its latent and the report node."""
    p = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan.safetensors", "weight_dtype": "default"}},
        **model_nodes,
        "3": {"class_type": "LoraRuntimeMergeMode", "inputs": {"model": [last, 0], "mode": mode}},
        "4": {"class_type": "LoraRuntimeQualityTier", "inputs": {"model": ["3", 0], "tier": tier}},
        "5": {"class_type": "CondPos", "inputs": {"which": "pos"}},
        "6": {"class_type": "CondPos", "inputs": {"which": "neg"}},
        "7": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1,
                                                                  "batch_size": 1}},
        "8": {"class_type": "KSampler", "inputs": {
            "model": ["4", 0], "seed": 42, "steps": 4, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["5", 0], "negative": ["6", 0], "latent_image": ["7", 0], "denoise": 1.0}},
        "9": {"class_type": "Capture", "inputs": {"samples": ["8", 0]}},
        "10": {"class_type": "LoraRuntimeReport", "inputs": {"model": ["4", 0], "latent": ["8", 0]}},
    }
    return p
