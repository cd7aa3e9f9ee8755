"""What the pack imports when the host loads its nodes, so that no sampling pays it."""
from __future__ import annotations

import subprocess
import sys


def test_the_fusion_sites_and_kernels_load_with_the_nodes():
    """Loading the node modules imports the fusion sites and the kernels' modules (the first sampling
    with an adapter mounts them: in real ComfyUI that import cost the first sampling ~25 ms). Wrong
    answer: importing them only when a sampling runs."""
    code = ("import sys, comfyui_lora_runtime.nodes.lora_nodes; "
            "print(all(m in sys.modules for m in ('comfyui_lora_runtime.lora_runtime.fusion.fusion_sites', "
            "'comfyui_lora_runtime.kernels.lora_linear', 'comfyui_lora_runtime.kernels.linear_gelu_tanh')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
