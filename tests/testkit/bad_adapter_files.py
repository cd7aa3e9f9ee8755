"""Every kind of bad adapter file a user has, written on demand, with the words the
refusal must contain. Shared by the bundled-host and the real-ComfyUI validation tests."""
import json
import os
import struct

import torch
from safetensors.torch import save_file

# file name (without prefix) -> what the validation message must say
EXPECTED = {
    "pickled.safetensors": "not opened",
    "empty.safetensors": "too short",
    "notes.safetensors": "no valid safetensors header",
    "truncated.safetensors": "truncated",
    "nan_alpha.safetensors": "not a finite number",
    "checkpoint.safetensors": "no LoRA weights",
    "bad_json.safetensors": "not valid JSON",
    "pattern_list.safetensors": "alpha_pattern is a list",
    "pattern_regex.safetensors": "not a valid regular expression",
    "rslora_text.safetensors": "use_rslora = 'maybe' is not a boolean",
    "deep_config.safetensors": "nested too deeply",
    "te_only.safetensors": "only text-encoder weights",
    "meta_list.safetensors": "'__metadata__' must map names to strings",
    "meta_number.safetensors": "value for 'ss_network_alpha' is a int",
    "deep_json.safetensors": "nests JSON too deep",
    "bad_dtype.safetensors": "dtype 'F128'",
    "bad_shape.safetensors": "needs 32 bytes, its offsets span 16",
    "bad_offsets.safetensors": "data_offsets",
    "overlap.safetensors": "overlap in the file",
}


def _raw(header: dict | bytes, data: bytes) -> bytes:
    """A safetensors file written by hand (a header the safetensors library would refuse to write)."""
    hdr = header if isinstance(header, bytes) else json.dumps(header).encode()
    hdr += b" " * ((-len(hdr)) % 8)
    return struct.pack("<Q", len(hdr)) + hdr + data


def write_bad_files(loras, prefix: str = "") -> None:
    lora = {"a.lora_down.weight": torch.zeros(2, 8), "a.lora_up.weight": torch.zeros(8, 2)}
    torch.save({"x": torch.zeros(1)}, loras / f"{prefix}pickled.safetensors")  # a zip pickle; never opened
    (loras / f"{prefix}empty.safetensors").write_bytes(b"")
    (loras / f"{prefix}notes.safetensors").write_text("this is a text file, not an adapter\n")
    save_file(lora, str(loras / f"{prefix}whole.safetensors"))
    data = (loras / f"{prefix}whole.safetensors").read_bytes()
    (loras / f"{prefix}truncated.safetensors").write_bytes(data[: len(data) - 16])
    save_file(lora, str(loras / f"{prefix}nan_alpha.safetensors"),
              metadata={"adapter_config": json.dumps({"lora_alpha": float("nan"), "r": 2})})
    save_file({"model.embed.weight": torch.zeros(4, 4)}, str(loras / f"{prefix}checkpoint.safetensors"))
    hdr = json.dumps({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (loras / f"{prefix}bad_json.safetensors").write_bytes(struct.pack("<Q", len(hdr)) + hdr[:-1] + b"!" + b"\0" * 4)
    for name, cfg in (("pattern_list", {"r": 2, "alpha_pattern": ["a", 1]}),
                      ("pattern_regex", {"r": 2, "alpha_pattern": {"a.[0": 1}}),
                      ("rslora_text", {"r": 2, "lora_alpha": 2, "use_rslora": "maybe"})):
        save_file(lora, str(loras / f"{prefix}{name}.safetensors"), metadata={"adapter_config": json.dumps(cfg)})
    save_file(lora, str(loras / f"{prefix}deep_config.safetensors"),
              metadata={"adapter_config": "[" * 100_000 + "]" * 100_000})
    save_file({"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(2, 8),
               "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.zeros(8, 2)},
              str(loras / f"{prefix}te_only.safetensors"))
    down = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    up = {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 32]}
    pair = {"a.lora_down.weight": down, "a.lora_up.weight": up}
    for name, header, data in (
        ("meta_list", {"__metadata__": ["ss_network_alpha", "4"], **pair}, bytes(32)),
        ("meta_number", {"__metadata__": {"ss_network_alpha": 4}, **pair}, bytes(32)),
        ("deep_json", b'{"__metadata__": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", b""),
        ("bad_dtype", {"a.lora_down.weight": {**down, "dtype": "F128"}, "a.lora_up.weight": up}, bytes(32)),
        ("bad_shape", {"a.lora_down.weight": {**down, "shape": [2, 4]}, "a.lora_up.weight": up}, bytes(32)),
        ("bad_offsets", {"a.lora_down.weight": {**down, "data_offsets": [16, 0]}, "a.lora_up.weight": up}, bytes(32)),
        ("overlap", {"a.lora_down.weight": down, "a.lora_up.weight": {**up, "data_offsets": [8, 24]}}, bytes(32)),
    ):
        (loras / f"{prefix}{name}.safetensors").write_bytes(_raw(header, data))


def rewrite_data_in_place(path, value: float = 0.25) -> None:
    """Overwrite every tensor byte of a safetensors file in place (same inode, same size)
    with float32 `value`: what a trainer saving to the same name does to a mapping."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        size = os.fstat(f.fileno()).st_size
        f.seek(8 + n)
        f.write(struct.pack("<f", value) * ((size - 8 - n) // 4))
        f.flush()
        os.fsync(f.fileno())
