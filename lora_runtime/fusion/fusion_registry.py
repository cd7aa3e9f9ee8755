"""Every fusion the pack can mount, registered once, with the side it picked.

A fusion reads weights itself instead of calling the layer, so it can silently
drop an unmerged adapter (a fused GEMM that reads ``proj.weight`` multiplies the
base weight only). Each fusion therefore declares, at registration:

- ``min_tier``: the lowest quality tier that admits it;
- ``op``: the kernel op it runs (kernels.registry); each of the op's backends is
  one implementation of the fusion, and the registry test runs every one of them;
- ``tested_with_dynamic_adapter=True``: the generic registry test
  (tests/lora_runtime/fusion/test_fusion_registry.py) mounts it alone on a site whose linears
  carry a dynamic adapter and requires the output to equal the unfused forward
  within the tier *and* differ from the base-weight-only output; or
- ``cannot_drop_reason``: a written reason why it cannot drop an adapter's output.

Registering a fusion that picks neither side raises; the registry test fails too.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..settings import Tier


@dataclass(frozen=True)
class Fusion:
    name: str
    min_tier: Tier
    description: str
    op: str = ""
    tested_with_dynamic_adapter: bool = False
    cannot_drop_reason: str = ""


FUSIONS: dict[str, Fusion] = {}


def register(fusion: Fusion) -> Fusion:
    if fusion.name in FUSIONS:
        raise ValueError(f"fusion {fusion.name!r} is registered twice")
    if not fusion.tested_with_dynamic_adapter and len(fusion.cannot_drop_reason.strip()) < 20:
        raise ValueError(
            f"fusion {fusion.name!r} must pick a side: run it on a site with a dynamic adapter "
            "(tested_with_dynamic_adapter=True) or state why it cannot drop an adapter's output"
        )
    if not fusion.op:
        raise ValueError(f"fusion {fusion.name!r} names no kernel op")
    FUSIONS[fusion.name] = fusion
    return fusion


LINEAR_GELU_TANH = register(Fusion(
    "linear_gelu_tanh", Tier.LOSSLESS,
    "GEMM + bias + GELU(tanh) epilogue on the fp32 accumulator; taken only when the first "
    "linear adds no adapter output now (no wrapper, disabled, or merged without offset)",
    op="linear_gelu_tanh",
    tested_with_dynamic_adapter=True,
))

LORA_LINEAR_GELU_TANH = register(Fusion(
    "lora_linear_gelu_tanh", Tier.LOSSLESS,
    "the same GEMM with the stacked LoRA delta of the live adapters expanded in the epilogue "
    "(h = x A^T * scale summed into the base GEMM: epilogue expand, K-concatenation or "
    "delta first, by backend) before bias and GELU",
    op="lora_linear",
    tested_with_dynamic_adapter=True,
))
