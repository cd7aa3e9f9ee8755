"""Quantized checkpoints in ComfyUI 0.33's format, written by the ComfyUI under test itself
(test_quantized_real.py, bench_quantized_comfy.py): a Wan model's block linears quantized per
format.

`write_quantized_checkpoints` runs `CONVERT_SOURCE` with ComfyUI's own python in its checkout
(so ``comfy.quant_ops`` and the comfy-kitchen that server uses make the bytes). Per format it
writes two files:

- ``tiny_wan_<format>.safetensors``: every tensor of the source file as it is (bf16), except
  the given block linears (default: the reference tiny Wan's 20, ``blocks.N.self_attn.{q,k,v,o}``,
  ``blocks.N.cross_attn.{q,k,v,o}``, ``blocks.N.ffn.0``, ``blocks.N.ffn.2``), each stored as
  ComfyUI 0.33 loads it (``comfy/ops.py`` ``_load_quantized_module``): ``<layer>.weight`` (the
  quantized data), its scales under the layout's own state_dict names (fp8 / int8:
  ``weight_scale``, the fp32 per-tensor scale; mxfp8: ``weight_scale``, the e8m0 block scales;
  nvfp4: ``weight_scale`` e4m3 block scales and ``weight_scale_2`` fp32; convrot_w4a4:
  ``weight_scale``, fp32 per row of the rotated int4 weight; asym_w4a8_int8: ``weight_s_rel``
  e4m3 per 16-column group, ``weight_s_channel`` fp32 per row, ``weight_codebook``, 16 fp32
  levels), ``<layer>.comfy_quant`` (uint8 bytes of the JSON ComfyUI's own state_dict writes:
  ``{"format": ...}``, plus ``convrot_groupsize`` for convrot_w4a4 and ``group_size`` /
  ``convrot_groupsize`` for asym_w4a8_int8); the bias plain. The data is
  ``QuantizedTensor.from_float(W in fp32, <the format's layout>, scale="recalculate" for the
  per-tensor formats)``, the layouts' default options: round to nearest, as a checkpoint
  quantizer would (no stochastic rounding).
- `LEGACY` ("scaled_fp8"): the older scaled-fp8 file ComfyUI 0.33 still reads: a top-level
  ``scaled_fp8`` marker (an empty float8_e4m3fn tensor: fp8 matrix multiplication allowed), per
  layer ``<layer>.weight`` float8_e4m3fn and ``<layer>.scale_weight`` (fp32 per-tensor scale), no
  ``comfy_quant``. ComfyUI converts it at load (``comfy.utils.convert_old_quants``) into
  float8_e4m3fn ``comfy_quant`` layers; the bytes are the float8_e4m3fn file's.
- ``tiny_wan_<format>_ideal.safetensors``: the same model in fp32 with each quantized linear's
  weight replaced by its dequantized value (fp32): the "ideal float" model, whose every layer
  computes with exactly the values the quantized file holds, without activation quantization
  or re-quantization. The dequantized value is read back the way ComfyUI loads the file
  (a legacy file's keys through ``convert_old_quants`` first): a ``mixed_precision_ops`` Linear
  (compute dtype fp32) loads the layer's keys, then ``weight.dequantize()``; it is checked
  equal to the ``from_float`` tensor's own dequantization.

Widths: the reference d128 model fits fp8 / int8 (per tensor), mxfp8 (multiples of 32 on both
sides) and nvfp4 (16). The 4-bit `WIDE_FORMATS` rotate groups of 256 input columns (a regular
Hadamard of size 256) and need every in_features to be a multiple of 256: their source is
`testkit.random_wan` at d256 (ffn 1024).

A ComfyUI without ``comfy/quant_ops.py`` (0.3.x; verified on 0.3.64, where these files load with
the scales dropped as unexpected keys, fp8 / int8 codes taken as weights, and nvfp4 fails
with a size mismatch) gets nothing written: `write_quantized_checkpoints` returns the reason.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

FORMATS = ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise", "mxfp8", "nvfp4")
LEGACY = "scaled_fp8"   # ComfyUI's older scaled-fp8 file; loads as float8_e4m3fn
WIDE_FORMATS = ("convrot_w4a4", "asym_w4a8_int8")   # in_features a multiple of 256
WIDE_DIMS = (256, 1024)   # dim, ffn of the random Wan the WIDE_FORMATS are written from
BLOCKS = 2
LINEARS = tuple([f"blocks.{b}.{a}.{p}" for b in range(BLOCKS) for a in ("self_attn", "cross_attn") for p in "qkvo"]
                + [f"blocks.{b}.ffn.{i}" for b in range(BLOCKS) for i in (0, 2)])


def quantized_name(fmt: str) -> str:
    return f"tiny_wan_{fmt}.safetensors"


def ideal_name(fmt: str) -> str:
    return f"tiny_wan_{fmt}_ideal.safetensors"


# run with ComfyUI's python, cwd = the ComfyUI checkout:
#   python -c CONVERT_SOURCE <reference model> <out dir> <format>[,<format>...] <layer>[,<layer>...]
# (a format is a QUANT_ALGOS name or LEGACY); prints one JSON line: {"unsupported": why} or
# {"version", "formats": {format: info or {"skipped": why}}}
CONVERT_SOURCE = r'''
import json, os, sys
sys.path.insert(0, os.getcwd())
src, out_dir, fmts, layers = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4].split(",")
try:
    version = open("comfyui_version.py").read().split('"')[1]
except Exception:
    version = "unknown"
from comfy.cli_args import args
args.cpu = True  # a CUDA torch build on a machine without a driver: CPU before comfy.model_management loads
try:
    import comfy.quant_ops
    from comfy.quant_ops import QUANT_ALGOS, QuantizedTensor
    import comfy.ops
    import comfy.utils
    comfy.ops.mixed_precision_ops
    comfy.utils.convert_old_quants
except (ImportError, AttributeError) as e:
    print(json.dumps({"unsupported": f"ComfyUI {version} has no quantized-checkpoint support "
                      f"(comfy.quant_ops / comfy.ops.mixed_precision_ops: {type(e).__name__}: {e}); "
                      "checkpoints with comfy_quant layers load on ComfyUI 0.33+ only"}))
    sys.exit(0)
import torch
from safetensors.torch import load_file, save_file

sd = load_file(src)
report = {"version": version, "formats": {}}
LEGACY = "scaled_fp8"
PER_TENSOR = ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise")
marker = torch.empty(0, dtype=torch.float8_e4m3fn)
for fmt in fmts:
    qfmt = "float8_e4m3fn" if fmt == LEGACY else fmt
    if qfmt not in QUANT_ALGOS:
        report["formats"][fmt] = {"skipped": f"{qfmt!r} is not in this ComfyUI's QUANT_ALGOS "
                                             f"({sorted(QUANT_ALGOS)}; mxfp8 needs a comfy-kitchen with MXFP8)"}
        continue
    layout = QUANT_ALGOS[qfmt]["comfy_tensor_layout"]
    ops = comfy.ops.mixed_precision_ops({}, compute_dtype=torch.float32, disabled=set())
    qsd = dict(sd)
    ideal = {k: v.float() for k, v in sd.items()}
    info = {"layout": layout, "layers": {}}
    for n in layers:
        w = sd[f"{n}.weight"].float()
        kw = {"scale": "recalculate"} if qfmt in PER_TENSOR else {}
        qt = QuantizedTensor.from_float(w, layout, **kw)
        part = {k: v.contiguous() for k, v in qt.state_dict(f"{n}.weight").items()}
        conf = {"format": qfmt}
        if qfmt == "convrot_w4a4":   # what ComfyUI's own state_dict writes for these layouts
            conf["convrot_groupsize"] = qt._params.convrot_groupsize
        elif qfmt == "asym_w4a8_int8":
            conf.update(group_size=qt._params.group_size, convrot_groupsize=qt._params.convrot_groupsize)
        if fmt == LEGACY:
            written = {f"{n}.weight": part[f"{n}.weight"], f"{n}.scale_weight": part[f"{n}.weight_scale"]}
            part, _ = comfy.utils.convert_old_quants({**written, "scaled_fp8": marker}, "", {})
            got = json.loads(part[f"{n}.comfy_quant"].numpy().tobytes())
            assert got == conf, (n, got)
        else:
            part[f"{n}.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)
            written = part
        qsd.update(written)
        lin = ops.Linear(w.shape[1], w.shape[0], device="cpu")
        lsd = {k[len(n) + 1:]: v for k, v in part.items()}
        lsd["bias"] = sd[f"{n}.bias"]
        lin.load_state_dict(lsd, strict=True)
        assert isinstance(lin.weight, QuantizedTensor) and lin.weight._layout_cls == layout, (n, type(lin.weight))
        dq = lin.weight.dequantize()
        assert dq.dtype == torch.float32 and tuple(dq.shape) == tuple(w.shape), (n, dq.dtype, dq.shape)
        assert torch.equal(dq, qt.dequantize().float()), f"{n}: the loaded layer dequantizes differently"
        ideal[f"{n}.weight"] = dq.contiguous()
        info["layers"][n] = {"keys": {k[len(n) + 1:]: [list(v.shape), str(v.dtype).replace("torch.", "")]
                                      for k, v in written.items()},
                             "rel_err": float((dq - w).norm() / w.norm())}
    if fmt == LEGACY:
        qsd["scaled_fp8"] = marker
    meta = {"written_by": "comfyui-lora-runtime integration tests", "format": fmt}
    save_file(qsd, os.path.join(out_dir, f"tiny_wan_{fmt}.safetensors"), metadata=meta)
    save_file(ideal, os.path.join(out_dir, f"tiny_wan_{fmt}_ideal.safetensors"), metadata=meta)
    report["formats"][fmt] = info
print(json.dumps(report))
'''


def write_quantized_checkpoints(python: str, comfy_dir: Path, src: Path, out_dir: Path,
                                formats=FORMATS, layers=LINEARS) -> dict:
    """Run the converter with ComfyUI's python in `comfy_dir`; its JSON report (see CONVERT_SOURCE).
    Raises with the converter's stderr when it fails."""
    out_dir.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([python, "-c", CONVERT_SOURCE, str(src), str(out_dir), ",".join(formats), ",".join(layers)],
                       cwd=str(comfy_dir), capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"quantized checkpoint conversion failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n"
                           f"{r.stderr[-4000:]}")
    return json.loads(lines[-1])
