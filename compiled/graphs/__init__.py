"""The plain, HF-shaped torch models (Qwen3 dense and Qwen3-MoE): model config, module tree,
weight map and the tracer; the ops they call live in attention/, moe/ and linear/."""
