"""Mixture-of-experts custom ops: softmax-top-k routing and the fused experts (expert LoRA as optional
operands), their Triton kernels for CUDA and their torch references."""
