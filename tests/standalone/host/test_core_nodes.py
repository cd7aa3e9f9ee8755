"""Bundled core nodes and the host pieces under them: model folders, the
ModelPatcher stand-in, PNG metadata, and the reference KSampler run through the
executor."""
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from comfyui_lora_runtime.standalone.host import folder_paths, progress
from comfyui_lora_runtime.standalone.host.core_nodes import (CORE_NODE_CLASS_MAPPINGS,
                                                          EmptyHunyuanLatentVideo, KSampler,
                                                          ModelSamplingSD3, SaveImage, UNETLoader)
from comfyui_lora_runtime.standalone.host.executor import NodeExecutionError, execute_prompt
from comfyui_lora_runtime.standalone.host.model_patcher import (BundledModel, BundledModelPatcher,
                                                             ModelSamplingFlow)
from comfyui_lora_runtime.standalone.host.png_metadata import read_png_metadata, save_png

from testkit.refdata import REF  # noqa: E402


# -- model folders ------------------------------------------------------------
@pytest.fixture
def folders(tmp_path):
    models = tmp_path / "models"
    (models / "loras" / "style").mkdir(parents=True)
    (models / "diffusion_models").mkdir()
    (models / "loras" / "a.safetensors").write_bytes(b"x")
    (models / "loras" / "style" / "b.safetensors").write_bytes(b"x")
    (models / "loras" / "c.ckpt").write_bytes(b"x")           # not an allowed extension
    (models / "loras" / ".hidden.safetensors").write_bytes(b"x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "evil.safetensors").write_bytes(b"x")
    os.symlink(outside / "evil.safetensors", models / "loras" / "evil.safetensors")
    os.symlink(outside, models / "loras" / "linkdir")
    os.symlink(models / "loras", models / "loras" / "style" / "loop")   # a link loop inside
    return folder_paths.ModelFolders(models_dir=models, output_dir=tmp_path / "out")


def test_filename_list_sorted_relative_filtered(folders):
    assert folders.get_filename_list("loras") == ["a.safetensors", "style/b.safetensors"]
    assert folders.get_filename_list("diffusion_models") == []
    assert folders.get_folder_paths("loras") == [str(folders.models_dir / "loras")]
    with pytest.raises(KeyError, match="checkpoints"):
        folders.get_filename_list("checkpoints")


def test_full_path_and_escapes(folders):
    root = folders.models_dir / "loras"
    assert folders.get_full_path("loras", "style/b.safetensors") == str(root / "style" / "b.safetensors")
    assert folders.get_full_path("loras", "style\\b.safetensors") == str(root / "style" / "b.safetensors")
    assert folders.get_full_path("loras", "missing.safetensors") is None
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        folders.get_full_path_or_raise("loras", "missing.safetensors")
    bad_names = ["../outside/evil.safetensors", "style/../../outside/evil.safetensors",
                 str(root / "a.safetensors"), "/etc/passwd", "evil.safetensors",
                 "linkdir/evil.safetensors", "", "..\\outside\\evil.safetensors"]
    for name in bad_names:
        with pytest.raises(ValueError) as exc:
            folders.get_full_path("loras", name)
        assert repr(name) in str(exc.value) and str(root) in str(exc.value), name


def test_default_and_active_folders(folders, monkeypatch, tmp_path):
    monkeypatch.setenv(folder_paths.ENV_MODELS_DIR, str(tmp_path / "envmodels"))
    monkeypatch.setattr(folder_paths, "_default", None)
    assert folder_paths.default_folders().models_dir == tmp_path / "envmodels"
    with folder_paths.activated(folders):
        assert folder_paths.get_filename_list("loras") == ["a.safetensors", "style/b.safetensors"]
        assert folder_paths.get_output_directory() == str(tmp_path / "out")
    assert folder_paths.get_folder_paths("loras") == [str(tmp_path / "envmodels" / "loras")]
    # instances do not share state
    other = folder_paths.ModelFolders(models_dir=tmp_path / "m2")
    other.add_folder_path("loras", tmp_path / "extra")
    assert len(other.get_folder_paths("loras")) == 2 and len(folders.get_folder_paths("loras")) == 1


# -- model patcher ------------------------------------------------------------
def test_patcher_clone_isolation():
    base = BundledModelPatcher(BundledModel(torch.nn.Linear(2, 2)))
    base.model_options["transformer_options"]["adapters"] = ["a"]
    c1, c2 = base.clone(), base.clone()
    c1.model_options["transformer_options"]["adapters"].append("b")
    c1.model_options["tier"] = "exact"
    c1.add_object_patch("model_sampling", ModelSamplingFlow(3.0))
    assert base.model_options == {"transformer_options": {"adapters": ["a"]}}
    assert c2.model_options == {"transformer_options": {"adapters": ["a"]}}
    assert c1.model_options["transformer_options"]["adapters"] == ["a", "b"]
    assert c1.get_model_object("model_sampling").shift == 3.0
    assert base.get_model_object("model_sampling").shift == 8.0 == c2.get_model_object("model_sampling").shift
    assert c1.model is base.model and c1.is_clone(base) and base.is_clone(c2)
    assert not base.is_clone(BundledModelPatcher(BundledModel(torch.nn.Linear(2, 2))))
    assert c1.get_model_object("diffusion_model.weight") is base.model.diffusion_model.weight
    with pytest.raises(AttributeError, match="nope"):
        c1.get_model_object("nope")


def test_model_sampling_sd3_patches_a_clone():
    base = BundledModelPatcher(BundledModel(torch.nn.Linear(2, 2)))
    (patched,) = ModelSamplingSD3().patch(base, 3.0)
    assert patched is not base and patched.is_clone(base)
    assert patched.get_model_object("model_sampling") == ModelSamplingFlow(3.0, 1000.0)
    assert base.get_model_object("model_sampling").shift == 8.0


# -- PNG + SaveImage ----------------------------------------------------------
def test_png_chunks_round_trip(tmp_path):
    prompt = {"1": {"class_type": "X", "inputs": {"v": 1}}}
    workflow = {"nodes": [{"id": 1}], "links": []}
    save_png(tmp_path / "a.png", torch.rand(4, 5, 3), prompt, {"workflow": workflow})
    meta = read_png_metadata(tmp_path / "a.png")
    assert meta == {"prompt": prompt, "workflow": workflow}
    save_png(tmp_path / "b.png", torch.rand(4, 5, 3))
    assert read_png_metadata(tmp_path / "b.png") == {}


def test_save_image_names_pixels_and_metadata(tmp_path):
    f = folder_paths.ModelFolders(models_dir=tmp_path / "m", output_dir=tmp_path / "out")
    images = torch.stack([torch.zeros(6, 4, 3), torch.ones(6, 4, 3)])
    images[0, 0, 0] = torch.tensor([0.5, 0.25, 1.0])
    with folder_paths.activated(f):
        ui1 = SaveImage().save_images(images, "run/pic", prompt={"p": 1}, extra_pnginfo={"workflow": {"w": 2}})
        ui2 = SaveImage().save_images(images[:1], "run/pic")
    assert ui1 == {"ui": {"images": [{"filename": "pic_00001_.png", "subfolder": "run", "type": "output"},
                                     {"filename": "pic_00002_.png", "subfolder": "run", "type": "output"}]}}
    assert ui2["ui"]["images"][0]["filename"] == "pic_00003_.png"   # the counter continues
    from PIL import Image
    px = np.asarray(Image.open(tmp_path / "out" / "run" / "pic_00001_.png"))
    assert px.shape == (6, 4, 3) and px[0, 0].tolist() == [127, 63, 255] and px[1, 1].tolist() == [0, 0, 0]
    assert np.asarray(Image.open(tmp_path / "out" / "run" / "pic_00002_.png")).min() == 255
    assert read_png_metadata(tmp_path / "out" / "run" / "pic_00001_.png") == {"prompt": {"p": 1}, "workflow": {"w": 2}}
    with folder_paths.activated(f), pytest.raises(ValueError, match="outside the output folder"):
        SaveImage().save_images(images, "../escape")


def test_empty_hunyuan_latent_video_shape():
    (lat,) = EmptyHunyuanLatentVideo().generate(64, 48, 9, 2)
    assert lat["samples"].shape == (2, 16, 3, 6, 8) and not lat["samples"].any()
    (lat,) = EmptyHunyuanLatentVideo().generate(848, 480, 25)
    assert lat["samples"].shape == (1, 16, 7, 60, 106)


def test_core_input_types_match_comfyui():
    ks = KSampler.INPUT_TYPES()["required"]
    assert list(ks) == ["model", "seed", "steps", "cfg", "sampler_name", "scheduler",
                        "positive", "negative", "latent_image", "denoise"]
    assert ks["seed"][1]["control_after_generate"] and ks["cfg"][1]["default"] == 8.0
    assert UNETLoader.INPUT_TYPES()["required"]["weight_dtype"][0][0] == "default"
    assert set(CORE_NODE_CLASS_MAPPINGS) >= {"UNETLoader", "EmptyHunyuanLatentVideo", "ModelSamplingSD3",
                                             "KSampler", "SaveImage"}
    for cls in CORE_NODE_CLASS_MAPPINGS.values():
        assert callable(getattr(cls, cls.FUNCTION)) and isinstance(cls.CATEGORY, str)


# -- the reference KSampler run through the executor ----------------------------
class RefCond:
    """Test node: CONDITIONING from the reference cond_pos tensor, or zeros (the negative)."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"std": ("FLOAT", {"default": 1.0})}}
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "go"

    def go(self, std):
        from safetensors.torch import load_file
        cond = load_file(REF / "cond_pos.safetensors")["cond_pos"]
        return ([[cond * std if std else torch.zeros_like(cond), {}]],)


class CaptureLatent:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",)}}
    RETURN_TYPES = ()
    FUNCTION = "go"
    OUTPUT_NODE = True

    def go(self, samples):
        return {"ui": {"samples": [samples["samples"]]}}


def reference_prompt(steps=4, shift=None):
    p = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan_d128_l2.safetensors",
                                                     "weight_dtype": "default"}},
        "2": {"class_type": "RefCond", "inputs": {"std": 1.0}},
        "3": {"class_type": "RefCond", "inputs": {"std": 0.0}},
        "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1,
                                                                  "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": 42, "steps": steps, "cfg": 5.0,
                                                   "sampler_name": "euler", "scheduler": "simple",
                                                   "positive": ["2", 0], "negative": ["3", 0],
                                                   "latent_image": ["4", 0], "denoise": 1.0}},
        "9": {"class_type": "CaptureLatent", "inputs": {"samples": ["5", 0]}},
    }
    if shift is not None:
        p["6"] = {"class_type": "ModelSamplingSD3", "inputs": {"model": ["1", 0], "shift": shift}}
        p["5"]["inputs"]["model"] = ["6", 0]
    return p


@pytest.fixture
def ref_folders(tmp_path):
    pytest.importorskip("comfyui_lora_runtime.standalone.host.wan21")
    pytest.importorskip("comfyui_lora_runtime.standalone.host.sampling")
    from testkit.refdata import ref_file
    ref_file("tiny_wan_d128_l2.safetensors")
    dm = tmp_path / "models" / "diffusion_models"
    dm.mkdir(parents=True)
    shutil.copy(REF / "tiny_wan_d128_l2.safetensors", dm)   # a copy: symlinks out are refused
    return folder_paths.ModelFolders(models_dir=tmp_path / "models", output_dir=tmp_path / "out")


def load_ref(name):
    from safetensors.torch import load_file
    return load_file(REF / name)["samples"]


NODES = {**CORE_NODE_CLASS_MAPPINGS, "RefCond": RefCond, "CaptureLatent": CaptureLatent}


@pytest.mark.parametrize("shift,ref,wrong", [
    (None, "ksampler_out_euler_simple_4.safetensors", "ksampler_out_euler_simple_4_shift3.safetensors"),
    (3.0, "ksampler_out_euler_simple_4_shift3.safetensors", "ksampler_out_euler_simple_4.safetensors"),
])
def test_reference_ksampler_through_executor(ref_folders, shift, ref, wrong):
    seen = []
    with progress.progress_hook(lambda v, t, preview, node_id=None: seen.append((node_id, v, t))):
        res = execute_prompt(reference_prompt(shift=shift), NODES, folders=ref_folders)
    out = res.ui["9"]["samples"][0]
    expected, other = load_ref(ref), load_ref(wrong)
    assert out.shape == expected.shape == (1, 16, 1, 8, 8)
    # atol 1e-4: the README's bound for an independent fp32 Wan forward (values up to ~25)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)
    assert (out - other).abs().max() > 1e-2     # the shift patch matters: the other answer is wrong
    assert seen == [("5", i, 4) for i in range(1, 5)]


def test_ksampler_interrupt_and_bad_weight_dtype(ref_folders):
    calls = []

    def hook(v, t, preview, node_id=None):
        calls.append(v)
        if v == 2:
            progress.interrupt_current_processing()
    progress.interrupt_current_processing(False)
    with progress.progress_hook(hook), pytest.raises(progress.InterruptProcessingException):
        execute_prompt(reference_prompt(), NODES, folders=ref_folders)
    assert calls == [1, 2]
    p = reference_prompt()
    p["1"]["inputs"]["weight_dtype"] = "fp8_e5m2"
    with pytest.raises(NodeExecutionError, match=r"node 1 \(UNETLoader\).*fp8_e5m2"):
        execute_prompt(p, NODES, folders=ref_folders)
