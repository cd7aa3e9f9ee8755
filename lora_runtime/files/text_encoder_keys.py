"""Text-encoder keys in a LoRA file: a class of their own.

Many LoRA files train the text encoder(s) too: kohya writes ``lora_te_`` (SD1.x, one
encoder), ``lora_te1_`` / ``lora_te2_`` (SDXL's CLIP-L / CLIP-G; Flux's CLIP-L / T5 in
some trainers), diffusers / PEFT write ``text_encoder.`` / ``text_encoder_2.``.
These layers are not in the diffusion model: a model-only loader applies the model part
and says how much of the file it left to the text encoder ("N text-encoder layers (M
tensors) not applied: this node patches the model only") instead of calling each one
"no such layer in the model". Load LoRA Adapter (model + CLIP) applies them to the CLIP as
ComfyUI's LoraLoader does.
"""
from __future__ import annotations

_PREFIXES = ("lora_te_", "lora_te1_", "lora_te2_", "lora_te3_", "text_encoder.", "text_encoder_2.",
             "text_encoder_3.", "base_model.model.text_encoder.", "base_model.model.text_encoder_2.")


def is_text_encoder(stem: str) -> bool:
    """Does this file stem name a text-encoder layer?"""
    return stem.startswith(_PREFIXES)


def split(layers: dict) -> dict:
    """Remove the text-encoder stems from `layers` (in place) and return them."""
    te = {s: la for s, la in layers.items() if is_text_encoder(s)}
    for s in te:
        del layers[s]
    return te


def counts(te_layers: dict) -> tuple[int, int]:
    """(layers, tensors) of the text-encoder part."""
    return len(te_layers), sum(len(la.keys) for la in te_layers.values())


def note(te_layers: dict) -> str:
    n, m = counts(te_layers)
    return (f"{n} text-encoder layers ({m} tensors) not applied: this node patches the model only"
            if n else "")


def only_text_encoder_message(fname: str, te_layers: dict) -> str:
    n, m = counts(te_layers)
    example = next(iter(te_layers), "")
    return (f"{fname} holds only text-encoder weights ({n} layers, {m} tensors, e.g. {example!r}) and nothing for "
            "the diffusion model; this node patches the model only. Load it with Load LoRA Adapter (model + CLIP) "
            "or ComfyUI's LoraLoader, or pick the adapter made for the diffusion model")
