"""comfyui-lora-runtime: a ComfyUI custom-node pack (this folder) and a Python package
(`comfyui_lora_runtime`). Exact and fast LoRA adapters on diffusion transformers."""
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = "./web"
__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
