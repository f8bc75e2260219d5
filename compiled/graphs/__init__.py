"""Model definitions in plain, HF-shaped torch (Qwen3 dense and Qwen3-MoE).

Owns the model config and module tree, and the ops the passes put in place of its modules
(`activation`: silu_and_mul; `linear`: the bias-free linear with its skinny Triton GEMM for
decode; `fused_linear`: that linear with the residual add + RMSNorm or SiLU-and-mul before it);
data-dependent work is delegated to custom ops in attention/ and moe/."""
