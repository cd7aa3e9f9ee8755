"""One adapted layer at run time: `wrapper.AdaptedLayer`, the one-rounding `merge`, the per-call
`runtime_context` and the strength `schedule`. Imports nothing from file reading."""
