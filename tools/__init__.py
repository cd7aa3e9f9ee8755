"""Maintainer scripts, importable as modules (``comfyui_lora_runtime.tools.make_workflows``) and
runnable as ``python tools/<name>.py``: the saved workflows and the embedded model's training."""
