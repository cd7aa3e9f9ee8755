"""A loaded adapter owns its bytes: the tensors are built from one read of the file into
process memory, never from a mapping of it, and the content hash is of those same bytes.
So rewriting, truncating or deleting the file afterwards changes no loaded tensor (and a
truncation cannot fault the process). The wrong answer (a mapped load) is shown too: the
same in-place rewrite changes a memory-mapped tensor."""
import hashlib
import os
import struct

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from comfyui_lora_runtime.lora_runtime.files.load import load_adapter
from comfyui_lora_runtime.lora_runtime.files.safetensors_file import load_safetensors
from testkit.bad_adapter_files import rewrite_data_in_place


def _file(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {"lora_unet_blocks_0_ffn_0.lora_down.weight": torch.randn(4, 64, generator=g),
          "lora_unet_blocks_0_ffn_0.lora_up.weight": torch.randn(32, 4, generator=g),
          "lora_unet_blocks_0_ffn_0.alpha": torch.tensor(4.0)}
    p = tmp_path / "a.safetensors"
    save_file(sd, str(p))
    return p, sd


def test_tensors_and_hash_come_from_one_owned_read(tmp_path):
    p, sd = _file(tmp_path)
    tensors, meta, digest = load_safetensors(p)
    assert digest == hashlib.blake2b(p.read_bytes(), digest_size=16).hexdigest()
    assert all(torch.equal(tensors[k], v) for k, v in sd.items())
    before = {k: v.clone() for k, v in tensors.items()}

    rewrite_data_in_place(p)
    assert all(torch.equal(tensors[k], before[k]) for k in before)      # the rewrite did not reach them
    with safe_open(str(p), "pt") as f:                                    # the wrong answer: a mapping sees it
        mapped = f.get_tensor("lora_unet_blocks_0_ffn_0.lora_down.weight")
    assert torch.all(mapped == 0.25) and not torch.equal(mapped, before["lora_unet_blocks_0_ffn_0.lora_down.weight"])

    os.truncate(p, 16)                                                     # a mapping would fault (SIGBUS) here
    assert all(torch.equal(tensors[k], before[k]) for k in before)
    os.remove(p)
    assert all(torch.equal(tensors[k], before[k]) for k in before)
    assert float(sum(t.double().sum() for t in tensors.values())) == float(sum(t.double().sum() for t in before.values()))


def test_loaded_adapter_is_unchanged_by_an_in_place_rewrite(tmp_path):
    p, sd = _file(tmp_path)
    a = load_adapter(p)
    (la,) = a.layers.values()
    down0 = la.update.down.clone()
    rewrite_data_in_place(p, 3.0)
    assert torch.equal(la.update.down, down0)
    assert torch.equal(down0, sd["lora_unet_blocks_0_ffn_0.lora_down.weight"])
    assert load_adapter(p).content_hash != a.content_hash                # the rewritten file reads as new content


def test_tensors_are_writable_views_not_file_backed(tmp_path):
    p, sd = _file(tmp_path)
    tensors, _, _ = load_safetensors(p)
    t = tensors["lora_unet_blocks_0_ffn_0.lora_up.weight"]
    t.add_(1.0)                                                             # owned memory: writable, file untouched
    assert torch.equal(t, sd["lora_unet_blocks_0_ffn_0.lora_up.weight"] + 1.0)
    with safe_open(str(p), "pt") as f:
        assert torch.equal(f.get_tensor("lora_unet_blocks_0_ffn_0.lora_up.weight"),
                           sd["lora_unet_blocks_0_ffn_0.lora_up.weight"])


def test_every_dtype_and_an_unaligned_offset_round_trip(tmp_path):
    sd = {"a.f64": torch.randn(3, 2, dtype=torch.float64), "a.f16": torch.randn(5).half(),
          "a.bf16": torch.randn(7).bfloat16(), "a.i8": torch.arange(3, dtype=torch.int8),
          "a.b": torch.tensor([True, False, True]), "a.f8": torch.randn(4).to(torch.float8_e4m3fn),
          "a.i64": torch.arange(5), "a.empty": torch.zeros(0, 3), "a.u8": torch.arange(9, dtype=torch.uint8)}
    p = tmp_path / "dtypes.safetensors"
    save_file(sd, str(p))
    tensors, _, _ = load_safetensors(p)
    for k, v in sd.items():
        assert tensors[k].dtype == v.dtype and torch.equal(tensors[k].view(torch.uint8) if v.dtype.is_floating_point
                                                           and v.dtype.itemsize == 1 else tensors[k],
                                                           v.view(torch.uint8) if v.dtype.is_floating_point
                                                           and v.dtype.itemsize == 1 else v), k
    # a hand-written file whose fp32 tensor starts at an odd byte (legal JSON, unusual writer)
    import json
    hdr = json.dumps({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                      "y": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}).encode()
    hdr += b" " * ((-len(hdr)) % 8)
    raw = struct.pack("<Q", len(hdr)) + hdr + b"\x07" + struct.pack("<2f", 1.5, -2.0)
    q = tmp_path / "odd.safetensors"
    q.write_bytes(raw)
    tensors, _, _ = load_safetensors(q)
    assert tensors["x"].tolist() == [7] and tensors["y"].tolist() == [1.5, -2.0]


HEADER_FILES = ("meta_list", "meta_number", "deep_json", "bad_dtype", "bad_shape", "bad_offsets", "overlap",
                "truncated", "bad_json")


def test_malformed_headers_are_file_errors_when_loading_too(tmp_path):
    """The same checks guard the full load (not only prompt validation): an error naming
    the file and the fault, never a raw AttributeError / RecursionError / library error."""
    import pytest
    from testkit.bad_adapter_files import EXPECTED, write_bad_files
    from comfyui_lora_runtime.lora_runtime.errors import AdapterFileError

    write_bad_files(tmp_path)
    for stem in HEADER_FILES:
        name = f"{stem}.safetensors"
        with pytest.raises(AdapterFileError) as ei:
            load_adapter(tmp_path / name)
        assert name in str(ei.value) and EXPECTED[name] in str(ei.value), (name, str(ei.value))
