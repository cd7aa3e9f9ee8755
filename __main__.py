"""`python -m comfyui_lora_runtime`: the command line without ComfyUI (run a workflow, the
main job). The code is in standalone/cli.py; this file is where `python -m` looks for it."""
import sys

from .standalone.cli import main

if __name__ == "__main__":
    sys.exit(main())
