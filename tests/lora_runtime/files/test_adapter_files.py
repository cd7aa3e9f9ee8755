"""Adapter files: every dialect maps onto the same modules; bad files get clear errors."""
import pickle
import struct

import pytest
import torch
from safetensors.torch import save_file

from comfyui_lora_runtime.lora_runtime import (AdapterFileError, AdapterFormatError, AdapterMatchError, load_adapter,
                                               match_adapter)

from testkit.fixtures import (TinyWanLike, linear_names, make_adapter_tensors, wan_native_to_diffusers, write_kohya,
                       write_peft)


@pytest.fixture
def model():
    return TinyWanLike()


def _dialects(tmp_path, pairs):
    return {
        "kohya lora_unet_ (musubi-tuner)": write_kohya(tmp_path / "kohya.safetensors", pairs, alpha=2.0),
        "comfy diffusion_model. lora_up/down": write_kohya(tmp_path / "comfy.safetensors", pairs, alpha=2.0, prefix=None),
        "peft base_model.model.": write_peft(tmp_path / "peft.safetensors", pairs, alpha=2.0),
        "peft named slot": write_peft(tmp_path / "slot.safetensors", pairs, alpha=2.0, slot="default"),
        "diffusion-pipe diffusion_model.": write_peft(tmp_path / "dpipe.safetensors", pairs, alpha=2.0,
                                                      prefix="diffusion_model."),
        "diffusers transformer.": write_peft(tmp_path / "tr.safetensors", pairs, alpha=2.0, prefix="transformer."),
        "diffusers-named Wan (ai-toolkit)": write_peft(tmp_path / "aitk.safetensors", pairs, alpha=2.0,
                                                       prefix="diffusion_model.", name_map=wan_native_to_diffusers),
        "diffusers-named Wan transformer.": write_peft(tmp_path / "dwan.safetensors", pairs, alpha=2.0,
                                                       prefix="transformer.", name_map=wan_native_to_diffusers),
    }


def test_every_dialect_maps_onto_every_linear(tmp_path, model):
    pairs = make_adapter_tensors(model, r=4)
    for dialect, path in _dialects(tmp_path, pairs).items():
        adapter = load_adapter(path)
        layers, report = match_adapter(adapter, model)
        assert sorted(layers) == sorted(linear_names(model)), dialect
        assert not report.partial, (dialect, report.examples())
        for name, la in layers.items():
            assert torch.equal(la.update.down, pairs[name][0]), (dialect, name)
            assert torch.equal(la.update.up, pairs[name][1]), (dialect, name)
            assert la.update.alpha == 2.0 and la.update.scale == 0.5, dialect


def test_alpha_per_layer_tensor_then_metadata_then_rank(tmp_path, model):
    pairs = make_adapter_tensors(model, r=4, only=["ffn.0"])
    a = load_adapter(write_kohya(tmp_path / "a.safetensors", pairs, alpha=3.0))
    assert all(la.update.alpha == 3.0 for la in a.layers.values())
    b = load_adapter(write_peft(tmp_path / "b.safetensors", pairs, alpha=1.5))
    assert all(la.update.alpha == 1.5 and isinstance(la.update.alpha, float) for la in b.layers.values())
    c = load_adapter(write_peft(tmp_path / "c.safetensors", pairs))
    assert all(la.update.alpha is None and la.update.scale == 1.0 for la in c.layers.values())  # alpha = rank


def test_partial_coverage_is_reported_with_examples(tmp_path, model):
    pairs = make_adapter_tensors(model, r=2, only=["self_attn.q"])
    sd = {}
    for name, (d, u) in pairs.items():
        sd[f"diffusion_model.{name}.lora_down.weight"] = d
        sd[f"diffusion_model.{name}.lora_up.weight"] = u
    sd["diffusion_model.blocks.9.self_attn.q.lora_down.weight"] = torch.zeros(2, 32)
    sd["diffusion_model.blocks.9.self_attn.q.lora_up.weight"] = torch.zeros(32, 2)
    sd["diffusion_model.blocks.0.norm.lora_down.weight"] = torch.zeros(2, 32)
    sd["diffusion_model.blocks.0.norm.lora_up.weight"] = torch.zeros(32, 2)
    sd["something_else"] = torch.zeros(3)
    save_file(sd, str(tmp_path / "p.safetensors"))
    # by default nothing is dropped silently: the load fails naming the keys and the way out
    with pytest.raises(AdapterMatchError, match=r"3 layers or keys \(5 tensors\) would not be applied.*"
                                                r"blocks.9.self_attn.q.*"
                                                r"skip and report"):
        match_adapter(load_adapter(tmp_path / "p.safetensors"), model)
    layers, report = match_adapter(load_adapter(tmp_path / "p.safetensors"), model, lenient=True)
    assert len(layers) == 2 and report.partial
    assert len(report.unmatched) == 3
    text = " ".join(report.examples())
    assert "blocks.9.self_attn.q" in text and "no such layer" in text
    assert "LayerNorm" in text and "something_else" in text
    d = report.to_dict()
    assert d["matched"] == 2 and d["unmatched"] == 3 and d["model_linears"] == len(linear_names(model))


