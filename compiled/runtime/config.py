"""Engine settings: the one place that holds limits and defaults of the runtime."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_num_seqs: int = 256
    # Token budget of one step; longer prompts are prefilled in chunks of at most this many.
    max_num_batched_tokens: int = 8192
    # Explicit KV budget in tokens; when None it is sized from memory (see runtime/memory.py).
    kv_cache_tokens: int | None = None
    # Fraction of the GPU's memory the engine may use in all (weights + KV + activations).
    mem_fraction: float = 0.9
    # Without a GPU there is no "memory left" to measure; this many bytes go to the KV cache.
    cpu_kv_cache_bytes: int = 2 << 30
    # Prompt-logprob rows are pushed through the LM head this many at a time to bound memory.
    logits_chunk: int = 1024
    seed: int = 0
    # Eager torch modules only: no Inductor, no CUDA graphs (debugging).
    enforce_eager: bool = False
    # Lower the pieces with Inductor; None means on CUDA only (CPU compiles are slow to start).
    compile: bool | None = None
    # Decode CUDA-graph buckets; None means default_buckets(min(max_num_seqs, 256)).
    cuda_graph_buckets: list[int] | None = None
    # Token buckets of the piecewise CUDA graphs for prefill and mixed batches (compiled model
    # only); None means 16, 32, 64, ... up to min(max_piecewise_tokens, max_num_batched_tokens).
    piecewise_buckets: list[int] | None = None
    max_piecewise_tokens: int = 2048
    # Launch a decode step before the previous step's tokens are read back (see engine.py).
    overlap_schedule: bool = True

    @property
    def use_compile(self) -> bool:
        if self.enforce_eager:
            return False
        return self.device.type == "cuda" if self.compile is None else self.compile

    @property
    def use_cuda_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.enforce_eager


def smallest_bucket(buckets: list[int], size: int) -> int | None:
    """The bucket a batch of `size` is padded to: the smallest of the sorted `buckets` >= size."""
    return next((b for b in buckets if b >= size), None)


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} requested but CUDA is not available")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (choose from {', '.join(DTYPES)})")
    return DTYPES[dtype]
