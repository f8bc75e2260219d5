"""The plain torch functions that the model and the ops' references share: RMSNorm, rotary
embeddings, SiLU-and-mul and the residual add + RMSNorm, each rounded as HF rounds it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The traced form of this function is what `passes.base.match_rms_norm` matches: keep the
    two in step."""
    # type_as, not .to(x.dtype): a dtype read would be a getattr node in the traced graph.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.type_as(x)


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, normed): h = x + delta, normed = `rms_norm(h)`."""
    h = x + delta
    return h, rms_norm(h, norm_weight, eps)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over a fused `[..., 2I]` gate/up tensor."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_cos_sin(head_dim: int, theta: float, max_positions: int, device=None) -> torch.Tensor:
    """[max_positions, head_dim] table: cos in the first half, sin in the second.

    Computed exactly as HF does per step (fp32 inverse frequencies times fp32 positions), so
    looking positions up in it gives bit-identical values."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float, device=device)[:, None] * inv_freq
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def apply_rope(cos_sin: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
               k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[T, Hq, D]`, k `[T, Hkv, D]` rotated by the table rows of `positions` `[T]` (cos and sin
    rounded to q's dtype first, each product and the sum rounded: HF's order of operations)."""
    cos, sin = cos_sin[positions].type_as(q).chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
