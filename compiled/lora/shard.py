"""An adapter's share for one tensor-parallel rank: the factors its sharded projections read.

Column-parallel targets (q, k, v, gate, up; the experts' gate and up) keep A whole and keep the
rank's rows of B, the rows of the weight it holds; row-parallel ones (o, down; the experts'
down) keep the rank's columns of A, the input it holds, and B whole: the rank's delta is then a
partial sum that the layer's all-reduce completes with the base output's. Under expert
parallelism a rank keeps only its own experts' factors, whole (every layout, a factor shared by
all experts included, is a `[E, ...]` tensor by then)."""

from __future__ import annotations

import torch

from compiled.lora.weights import Adapter, ExpertLoRAWeight, LoRAWeight
from compiled.parallel.tensor import COLUMN_PARALLEL, ROW_PARALLEL, ShardPlan


def shard_adapter(adapter: Adapter, plan: ShardPlan) -> Adapter:
    """`adapter` cut to rank `plan.rank`'s share (views of its factors)."""
    out = Adapter(adapter.name, adapter.path, adapter.rank, shard=(plan.world, plan.rank))
    for (layer, proj), w in adapter.dense.items():
        out.dense[(layer, proj)] = LoRAWeight(*_cut(w.a, w.b, proj, plan, expert=False), w.scaling)
    for (layer, proj), w in adapter.experts.items():
        a, b = (t.narrow(0, plan.first_expert, plan.local_experts) for t in (w.a, w.b))
        out.experts[(layer, proj)] = ExpertLoRAWeight(*_cut(a, b, proj, plan, expert=True), w.scaling)
    return out


def _cut(a: torch.Tensor, b: torch.Tensor, proj: str, plan: ShardPlan, expert: bool) -> tuple[torch.Tensor, ...]:
    """(A, B) of `proj` on this rank: A `[..., r, in]`, B `[..., out, r]`."""
    start, length = plan.span(proj, expert)
    if expert and plan.expert_parallel:
        return a, b
    if proj in COLUMN_PARALLEL:
        b = b.narrow(-2, start, length)
    elif proj in ROW_PARALLEL:
        a = a.narrow(-1, start, length)
    return a, b
