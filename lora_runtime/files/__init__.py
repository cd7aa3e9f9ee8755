"""Reading adapter files: bytes (safetensors only), key names, dialects, scale sources, and
`adapter` (load, validate, match to a model). The first stage of docs/engine.md's flow."""
