"""GGUF files of a safetensors model, written with the ``gguf`` package in ComfyUI's python (the
GGUF real-ComfyUI tests and bench/bench_rerun.py load them with ComfyUI-GGUF's UnetLoaderGGUF).

`write_gguf(python, src, dst, qtype)` runs `CONVERT_SOURCE`: 2-D weights of at least 1024
elements as F16, or quantized to `qtype` (a ``gguf.GGMLQuantizationType`` name: BF16, Q8_0, ...);
everything else F32; a 5-D kernel stored 2-D with ComfyUI-GGUF's ``comfy.gguf.orig_shape`` field.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

# run with ComfyUI's python: convert a safetensors model to GGUF with the gguf package
CONVERT_SOURCE = r'''
import sys
import gguf
import numpy as np
import torch
from safetensors.torch import load_file

src, dst, qtype = sys.argv[1:4]
Q = gguf.GGMLQuantizationType
w = gguf.GGUFWriter(dst, arch="wan")
for name, t in load_file(src).items():
    a = t.float().numpy()
    if a.ndim > 4:  # GGUF holds at most 4 dims: store 2-D, the real shape in ComfyUI-GGUF's field
        w.add_array(f"comfy.gguf.orig_shape.{name}", [int(s) for s in a.shape])
        a = a.reshape(a.shape[0], -1)
    if t.dim() != 2 or a.size < 1024:
        w.add_tensor(name, a.astype(np.float32))
    elif qtype == "F16":
        w.add_tensor(name, a.astype(np.float16))
    else:
        qt = Q[qtype]
        w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
'''


def write_gguf(python: str, src: Path, dst: Path, qtype: str) -> None:
    """`src` (safetensors) -> `dst` (GGUF, `qtype`) with `python` (one that has ``gguf``)."""
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([python, "-c", CONVERT_SOURCE, str(src), str(dst), qtype], capture_output=True, text=True)
    assert r.returncode == 0, f"conversion to {qtype} failed:\n{r.stderr[-3000:]}"
