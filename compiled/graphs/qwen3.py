"""Qwen3 and Qwen3-MoE in plain torch, shaped like HF so checkpoint names map one to one.

Inputs are flat over the batch's tokens (`[T]` ids and positions); everything that depends on
the batch's structure (the KV cache, expert routing) goes through custom ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import compiled.attention.ops  # noqa: F401  (registers compiled::attention)
import compiled.moe.experts  # noqa: F401  (registers compiled::moe_experts)
import compiled.moe.routing  # noqa: F401  (registers compiled::topk_route)
from compiled.graphs.config import ModelConfig
from compiled.graphs.layers import RMSNorm, RotaryEmbedding
from compiled.graphs.weights import Piece, WeightMap


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        q = self.q_norm(self.q_proj(x).view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        out = torch.ops.compiled.attention(q, k, v, self.layer, self.scale)
        return self.o_proj(out.view(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Every expert's gate/up/down weight, stacked per projection (`[E, I, H]`, `[E, I, H]`,
    `[E, H, I]`), so a 128-expert layer is three parameters rather than 384 modules; the
    checkpoint's per-expert tensors map onto slices of them (see `checkpoint_map`)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        def stack(rows: int, cols: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(num_experts, rows, cols), requires_grad=False)
        self.gate_proj = stack(intermediate, hidden)
        self.up_proj = stack(intermediate, hidden)
        self.down_proj = stack(hidden, intermediate)


class SparseMoE(nn.Module):
    """Router (`gate`) plus the experts, computed by one custom op."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = torch.ops.compiled.topk_route(self.gate(x), self.top_k, self.renormalize)
        e = self.experts
        return torch.ops.compiled.moe_experts(x, weights, ids, e.gate_proj, e.up_proj, e.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rotary_emb)
        return self.norm(x)


class Qwen3ForCausalLM(nn.Module):
    """Dense and MoE Qwen3 alike: the config decides which layers are sparse.

    `forward` returns final hidden states `[T, H]`; the runner applies `lm_head` only to the
    rows that need logits, so prefill does not pay for logits it throws away."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def checkpoint_map(self) -> WeightMap:
        """Parameter -> checkpoint tensors: one to one, except stacked experts whose slice e
        is the checkpoint's `experts.{e}.<proj>.weight`."""
        shapes = {n: tuple(p.shape) for n, p in self.named_parameters()}
        stacked = {n: s for n, s in shapes.items() if ".mlp.experts." in n}
        weights = WeightMap.identity({n: s for n, s in shapes.items() if n not in stacked})
        for name, (num, rows, cols) in stacked.items():
            owner, _, proj = name.rpartition(".")
            weights.pieces[name] = [Piece(f"{owner}.{e}.{proj}.weight", (rows, cols), expert=e) for e in range(num)]
        return weights

