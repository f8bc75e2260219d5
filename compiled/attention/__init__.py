"""KV cache pools, the forward context and the attention custom op: Triton kernels (K/V store,
flash-decoding, varlen prefill) for CUDA, the torch reference for the CPU and as the oracle."""
