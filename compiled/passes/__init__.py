"""Graph passes over the traced model (fusions, LoRA deltas, parallelism).

Empty until the graph-pass issue lands."""
