"""Which graph of a model: the variants a model is built and captured as, beyond the config's own
pass list (`manager.passes_for` chooses each one's passes; the runner keys its graphs by it)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GraphVariant:
    """One graph of the model. A new axis (a weight quantization, a tensor-parallel world size)
    is one more field with a default that means "as today", so existing keys keep their meaning."""
    lora: bool = False               # adds the adapters' deltas (`lora_delta` and its fusions)
    context_parallel: bool = False   # a context-parallel step's graph: the gathers of `cp_allgather`
    tp_size: int = 1                 # tensor-parallel ranks: > 1 shards the graph (`tp_shard`) for rank tp_rank
    tp_rank: int = 0
    expert_parallel: bool = False    # with tp_size > 1: each rank holds whole experts (`tp_shard`)

    def __str__(self) -> str:
        parts = [name for name, on in (("lora", self.lora), ("cp", self.context_parallel)) if on]
        if self.tp_size > 1:
            parts.append(f"tp{self.tp_rank}/{self.tp_size}" + ("+ep" if self.expert_parallel else ""))
        return "+".join(parts) or "base"

    def at(self, tp_size: int, tp_rank: int, expert_parallel: bool = False) -> GraphVariant:
        """This variant on rank `tp_rank` of `tp_size` tensor-parallel ranks (whole experts per
        rank with `expert_parallel`)."""
        return replace(self, tp_size=tp_size, tp_rank=tp_rank, expert_parallel=expert_parallel)


BASE = GraphVariant()
LORA = GraphVariant(lora=True)
