"""Parallelism: context parallelism (the zigzag plan, per-step context, gathers) and tensor
parallelism (shard plans, the group); the process group and the collective ops both use."""
