"""Model definitions in plain, HF-shaped torch (Qwen3 dense and Qwen3-MoE).

Owns the model config and module tree; data-dependent work is delegated to custom ops in attention/ and moe/."""
