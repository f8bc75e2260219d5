"""Expert parallelism's routing: rank r holds experts [r * count, (r + 1) * count) whole, and
computes them for every token routed to them; the layer's all-reduce adds the ranks' outputs.

    weights, ids = compiled::local_experts(topk_weights, topk_ids, count)

keeps each (token, expert) pair of a local expert (its id made local) and turns every other pair
into one of local expert 0 with weight 0: it then adds nothing, and the expert ops (reference and
Triton kernels alike) need no notion of a pair to skip. The cost is those pairs' compute, which a
kernel that drops them would save. The rank is the process's (as in `parallel/vocab.py`), so every
rank's graph is the same code."""

from __future__ import annotations

import torch

from compiled.parallel.tensor import tp_rank


@torch.library.custom_op("compiled::local_experts", mutates_args=())
def local_experts(topk_weights: torch.Tensor, topk_ids: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = topk_ids - tp_rank() * count
    mine = (local >= 0) & (local < count)
    return torch.where(mine, topk_weights, 0.0), torch.where(mine, local, 0)


@local_experts.register_fake
def _(topk_weights, topk_ids, count):
    return torch.empty_like(topk_weights), torch.empty_like(topk_ids)
