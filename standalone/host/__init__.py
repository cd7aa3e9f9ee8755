"""The bundled host: the subset of ComfyUI's API the pack uses, so its workflows
run with no ComfyUI installed (CLI, tests, benchmarks).

Modules: folder_paths (model folders), options (launch options given per run:
the weight dtype), model_patcher (MODEL), progress (progress
bar, interruption), core_nodes (ComfyUI core node types), validation / prompt_graph /
executor (check, order and run API-format prompts), workflow_format (UI <-> API format),
png_metadata (prompt/workflow PNG chunks), wan21 / sampling / latent_format (the model and
sampler), quant_formats / quant_ops / quant_checkpoints (quantized layers and files). Nothing is imported here eagerly: torch-free users (e.g. the workflow
converter) stay light.
"""
