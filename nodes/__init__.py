"""ComfyUI nodes of the pack (thin: they record intent and call lora_runtime)."""
from .lora_nodes import NODE_CLASS_MAPPINGS as _LORA, NODE_DISPLAY_NAME_MAPPINGS as _LORA_NAMES

NODE_CLASS_MAPPINGS = dict(_LORA)
NODE_DISPLAY_NAME_MAPPINGS = dict(_LORA_NAMES)
