"""Load LoRA Adapter (model + CLIP): one file, its model part and its text-encoder part.

The model part is exactly Load LoRA Adapter (this node calls it with the same inputs: the
same MODEL intent, coverage and checks). The text-encoder part goes onto a clone of the
CLIP as the host's own LoraLoader puts it there (`host.apply_clip_lora`: ComfyUI's key
map for CLIP-L/G, T5, ..., its `load_lora` and ``add_patches``). Text-encoder layers the
CLIP has no place for follow ``unmatched_keys``: an error naming them, or a line on the
node and in the sampler's report. A file of text-encoder layers only patches the CLIP and
passes the MODEL through.
"""
from __future__ import annotations

from dataclasses import replace

from . import host
from ..lora_runtime import LoraRuntimeError
from ..lora_runtime.layer.schedule import parse_branch, parse_schedule
from ..lora_runtime.settings import STRENGTH_MAX, STRENGTH_MIN, check_strength
from . import lifecycle
from .caches import ADAPTERS
from .lora_nodes import CATEGORY, UNMATCHED_CHOICES, UNMATCHED_DEFAULT, LoadLoraAdapter, check_lora_name

NAME = "Load LoRA Adapter (model + CLIP)"


def _tensors(layers: dict, stems) -> int:
    return sum(len(layers[s].keys) for s in stems)


def clip_outcome(adapter, applied: dict, skipped: dict, strength: float) -> tuple[str, dict]:
    """(the line for the node and the report, the counts for the coverage dict)."""
    te = adapter.text_encoder
    n_ok, m_ok = len(applied), _tensors(te, applied)
    n_no, m_no = len(skipped), _tensors(te, skipped)
    if strength == 0:
        line = f"text encoder: off (strength 0); {len(te)} text-encoder layers ({_tensors(te, te)} tensors) not applied"
    else:
        line = f"{n_ok} text-encoder layers ({m_ok} tensors) applied to the CLIP (x{strength:g})"
    if n_no:
        reasons = sorted(set(skipped.values()))
        line += (f"; {n_no} text-encoder layers ({m_no} tensors) not applied: {'; '.join(reasons)} "
                 f"(e.g. {', '.join(list(skipped)[:3])})")
    counts = {"text_encoder_applied_layers": n_ok if strength else 0,
              "text_encoder_applied_tensors": m_ok if strength else 0,
              "text_encoder_layers": n_no if strength else len(te),
              "text_encoder_tensors": m_no if strength else _tensors(te, te), "clip": line}
    return line, counts


