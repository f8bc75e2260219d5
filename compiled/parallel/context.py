"""The context-parallel step the collective ops and attention read while a forward runs.

The runner installs a `CPStep` as the forward context's `cp` (`compiled/forward_context.py`) for
a step whose tokens are split over the ranks; outside one (and at world size 1) the collective
ops are identities."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CPStep:
    group: dist.ProcessGroup | None
    world: int
    rank: int
    max_local: int                # the longest rank's token count: every rank's rows are padded to it
    gather_index: torch.Tensor    # [T] the batch token's row in the gathered [world * max_local] rows
    positions: torch.Tensor       # [T] every token's position, batch order
    out_cache_loc: torch.Tensor   # [T] every token's KV slot, batch order
    # per segment of this rank: how many tokens of its chunk come before it, and the chunk's first
    # row in batch order (attention reads that part of the prefix from the gathered K/V)
    rows_prefix: torch.Tensor
    rows_start: torch.Tensor


def gather_rows(x: torch.Tensor, step: CPStep) -> torch.Tensor:
    """Every rank's rows of x (`[local, ...]`) in batch order: padded to `max_local`, gathered
    rank after rank, then picked by `gather_index`."""
    pad = step.max_local - x.shape[0]
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    x = x.contiguous()
    if step.group is None or step.world == 1:
        full = x
    elif dist.get_backend(step.group) == "nccl":
        full = x.new_empty((step.world * step.max_local, *x.shape[1:]))
        dist.all_gather_into_tensor(full, x, group=step.group)
    else:   # gloo gathers into a list
        parts = [torch.empty_like(x) for _ in range(step.world)]
        dist.all_gather(parts, x, group=step.group)
        full = torch.cat(parts)
    return full.index_select(0, step.gather_index)
