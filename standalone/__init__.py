"""Everything that runs without ComfyUI: the bundled stand-in host (`host/`), the embedded tiny
model's code (`embedded/`) and weights (`models/`), the main job (`demo.py`) and the command
line (`cli.py`, run as `python -m comfyui_lora_runtime`). Inside ComfyUI only the demo nodes
(the embedded model's helpers) import from here; see docs/layout.md."""
