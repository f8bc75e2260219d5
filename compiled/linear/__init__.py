"""The linear custom ops (bias-free linear, with the residual add + RMSNorm or SiLU-and-mul before it,
LoRA as optional operands; silu_and_mul; multi-LoRA shrink / expand), their Triton kernels."""

SKINNY_MAX_M = 16  # rows the skinny kernel serves (one 16-row tile); above, cuBLAS is at home
# A weight of at most NARROW_MAX_N rows (the MoE router) takes the skinny kernel up to NARROW_MAX_M
# rows, in tiles of up to 32: cuBLAS gives its few output columns a handful of tiles that walk all of
# K in turn, and ends the dependent launches' overlap (PDL). (H200, the 30B's router with its norm:
# faster at 32 and 48-64 rows in the decode step, bench/RESULTS.md.)
NARROW_MAX_N = 128
NARROW_MAX_M = 64
# FP8 linears of up to this many rows (decode batches, memory-bound) run the W8A16 kernel, which
# reads the FP8 bytes; above (prefill, compute-bound) cuBLAS's W8A8 GEMM (`fp8_cublas`), or the
# dequantized weight where it does not apply.
W8A16_MAX_M = 256
LORA_MAX_SLICES = 4  # slices of one fused output the LoRA expand kernel takes (q, k, v: 3)
# The norm kernels add a linear's LoRA delta, or run its shrink, up to this many rows: each row's
# program reads its adapter's B or A (L2 traffic grows with the rows); past decode sizes the tiled
# expand and shrink, which read them once a block, cost less (2,048-token prefill: 40.7 vs 34.3 ms).
NORM_LORA_MAX_T = 64


def max_rows(N: int) -> int:
    """Rows the skinny kernel serves for a weight of N rows."""
    return NARROW_MAX_M if N <= NARROW_MAX_N else SKINNY_MAX_M
