"""The `compiled::attention` custom op: stores the step's K/V and attends over the cache.

Opaque to tracing (its fake returns a tensor shaped like q), so the model graph has one node per
layer and the compile backend can split there."""

from __future__ import annotations

import torch

from compiled.attention.context import get_forward_context
from compiled.attention.reference import decode_attention_ref, extend_attention_ref, store_kv


@torch.library.custom_op("compiled::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """q `[T, Hq, D]`, k/v `[T, Hkv, D]` for the step's new tokens -> `[T, Hq, D]`."""
    ctx = get_forward_context()
    meta, k_cache, v_cache = ctx.meta, ctx.kv.k[layer], ctx.kv.v[layer]
    store_kv(k_cache, v_cache, meta.out_cache_loc, k, v)
    if meta.is_decode:
        return decode_attention_ref(q, k_cache, v_cache, ctx.req_to_token, meta.req_pool_indices,
                                    meta.seq_lens, meta.max_seq_len, scale)
    return extend_attention_ref(q, k_cache, v_cache, ctx.req_to_token, meta.req_pool_indices_cpu,
                                meta.seq_lens_cpu, meta.extend_lens_cpu, scale)


@attention.register_fake
def _(q, k, v, layer, scale):
    return torch.empty_like(q)
