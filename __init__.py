"""comfyui-lora-runtime: a ComfyUI custom-node pack (the repo root) and a Python
package (`comfyui_lora_runtime`). Node registration is filled in by nodes/."""
NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}
WEB_DIRECTORY = "./web"
__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
