"""Parallelism: context parallelism (the zigzag plan, per-step context, gathers) and tensor
parallelism (shard plans, the group, the vocab-parallel head); the process group and the collective ops."""
