"""The pack's LoRA nodes. Thin: validate, clone the MODEL, record intent, register the runtime.

The three MODEL nodes record a typed `Intent` on a clone and register the sampling
wrapper (`lifecycle`): from then on **any** sampler that samples that MODEL (ComfyUI's
KSampler, KSamplerAdvanced, SamplerCustomAdvanced, other packs', ours) plans the
adapters, applies them (attach / merge / mount fusions) after ComfyUI has loaded the
model, samples, and restores every weight bit for bit on the way out, also when
sampling fails or is interrupted. The LoRA Sampler is KSampler plus the report on its
node; the LoRA Runtime Report node puts the report of a stock sampler's run on a node
(and so in the prompt's history).
"""
from __future__ import annotations

import logging
import time

from . import host
from ..lora_runtime import LoraRuntimeError
from ..lora_runtime.files.content_digest import file_digest
from ..lora_runtime.files.header_check import check_adapter_file
from ..lora_runtime.targets import targets_of
from ..lora_runtime.block_filter import parse_blocks
from ..lora_runtime.layer.schedule import BRANCH_CHOICES, parse_branch, parse_schedule, parse_strength_list
from ..lora_runtime.intent import AdapterSpec
from ..lora_runtime.settings import STRENGTH_MAX, STRENGTH_MIN, MergeMode, RestoreMemory, Tier
from . import lifecycle, report
from .caches import ADAPTERS

log = logging.getLogger(__name__)

CATEGORY = "loaders/lora runtime"
UNMATCHED_CHOICES = ("error", "skip and report")
# ComfyUI's loading policy, with the report: a file whose keys mostly target this model applies what maps and lists
# the rest (ComfyUI logs them); a file that looks made for another model is refused whatever this says
UNMATCHED_DEFAULT = UNMATCHED_CHOICES[1]
SCHEDULE_TOOLTIP = (
    "Optional strength multiplier over the denoising, applied at run time: one value per step ('1, 1, 0, 0'), "
    "percent:multiplier keyframes ('0:1, 0.5:0') or 'linear 0:1, 1:0'. Empty: constant; a changing schedule "
    "keeps the adapter dynamic.")
BLOCKS_TOOLTIP = (
    "Optional per-block strength and layers left out, e.g. '0-9: 0.5, !cross_attn' or 'only 10-29' (later "
    "entries win). The report shows which layers got which strength.")
STRENGTH_LIST_TOOLTIP = ("Optional FLOAT list from another node: one strength multiplier per sampling step. Use it "
                         "or strength_schedule, not both.")


