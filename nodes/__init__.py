"""ComfyUI nodes of the pack (thin: they record intent and call lora_runtime)."""
from .lora_nodes import NODE_CLASS_MAPPINGS as _LORA, NODE_DISPLAY_NAME_MAPPINGS as _LORA_NAMES
from .stack_node import NODE_CLASS_MAPPINGS as _STACK, NODE_DISPLAY_NAME_MAPPINGS as _STACK_NAMES
from .tiny_nodes import NODE_CLASS_MAPPINGS as _TINY, NODE_DISPLAY_NAME_MAPPINGS as _TINY_NAMES

NODE_CLASS_MAPPINGS = {**_LORA, **_STACK, **_TINY}
NODE_DISPLAY_NAME_MAPPINGS = {**_LORA_NAMES, **_STACK_NAMES, **_TINY_NAMES}
