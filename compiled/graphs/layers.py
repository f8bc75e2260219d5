"""Building blocks shared by the Qwen3 models: RMSNorm and rotary embeddings."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm with fp32 statistics, cast back before the weight (HF's order)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The traced form of this function is what `passes.base.match_rms_norm` matches: keep the
    two in step."""
    # type_as, not .to(x.dtype): a dtype read would be a getattr node in the traced graph.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.type_as(x)


def rope_cos_sin(head_dim: int, theta: float, max_positions: int, device=None) -> torch.Tensor:
    """[max_positions, head_dim] table: cos in the first half, sin in the second.

    Computed exactly as HF does per step (fp32 inverse frequencies times fp32 positions), so
    looking positions up in it gives bit-identical values."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float, device=device)[:, None] * inv_freq
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half) over [tokens, heads, head_dim] tensors."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        self.head_dim, self.theta, self.max_positions = head_dim, theta, max_positions
        self.register_buffer("cos_sin", rope_cos_sin(head_dim, theta, max_positions), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the table after the module was materialised from the meta device."""
        self.cos_sin = rope_cos_sin(self.head_dim, self.theta, self.max_positions, self.cos_sin.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(self.cos_sin, positions, q, k)


def apply_rope(cos_sin: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
               k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[T, Hq, D]`, k `[T, Hkv, D]` rotated by the table rows of `positions` `[T]` (cos and sin
    rounded to q's dtype first, each product and the sum rounded: HF's order of operations)."""
    cos, sin = cos_sin[positions].type_as(q).chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
