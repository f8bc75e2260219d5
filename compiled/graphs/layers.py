"""Building blocks shared by the Qwen3 models: the RMSNorm and rotary-embedding modules (their
arithmetic is `compiled.functional`, which the ops' references share)."""

from __future__ import annotations

import torch
from torch import nn

from compiled.functional import apply_rope, rms_norm, rope_cos_sin


class RMSNorm(nn.Module):
    """RMSNorm with fp32 statistics, cast back before the weight (HF's order)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


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
