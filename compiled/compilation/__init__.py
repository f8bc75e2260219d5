"""Compilation: the split at the splitting ops, Inductor for the pieces, decode and piecewise CUDA
graphs per bucket, and the artifacts that let a later start skip Inductor."""
