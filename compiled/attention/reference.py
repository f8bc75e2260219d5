"""Torch reference attention over the paged KV cache (the CPU path and the kernels' oracle)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from compiled.functional import apply_rope, rms_norm


class NormRope(NamedTuple):
    """What the attention op needs to apply Qwen3's per-head RMSNorm and RoPE to the raw q/k
    itself (the fuse_qk_norm_rope pass): the two norm weights `[D]`, the step's positions `[T]`,
    the RoPE table `[max_positions, D]` (cos half, sin half, fp32) and the norms' epsilon."""
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    eps: float


def norm_rope_ref(q: torch.Tensor, k: torch.Tensor, rope: NormRope) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own layers: RMSNorm over each head, then RoPE (the fused kernels' oracle)."""
    return apply_rope(rope.cos_sin, rope.positions, rms_norm(q, rope.q_weight, rope.eps),
                      rms_norm(k, rope.k_weight, rope.eps))


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Write new tokens' K/V `[T, kv_heads, head_dim]` into their pool slots."""
    k_cache[loc] = k.to(k_cache.dtype)
    v_cache[loc] = v.to(v_cache.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [..., Hq, Lq, D], k/v [..., Hkv, Lk, D], mask broadcastable to scores (True = keep).

    Scores and softmax in fp32; each KV head serves its group of query heads."""
    group = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(group, dim=-3)
    v = v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


def extend_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: list[int],
                         seq_lens: list[int], extend_lens: list[int], scale: float) -> torch.Tensor:
    """New tokens of many requests (q `[T, Hq, D]`, packed request after request) attend causally
    to themselves and to their cached prefix; K/V of the new tokens must already be stored."""
    out = torch.empty_like(q)
    start = 0
    for row, seq_len, ext in zip(req_pool_indices, seq_lens, extend_lens):
        slots = req_to_token[row, :seq_len].long()
        k = k_cache[slots].transpose(0, 1)          # [Hkv, S, D]
        v = v_cache[slots].transpose(0, 1)
        qi = q[start:start + ext].transpose(0, 1)   # [Hq, E, D]
        q_pos = torch.arange(seq_len - ext, seq_len, device=q.device)[:, None]
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos
        out[start:start + ext] = _attend(qi, k, v, mask, scale).transpose(0, 1)
        start += ext
    return out


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         seq_lens: torch.Tensor, max_seq_len: int, scale: float) -> torch.Tensor:
    """One query token per request (q `[B, Hq, D]`) over its cached tokens; vectorised over the
    batch by gathering every request's slots up to `max_seq_len` and masking the tail."""
    slots = req_to_token[req_pool_indices.long(), :max_seq_len].long()   # [B, L]
    k = k_cache[slots].permute(0, 2, 1, 3)                                 # [B, Hkv, L, D]
    v = v_cache[slots].permute(0, 2, 1, 3)
    mask = torch.arange(max_seq_len, device=q.device)[None, :] < seq_lens[:, None].to(q.device)
    out = _attend(q.unsqueeze(2), k, v, mask[:, None, None, :], scale)   # [B, Hq, 1, D]
    return out.squeeze(2)