class LoadLoraAdapter:
    # the report on the node comes back on a fully cached re-run too (ComfyUI 0.33+ re-sends the
    # cached UI of such nodes)
    HAS_INTERMEDIATE_OUTPUT = True
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The diffusion model the adapter is for. It is cloned, never changed."}),
            "lora_name": (host.lora_names(), {"tooltip": "A .safetensors LoRA from the loras folder "
                                                          "(kohya, PEFT/diffusers, Wan trainer dialects)."}),
            "strength": ("FLOAT", {"default": 1.0, "min": STRENGTH_MIN, "max": STRENGTH_MAX, "step": 0.01,
                                   "tooltip": "How strongly to apply the adapter; 0 turns it off, "
                                              "negative values invert it."}),
        }, "optional": {
            "unmatched_keys": (list(UNMATCHED_CHOICES), {
                "default": UNMATCHED_DEFAULT,
                "tooltip": "skip and report: apply what maps to this model and list the rest on the report "
                           "(ComfyUI's policy); error: any key with no layer stops the run."}),
            "strength_schedule": ("STRING", {"default": "", "multiline": False, "tooltip": SCHEDULE_TOOLTIP}),
            "branch": (list(BRANCH_CHOICES), {
                "default": BRANCH_CHOICES[0],
                "tooltip": "Which CFG branch the adapter acts on: both, positive only or negative only. Other "
                           "than both keeps it dynamic."}),
            "blocks": ("STRING", {"default": "", "multiline": False, "tooltip": BLOCKS_TOOLTIP}),
            "strength_list": ("FLOAT", {"forceInput": True, "tooltip": STRENGTH_LIST_TOOLTIP}),
        }}

    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The model with this adapter added; any sampler that samples it (KSampler, the LoRA Sampler, "
                       "others) applies it and restores the weights afterwards.",)
    FUNCTION = "load"
    CATEGORY = CATEGORY
    DESCRIPTION = "Adds a LoRA adapter to the model. Chain several to stack adapters."

    @classmethod
    def VALIDATE_INPUTS(cls, lora_name):
        # Checked when the prompt is queued (ComfyUI answers HTTP 400 with node_errors):
        # the name, and everything the file's header tells (not safetensors / pickle,
        # truncated, no LoRA key, a malformed config). ComfyUI attaches this function's
        # answer to every input it declares, so it declares only lora_name: a bad file is
        # one error, on lora_name. The host checks branch (a list) and strength (min/max)
        # itself, on their own inputs; the schedule's form is checked when this node runs
        # (its length against the steps when sampling starts), naming strength_schedule.
        # Layers matched against the model are checked when the node runs too: ComfyUI
        # does not hand a linked input (the MODEL) to validation.
        return check_lora_name(lora_name)

    @classmethod
    def IS_CHANGED(cls, lora_name, **_):
        # ComfyUI keys this node's cached output by its inputs and this answer: the file's content
        # digest, so a file rewritten under the same name runs the node again. Hashed once per
        # (path, size, mtime) in this process, not on every queue.
        return lora_fingerprint(lora_name)

    def load(self, model, lora_name, strength, unmatched_keys=UNMATCHED_DEFAULT, strength_schedule="",
             branch=BRANCH_CHOICES[0], blocks="", strength_list=None):
        if unmatched_keys not in UNMATCHED_CHOICES:
            raise LoraRuntimeError(f"unmatched_keys {unmatched_keys!r}: use one of {', '.join(UNMATCHED_CHOICES)}")
        where = f"Load LoRA Adapter ({lora_name})"
        schedule = parse_schedule(strength_schedule, where=where)  # a malformed schedule stops the run here
        listed = parse_strength_list(strength_list, where=where)
        if listed is not None and schedule is not None:
            raise LoraRuntimeError(f"{where}: strength_list is connected and strength_schedule is set; use one of "
                                   "them (clear strength_schedule or disconnect strength_list)")
        schedule = listed or schedule
        block_filter = parse_blocks(blocks, where=where)  # a malformed filter stops the run here, naming blocks
        branch = parse_branch(branch, where=where)
        lenient = unmatched_keys == UNMATCHED_CHOICES[1]
        path = host.resolve_lora(lora_name)
        adapter = ADAPTERS.load(path)
        entry = AdapterSpec(path, strength, lora_name, lenient=lenient, schedule=schedule, branch=branch,
                            content_hash=adapter.content_hash, blocks=block_filter)  # the strength is checked here
        # names and shapes only: the model is not loaded or patched here. No match, or a block
        # filter entry selecting none of the adapter's layers, raises here; the plan reuses this
        t = targets_of(adapter, host.diffusion_model(model), entry, where=where)
        shown = t.coverage.to_dict()
        if t.blocks is not None:
            shown["blocks"] = t.blocks
        out = lifecycle.with_changes(model, adapters=lifecycle.read(model).adapters + (entry,))
        return {"ui": {"lora_coverage": [shown]}, "result": (out,)}


def lora_fingerprint(lora_name) -> str:
    """The content digest of `lora_name`'s file (`LoraAdapter.content_hash` of the same bytes), or a
    text naming why it cannot be read (the node's own run then says so)."""
    try:
        return file_digest(host.resolve_lora(lora_name))
    except (ValueError, OSError) as e:
        return f"unreadable: {e}"


def check_lora_name(lora_name, **checks):
    """A loader's queue-time answer for `lora_name`: True, or the problem with the name or the
    file's header (`checks` go to `check_adapter_file`)."""
    try:
        path = host.resolve_lora(lora_name)
    except (ValueError, FileNotFoundError) as e:
        return str(e)
    return check_adapter_file(path, **checks) or True


class LoraMergeMode:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL",),
            "mode": ([m.value for m in MergeMode], {"default": MergeMode.AUTO.value, "tooltip":
                     "auto: merge unless a merge would round away more than half of the adapters' update; "
                     "merge: always fold into the weights; dynamic: never touch the weights."}),
        }, "optional": {
            "restore_memory": ([m.value for m in RestoreMemory], {"default": RestoreMemory.LEAN.value, "tooltip":
                               "What a merge keeps to restore the weights bit for bit: lean keeps about 1 % of each "
                               "weight; copy keeps a full copy (faster switching, more memory)."}),
        }}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "set_mode"
    CATEGORY = CATEGORY
    DESCRIPTION = ("How any sampler that samples this model applies its adapters: merged into the weights or not, "
                   "and what a merge keeps to restore them.")

    def set_mode(self, model, mode, restore_memory=RestoreMemory.LEAN.value):
        return (lifecycle.with_changes(model, mode=mode, restore=restore_memory),)


class LoraQualityTier:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL",),
            "tier": ([t.value for t in Tier], {"default": Tier.LOSSLESS.value, "tooltip":
                     "exact: bit-identical to the eager reference; lossless: no measurable loss, fused "
                     "kernels allowed; high: close (PSNR >= 30 dB), approximations allowed."}),
        }}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "set_tier"
    CATEGORY = CATEGORY
    DESCRIPTION = "What any sampler that samples this model guarantees about the adapters' numerics."

    def set_tier(self, model, tier):
        return (lifecycle.with_changes(model, tier=tier),)


