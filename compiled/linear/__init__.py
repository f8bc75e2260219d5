"""The linear custom ops (bias-free linear; with the residual add + RMSNorm or SiLU-and-mul before it;
silu_and_mul alone; multi-LoRA shrink / expand), their Triton kernels (skinny GEMM, prologues, LoRA)."""

SKINNY_MAX_M = 16  # rows the skinny kernel serves (one 16-row tile); above, cuBLAS is at home
LORA_MAX_SLICES = 4  # slices of one fused output the LoRA expand kernel takes (q, k, v: 3)
