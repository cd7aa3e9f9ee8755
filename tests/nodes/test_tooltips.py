"""Node texts stay true: adapters are applied by any sampler that samples the MODEL, so no
tooltip or description may say they wait for the LoRA Sampler."""
import re

from comfyui_lora_runtime import NODE_CLASS_MAPPINGS


def _texts(cls):
    out = [getattr(cls, "DESCRIPTION", ""), *getattr(cls, "OUTPUT_TOOLTIPS", ())]
    spec = cls.INPUT_TYPES()
    for group in ("required", "optional"):
        for _, value in (spec.get(group) or {}).items():
            if len(value) > 1 and isinstance(value[1], dict):
                out.append(value[1].get("tooltip", ""))
    return out


def test_no_text_says_only_the_lora_sampler_applies_adapters(folders):
    bad = re.compile(r"(when|once) the LoRA Sampler runs|the LoRA Sampler (applies|guarantees)", re.I)
    found = [(name, t) for name, cls in NODE_CLASS_MAPPINGS.items() for t in _texts(cls) if bad.search(t)]
    assert found == []
    assert "any sampler" in NODE_CLASS_MAPPINGS["LoraRuntimeLoadAdapter"].OUTPUT_TOOLTIPS[0]