class LoraSampler:
    # the report on the node comes back on a fully cached re-run too (ComfyUI 0.33+ re-sends the
    # cached UI of such nodes)
    HAS_INTERMEDIATE_OUTPUT = True
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The model with its adapters, merge mode and tier."}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 0xffffffffffffffff, "control_after_generate": True,
                             "tooltip": "The random seed for the noise."}),
            "steps": ("INT", {"default": 20, "min": 1, "max": 10000, "tooltip": "Denoising steps."}),
            "cfg": ("FLOAT", {"default": 5.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01,
                              "tooltip": "Classifier-free guidance scale; 1.0 skips the negative."}),
            "sampler_name": (host.sampler_names(), {"tooltip": "The sampling algorithm."}),
            "scheduler": (host.scheduler_names(), {"tooltip": "The sigma schedule."}),
            "positive": ("CONDITIONING", {"tooltip": "What to include."}),
            "negative": ("CONDITIONING", {"tooltip": "What to exclude."}),
            "latent_image": ("LATENT", {"tooltip": "The latent to denoise."}),
            "denoise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                  "tooltip": "How much of the latent to replace."}),
        }}

    RETURN_TYPES = ("LATENT",)
    OUTPUT_TOOLTIPS = ("The denoised latent.",)
    FUNCTION = "sample"
    CATEGORY = CATEGORY
    DESCRIPTION = ("KSampler that applies the model's LoRA adapters exactly (measured merge decision, "
                   "guarded fused kernels) and restores every weight afterwards.")

    def sample(self, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
               denoise=1.0):
        given = model  # the MODEL output that also feeds a LoRA Runtime Report node
        if not lifecycle.is_registered(model):  # a MODEL none of our nodes touched: sample it as KSampler would,
            model = model.clone()                 # with the runtime's report on this node
            lifecycle.register(model)
        lifecycle.clear_report(model)
        t0 = time.perf_counter()
        latent = host.sample(model, seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name,
                             scheduler=scheduler, positive=positive, negative=negative, latent=latent_image,
                             denoise=denoise)
        r = lifecycle.last_report(model)
        if r is None:  # nothing to apply (no adapter, default tier), or no step to run (denoise 0)
            want = lifecycle.read(model)
            r = report.build(None, mode=want.mode.value, tier=want.tier.value, host=host.NAME,
                             sample_seconds=time.perf_counter() - t0, steps=steps)
            log.info("%s", report.text(r))
        if given is not model:
            lifecycle.store_report(given, r)
        return {"ui": {"lora_report": [r]}, "result": (latent,)}


class LoraRuntimeReport:
    """Shows the runtime report of the last sampling of a MODEL by any sampler."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The MODEL the sampler sampled (the same output that feeds it)."}),
            "latent": ("LATENT", {"tooltip": "The sampler's output, so this node runs after it."}),
        }}

    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "show"
    CATEGORY = CATEGORY
    DESCRIPTION = ("The LoRA runtime report (coverage, merge decision, tier, fusions, timings) of the last time "
                   "any sampler sampled this MODEL; it also lands in the prompt's history.")

    def show(self, model, latent):
        r = lifecycle.last_report(model)
        want = lifecycle.read(model)
        if r is None and not want.touches_model:  # no adapters (and the default tier): nothing was applied
            r = report.build(None, mode=want.mode.value, tier=want.tier.value, host=host.NAME, sample_seconds=0.0,
                             steps=1)
            r["note"] = ("no LoRA adapters on this MODEL: a sampler samples it as it is (no weight touched); "
                         "add a Load LoRA Adapter node before the sampler to apply one")
        if r is None:
            raise LoraRuntimeError(
                "LoRA Runtime Report: this MODEL has not been sampled with the LoRA runtime in this session. Connect "
                "the same MODEL output that feeds the sampler (after Load LoRA Adapter / Merge Mode / Quality Tier), "
                "and the sampler's LATENT output to 'latent'.")
        return {"ui": {"lora_report": [r]}}


NODE_CLASS_MAPPINGS = {
    "LoraRuntimeLoadAdapter": LoadLoraAdapter,
    "LoraRuntimeMergeMode": LoraMergeMode,
    "LoraRuntimeQualityTier": LoraQualityTier,
    "LoraRuntimeSampler": LoraSampler,
    "LoraRuntimeReport": LoraRuntimeReport,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "LoraRuntimeLoadAdapter": "Load LoRA Adapter",
    "LoraRuntimeMergeMode": "LoRA Merge Mode",
    "LoraRuntimeQualityTier": "LoRA Quality Tier",
    "LoraRuntimeSampler": "LoRA Sampler",
    "LoraRuntimeReport": "LoRA Runtime Report",
}
