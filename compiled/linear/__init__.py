"""The linear custom ops (bias-free linear; with the residual add + RMSNorm or SiLU-and-mul before
it; silu_and_mul alone), their skinny Triton GEMM for decode and their prologue kernels."""

SKINNY_MAX_M = 16  # rows the skinny kernel serves (one 16-row tile); above, cuBLAS is at home
