"""Context parallelism: one long prefill split over ranks that all hold the whole model.
The zigzag plan, the per-step context, the collective ops the cp_allgather pass inserts, the group."""
