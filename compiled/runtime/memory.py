"""Sizing the KV cache from the memory that is left after the weights."""

from __future__ import annotations

import torch

from compiled.attention.kv_cache import kv_slots_for_memory
from compiled.graphs.config import ModelConfig
from compiled.parallel.tensor import local_kv_heads
from compiled.runtime.config import EngineConfig, kv_cache_too_small


def activation_bytes(mcfg: ModelConfig, cfg: EngineConfig) -> int:
    """A generous bound on one step's transient tensors at the full token budget."""
    t = cfg.max_num_batched_tokens
    mlp = max(mcfg.intermediate_size, mcfg.num_experts_per_tok * mcfg.moe_intermediate_size)
    per_token = 8 * mcfg.hidden_size + 3 * mlp + 2 * (mcfg.q_size + 2 * mcfg.kv_size)
    logits = min(t, cfg.logits_chunk) * mcfg.vocab_size * 4 * 2
    graph_logits = cfg.max_num_seqs * mcfg.vocab_size * 4  # the decode graphs' static fp32 logits
    return t * per_token * 4 + logits + graph_logits


def num_kv_slots(mcfg: ModelConfig, cfg: EngineConfig) -> int:
    """KV cache size in tokens: `kv_cache_tokens`, else what the memory budget holds. Like vLLM,
    start-up refuses a cache that cannot hold one `max_model_len` sequence: such an engine would
    cut long requests short with finish reason "length", or never admit a long prompt."""
    if cfg.kv_cache_tokens is not None:
        slots = cfg.kv_cache_tokens
        where, fix = f"kv_cache_tokens={slots}", f"raise kv_cache_tokens to at least {cfg.max_model_len}"
    else:
        per_token = mcfg.kv_bytes_per_token * torch.empty((), dtype=cfg.dtype).element_size() \
            * local_kv_heads(mcfg, cfg.tensor_parallel_size) // mcfg.num_key_value_heads   # this rank's heads
        cap = cfg.max_num_seqs * cfg.max_model_len  # more slots than every row can hold are useless
        if cfg.device.type != "cuda":
            slots = min(kv_slots_for_memory(cfg.cpu_kv_cache_bytes, per_token), cap)
            where = f"cpu_kv_cache_bytes={cfg.cpu_kv_cache_bytes}"
            fix = "raise cpu_kv_cache_bytes or kv_cache_tokens"
        else:
            free, total = torch.cuda.mem_get_info(cfg.device)
            budget = cfg.mem_fraction * total - (total - free) - activation_bytes(mcfg, cfg)
            slots = min(kv_slots_for_memory(budget, per_token), cap)
            where = f"mem_fraction={cfg.mem_fraction} of the GPU after the weights and activations"
            fix = "raise mem_fraction, lower max_num_batched_tokens"
    if slots < cfg.max_model_len:
        raise kv_cache_too_small(slots, cfg.max_model_len, where, fix)
    return slots
