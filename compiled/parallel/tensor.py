"""Tensor parallelism: which slice of each sharded weight a rank holds, and the group the
all-reduce op reduces over.

The group is a module-level registry rather than a field of the forward context: it is fixed for
the life of the process (unlike a context-parallel step's plan), and every forward must reduce
over it, including the ones that run without the runner's context (warm-up, CUDA-graph captures
and replays, the pass manager's meta checks). `LLM` sets it when it joins the group and clears it
when it leaves; one process holds one tensor-parallel LLM at a time."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from compiled.errors import ConfigError

# Checkpoint projections split along their output rows (column-parallel) or input columns (row-parallel).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class TPGroup:
    group: dist.ProcessGroup | None
    world: int
    rank: int


_group: TPGroup | None = None


def set_tp_group(group: TPGroup | None) -> None:
    """Install (or, with None, clear) the process's tensor-parallel group."""
    global _group
    _group = group


def tp_group() -> TPGroup | None:
    return _group


def tp_rank() -> int:
    """This process's tensor-parallel rank (0 without a group): the ops that differ by rank read
    it at run time, so every rank's graph is the same code."""
    return 0 if _group is None else _group.rank


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `world` holds of a model: attention heads (K/V heads replicated when
    the world exceeds them), dense and expert intermediate widths."""
    world: int
    rank: int
    num_heads: int          # the model's query heads
    num_kv_heads: int
    head_dim: int
    intermediate: int       # dense MLP width (0 when the model has none)
    moe_intermediate: int   # expert width (0 without experts)
    vocab_size: int = 0
    num_experts: int = 0
    expert_parallel: bool = False   # each rank holds num_experts / world whole experts

    @property
    def vocab_rows(self) -> int:
        """The embedding and LM head rows each rank holds: the vocabulary over the world, rounded
        up (the last ranks' rows past the vocabulary are padding that no token id reads)."""
        return -(-self.vocab_size // self.world)

    @property
    def vocab_span(self) -> tuple[int, int]:
        """(first token id, how many real rows) of this rank's vocabulary shard."""
        start = min(self.rank * self.vocab_rows, self.vocab_size)
        return start, min(self.vocab_rows, self.vocab_size - start)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world if self.expert_parallel else self.num_experts

    @property
    def first_expert(self) -> int:
        return self.rank * self.local_experts if self.expert_parallel else 0

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.world

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.world)   # as `local_kv_heads` below

    @property
    def first_head(self) -> int:
        return self.rank * self.local_heads

    @property
    def first_kv_head(self) -> int:
        """This rank's first K/V head: its own share, or the one its query heads read when the
        world exceeds the K/V heads (ranks `r * kv // world` share a head)."""
        if self.world <= self.num_kv_heads:
            return self.rank * self.local_kv_heads
        return self.rank * self.num_kv_heads // self.world

    def span(self, proj: str, expert: bool = False) -> tuple[int, int]:
        """(start, length) of this rank's output rows of column-parallel projection `proj`, or of
        its input columns of a row-parallel one (an expert's when `expert`)."""
        hd = self.head_dim
        if proj in ("q_proj", "o_proj"):
            return self.first_head * hd, self.local_heads * hd
        if proj in ("k_proj", "v_proj"):
            return self.first_kv_head * hd, self.local_kv_heads * hd
        if expert and self.expert_parallel:   # whole experts: every row of the rank's own
            return 0, self.moe_intermediate
        return self.rows(self.moe_intermediate if expert else self.intermediate)

    def rows(self, full: int) -> tuple[int, int]:
        """(start, length) of this rank's share of a dimension of size `full`."""
        share = full // self.world
        return self.rank * share, share


def shard_plan(cfg, world: int, rank: int, expert_parallel: bool = False) -> ShardPlan:
    """The shard plan of model config `cfg` (a `graphs.config.ModelConfig`) at `world` ranks (whole
    experts per rank with `expert_parallel`); what `world` does not divide is a one-line ConfigError."""
    check_divisible(cfg, world, expert_parallel)
    return ShardPlan(world, rank, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                     cfg.intermediate_size, cfg.moe_intermediate_size, cfg.vocab_size,
                     cfg.num_experts if _has_moe(cfg) else 0, expert_parallel and _has_moe(cfg))


def _has_moe(cfg) -> bool:
    return any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def local_kv_heads(cfg, world: int) -> int:
    """The K/V heads each of `world` ranks holds (and caches)."""
    return max(1, cfg.num_key_value_heads // world)


def check_divisible(cfg, world: int, expert_parallel: bool = False) -> None:
    """Heads, K/V heads and widths must split evenly over `world` ranks (K/V heads may instead be
    replicated: `world` a multiple of them); with `expert_parallel`, the experts instead of their
    width. The vocabulary need not divide (its shards are padded)."""
    def need(what: str, value: int) -> None:
        if value % world:
            raise ConfigError(f"tensor_parallel_size={world} does not divide {what}={value}")
    need("num_attention_heads", cfg.num_attention_heads)
    kv = cfg.num_key_value_heads
    if kv % world and world % kv:
        raise ConfigError(f"tensor_parallel_size={world}: num_key_value_heads={kv} must divide it or be divisible "
                          f"by it")
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        need("intermediate_size", cfg.intermediate_size)
    if _has_moe(cfg) and expert_parallel:
        if cfg.num_experts % world:
            raise ConfigError(f"tensor_parallel_size={world} with enable_expert_parallel does not divide "
                              f"num_experts={cfg.num_experts}")
    elif _has_moe(cfg):
        need("moe_intermediate_size", cfg.moe_intermediate_size)
