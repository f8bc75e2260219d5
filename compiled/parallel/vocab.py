"""The vocab-parallel embedding and LM head: each tensor-parallel rank holds `ShardPlan.vocab_rows`
consecutive rows of the vocabulary (the last ranks' rows past it are padding).

    e = compiled::vocab_embedding(ids, weight)   # rows of the ids in [rank * rows, (rank + 1) * rows), else 0
    x = compiled::all_reduce(e)                  # each id's row, from the rank that holds it

The rank is the process's (`tensor.tp_group`), not a constant of the graph: every rank's graph is
then the same code over its own weights, so one compiled artifact serves them all.

The LM head computes its shard's logits and gathers them (`compiled::all_gather`), dropping the
padding columns, so every rank, rank 0's sampler included, sees the whole vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import compiled.parallel.ops  # noqa: F401  (registers compiled::all_gather)
from compiled.parallel.tensor import tp_rank


@torch.library.custom_op("compiled::vocab_embedding", mutates_args=())
def vocab_embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`weight[ids - start]` for the ids this rank's shard holds (from `start = rank * rows`), zero
    rows for the others."""
    local = ids - tp_rank() * weight.shape[0]
    inside = (local >= 0) & (local < weight.shape[0])
    rows = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    # where, not a product: padding rows are never loaded and may hold NaN
    return torch.where(inside[:, None], rows, rows.new_zeros(()))


@vocab_embedding.register_fake
def _(ids, weight):
    return weight.new_empty((ids.shape[0], weight.shape[1]))


class VocabParallelHead(nn.Module):
    """The LM head of one rank: `weight` holds its vocabulary rows `[vocab_rows, H]`; the output
    is every rank's logits gathered, `[T, out_features]` (the whole vocabulary)."""

    def __init__(self, weight: nn.Parameter, out_features: int) -> None:
        super().__init__()
        self.weight = weight
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gathered = torch.ops.compiled.all_gather(F.linear(x, self.weight))
        return gathered[..., :self.out_features]
