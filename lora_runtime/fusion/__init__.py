"""Fused forwards: `fusion_sites` (found by structure, guarded, probed) and `fusion_registry`
(what each fusion needs); the kernels are in the pack's `kernels/`."""