class LoadLoraAdapterModelClip:
    # the report on the node comes back on a fully cached re-run too (ComfyUI 0.33+ re-sends the
    # cached UI of such nodes)
    HAS_INTERMEDIATE_OUTPUT = True
    @classmethod
    def INPUT_TYPES(cls):
        base = LoadLoraAdapter.INPUT_TYPES()  # the model loader's inputs, so its options carry over as they grow
        req = dict(base["required"])
        strength_type, strength_opts = req.pop("strength")
        required = {
            "model": req.pop("model"),
            "clip": ("CLIP", {"tooltip": "The text encoder(s) the file's text-encoder layers go on. It is cloned, "
                                         "never changed."}),
            "lora_name": req.pop("lora_name"),
            "strength_model": (strength_type, {**strength_opts, "tooltip": "How strongly to apply the adapter to "
                                               "the diffusion model; 0 turns that part off, negative values "
                                               "invert it."}),
            "strength_clip": ("FLOAT", {"default": 1.0, "min": STRENGTH_MIN, "max": STRENGTH_MAX, "step": 0.01,
                                        "tooltip": "How strongly to apply the file's text-encoder layers to the "
                                                   "CLIP; 0 leaves the CLIP as it is."}),
            **req,
        }
        optional = dict(base.get("optional", {}))
        kind, opts = optional["unmatched_keys"]
        optional["unmatched_keys"] = (kind, {**opts, "tooltip": (
            "error: a key that the model or the CLIP has no layer for stops the run; skip and report: apply the "
            "rest and list the skipped keys on the report.")})
        return {"required": required, "optional": optional}

    RETURN_TYPES = ("MODEL", "CLIP")
    OUTPUT_TOOLTIPS = ("The model with this adapter added, exactly as Load LoRA Adapter adds it: any sampler that "
                       "samples it applies it and restores the weights afterwards.",
                       "The CLIP with the file's text-encoder layers patched on.")
    FUNCTION = "load"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Adds a LoRA adapter to the model (as Load LoRA Adapter does) and its text-encoder layers to the "
                   "CLIP (as ComfyUI's LoraLoader does). Use it for LoRAs that trained the text encoder too.")

    @classmethod
    def VALIDATE_INPUTS(cls, lora_name):
        return check_lora_name(lora_name, text_encoder_only_ok=True)

    def load(self, model, clip, lora_name, strength_model, strength_clip, unmatched_keys=UNMATCHED_DEFAULT,
             **model_inputs):
        if unmatched_keys not in UNMATCHED_CHOICES:
            raise LoraRuntimeError(f"unmatched_keys {unmatched_keys!r}: use one of {', '.join(UNMATCHED_CHOICES)}")
        strength_clip = check_strength(strength_clip, what=f"strength_clip of {lora_name}")
        adapter = ADAPTERS.load(host.resolve_lora(lora_name))
        # the CLIP part first: it has no side effect (a clone), and an error here leaves both inputs as they are
        new_clip, applied, skipped = (host.apply_clip_lora(clip, adapter, strength_clip) if adapter.text_encoder
                                      else (clip, {}, {}))
        if skipped and unmatched_keys == UNMATCHED_CHOICES[0]:
            raise LoraRuntimeError(
                f"{NAME}: {lora_name} has {len(skipped)} text-encoder layers ({_tensors(adapter.text_encoder, skipped)}"
                f" tensors) that this CLIP has no place for: {'; '.join(sorted(set(skipped.values())))} (e.g. "
                f"{', '.join(list(skipped)[:3])}). Connect the CLIP this LoRA was trained with, or set "
                "unmatched_keys to 'skip and report' to apply the rest.")
        if strength_clip == 0:
            new_clip = clip
        line, counts = clip_outcome(adapter, applied, skipped, strength_clip) if adapter.text_encoder else ("", {})
        if adapter.layers:
            out = LoadLoraAdapter().load(model, lora_name, strength_model, unmatched_keys=unmatched_keys,
                                         **model_inputs)
            new_model, coverage = out["result"][0], dict(out["ui"]["lora_coverage"][0])
            if line:
                entries = lifecycle.read(new_model).adapters
                new_model = lifecycle.with_changes(new_model, adapters=entries[:-1] + (replace(entries[-1], clip=line),))
        else:  # text-encoder layers only: nothing for the diffusion model, which passes through as it is
            where = f"{NAME} ({lora_name})"
            parse_schedule(model_inputs.get("strength_schedule", ""), where=where)  # the inputs are still checked
            if "branch" in model_inputs:
                parse_branch(model_inputs["branch"], where=where)
            check_strength(strength_model, what=f"strength_model of {lora_name}")
            new_model = model
            coverage = {"adapter": lora_name, "format": adapter.format, "matched": 0, "unmatched": 0,
                        "file_layers": 0, "model_linears": 0, "notes": ["no diffusion-model layers in the file: "
                                                                        "the MODEL passes through unchanged"]}
        if line:
            coverage.update(counts)
            coverage["notes"] = [n for n in coverage.get("notes", []) if "this node patches the model only" not in n]
            coverage["notes"].append(line)
        return {"ui": {"lora_coverage": [coverage]}, "result": (new_model, new_clip)}


NODE_CLASS_MAPPINGS = {"LoraRuntimeLoadAdapterModelClip": LoadLoraAdapterModelClip}
NODE_DISPLAY_NAME_MAPPINGS = {"LoraRuntimeLoadAdapterModelClip": NAME}
