"""Graph passes over the traced model: each a small function doing one rewrite (fusions now; LoRA
deltas and parallelism later), run in order by `manager.run_passes` (REGISTRY, DEFAULT_PASSES)."""