def test_zero_matches_is_an_error_naming_the_file(tmp_path, model):
    save_file({"transformer.double_blocks.0.img_attn.qkv.lora_A.weight": torch.zeros(2, 32),
               "transformer.double_blocks.0.img_attn.qkv.lora_B.weight": torch.zeros(96, 2)},
              str(tmp_path / "flux.safetensors"))
    with pytest.raises(AdapterMatchError, match="flux.safetensors matches no layer"):
        match_adapter(load_adapter(tmp_path / "flux.safetensors"), model)


def test_pickle_is_never_opened(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "evil.safetensors").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(AdapterFileError, match="not a .safetensors file.*not opened"):
        load_adapter(tmp_path / "evil.safetensors")
    torch.save({"a": torch.zeros(2)}, tmp_path / "ckpt.pt")
    with pytest.raises(AdapterFileError, match="ckpt.pt is a zip archive"):
        load_adapter(tmp_path / "ckpt.pt")
    assert not marker.exists()


def test_truncated_and_corrupt_files(tmp_path, model):
    pairs = make_adapter_tensors(model, r=2, only=["ffn.0"])
    good = write_kohya(tmp_path / "good.safetensors", pairs).read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(good[: len(good) - 10])
    with pytest.raises(AdapterFileError, match="trunc.safetensors is truncated"):
        load_adapter(tmp_path / "trunc.safetensors")
    (tmp_path / "hdr.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(AdapterFileError, match="no valid safetensors header"):
        load_adapter(tmp_path / "hdr.safetensors")
    (tmp_path / "json.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(AdapterFileError, match="not valid JSON"):
        load_adapter(tmp_path / "json.safetensors")
    with pytest.raises(AdapterFileError, match="not found"):
        load_adapter(tmp_path / "missing.safetensors")


def test_bad_tensors_name_the_key(tmp_path, model):
    save_file({"diffusion_model.blocks.0.ffn.0.lora_down.weight": torch.tensor([[float("nan")] * 32] * 2),
               "diffusion_model.blocks.0.ffn.0.lora_up.weight": torch.zeros(64, 2)}, str(tmp_path / "nan.safetensors"))
    with pytest.raises(AdapterFormatError, match="ffn.0.lora_down.weight.*NaN"):
        load_adapter(tmp_path / "nan.safetensors")
    save_file({"diffusion_model.blocks.0.ffn.0.lora_down.weight": torch.zeros(2, 32)}, str(tmp_path / "half.safetensors"))
    with pytest.raises(AdapterFormatError, match="down.* without its up"):
        load_adapter(tmp_path / "half.safetensors")
    save_file({"diffusion_model.blocks.0.ffn.0.lora_down.weight": torch.zeros(2, 16),
               "diffusion_model.blocks.0.ffn.0.lora_up.weight": torch.zeros(64, 2)}, str(tmp_path / "shape.safetensors"))
    with pytest.raises(AdapterFormatError, match=r"blocks.0.ffn.0.*\[64, 16\].*\[64, 32\]"):
        match_adapter(load_adapter(tmp_path / "shape.safetensors"), model)
    save_file({"a.lora_A.x.weight": torch.zeros(2, 4), "a.lora_B.x.weight": torch.zeros(4, 2),
               "b.lora_A.y.weight": torch.zeros(2, 4), "b.lora_B.y.weight": torch.zeros(4, 2)},
              str(tmp_path / "slots.safetensors"))
    with pytest.raises(AdapterFormatError, match="several PEFT adapter slots"):
        load_adapter(tmp_path / "slots.safetensors")


def test_diff_dora_and_offset_keys(tmp_path, model):
    sd = {"diffusion_model.blocks.0.ffn.0.diff": torch.randn(64, 32),
          "diffusion_model.blocks.0.ffn.0.diff_b": torch.randn(64),
          "diffusion_model.blocks.0.ffn.2.lora_down.weight": torch.randn(2, 64),
          "diffusion_model.blocks.0.ffn.2.lora_up.weight": torch.randn(32, 2),
          "diffusion_model.blocks.0.ffn.2.dora_scale": torch.rand(32, 1) + 0.5}
    save_file(sd, str(tmp_path / "d.safetensors"))
    layers, report = match_adapter(load_adapter(tmp_path / "d.safetensors"), model)
    assert set(layers) == {"blocks.0.ffn.0", "blocks.0.ffn.2"} and not report.partial
    assert layers["blocks.0.ffn.0"].update.diff_b is not None and layers["blocks.0.ffn.0"].update.diff is not None
    assert layers["blocks.0.ffn.2"].update.magnitude is not None


def test_a_header_length_starting_with_0x80_is_still_safetensors(tmp_path, model):
    """The first byte of a safetensors file is the low byte of its header length; 0x80 there
    is not a pickle (1 in 32 valid files has it, since headers are 8-byte aligned)."""
    pairs = make_adapter_tensors(model, r=2, only=["ffn.0"])
    sd = {}
    for name, (d, u) in pairs.items():
        sd[f"diffusion_model.{name}.lora_down.weight"] = d
        sd[f"diffusion_model.{name}.lora_up.weight"] = u
    for pad in range(0, 600):
        path = tmp_path / "x80.safetensors"
        save_file(sd, str(path), metadata={"pad": "x" * pad})
        if path.read_bytes()[0] == 0x80:
            break
    else:
        pytest.fail("could not make a header length of 128 mod 256")
    layers, _ = match_adapter(load_adapter(path), model)
    assert len(layers) == 2


def test_an_adapter_for_another_family_fails_even_when_a_layer_happens_to_match(tmp_path, model):
    """A Flux file on a Wan-like model: one key (proj_out -> head.head) maps, the rest do not."""
    sd = {"transformer.proj_out.lora_A.weight": torch.zeros(2, 32), "transformer.proj_out.lora_B.weight": torch.zeros(32, 2)}
    for i in range(3):
        for part in ("to_q", "to_k"):
            sd[f"transformer.transformer_blocks.{i}.attn.{part}.lora_A.weight"] = torch.zeros(2, 32)
            sd[f"transformer.transformer_blocks.{i}.attn.{part}.lora_B.weight"] = torch.zeros(32, 2)
        sd[f"transformer.single_transformer_blocks.{i}.proj_mlp.lora_A.weight"] = torch.zeros(2, 32)
        sd[f"transformer.single_transformer_blocks.{i}.proj_mlp.lora_B.weight"] = torch.zeros(32, 2)
    save_file(sd, str(tmp_path / "flux_style.safetensors"))
    with pytest.raises(AdapterMatchError, match=r"only 1 of its 10 layers match.*adapter for Flux"):
        match_adapter(load_adapter(tmp_path / "flux_style.safetensors"), model, lenient=True)


def test_videox_fun_double_underscore_kohya_keys(tmp_path, model):
    pairs = make_adapter_tensors(model, r=2)
    sd = {}
    for name, (d, u) in pairs.items():
        stem = "lora_unet__" + name.replace(".", "_")
        sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"] = d, u
    save_file(sd, str(tmp_path / "vxf.safetensors"))
    layers, report = match_adapter(load_adapter(tmp_path / "vxf.safetensors"), model)
    assert sorted(layers) == sorted(pairs) and not report.partial


def test_fp8_factors_are_upcast_and_said_so(tmp_path, model):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8 dtype")
    pairs = make_adapter_tensors(model, r=2, only=["ffn.0"])
    sd = {}
    for name, (d, u) in pairs.items():
        sd[f"diffusion_model.{name}.lora_down.weight"] = d.to(torch.float8_e4m3fn)
        sd[f"diffusion_model.{name}.lora_up.weight"] = u.to(torch.float8_e4m3fn)
    save_file(sd, str(tmp_path / "fp8.safetensors"))
    ad = load_adapter(tmp_path / "fp8.safetensors")
    la = next(iter(ad.layers.values()))
    assert la.update.down.dtype == torch.float32 and any("upcast" in n for n in ad.notes)
    name, (d, _) = next(iter(pairs.items()))
    assert torch.equal(la.update.down, d.to(torch.float8_e4m3fn).float())  # the stored values, exactly


def test_a_web_page_saved_as_safetensors_says_download_again(tmp_path):
    from comfyui_lora_runtime.lora_runtime import LoraRuntimeError
    (tmp_path / "page.safetensors").write_text("<!DOCTYPE html><html><body>Sign in</body></html>")
    with pytest.raises(LoraRuntimeError, match=r"page.safetensors is an HTML.*Download the file again") as ei:
        load_adapter(tmp_path / "page.safetensors")
    assert "Convert" not in str(ei.value)
