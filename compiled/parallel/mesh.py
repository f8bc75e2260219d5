"""Tensor parallelism inside context parallelism: the T x C processes of one engine as C
tensor-parallel groups of T (each a context-parallel rank holding the model's shards) and T
context-parallel groups of C (the processes holding the same shard, between which a split
prefill's rows are gathered).

Process `c * T + t` is tensor-parallel rank t of context-parallel rank c, so rank 0 of the whole
group is rank 0 of both of its subgroups. Every process creates every subgroup, in the same order
(torch.distributed requires it), and keeps the two it belongs to. Both share the whole group's
control channel (rank 0's messages reach every process) and its workers (named in errors)."""

from __future__ import annotations

import dataclasses
import datetime

import torch.distributed as dist

from compiled.parallel.group import CPGroup


def roles(whole: CPGroup, tp_size: int, cp_size: int, timeout: float) -> tuple[CPGroup | None, CPGroup | None]:
    """This process's tensor- and context-parallel groups; None for one that is off, and `whole`
    itself when only one is on."""
    if tp_size == 1 or cp_size == 1:
        return (whole if tp_size > 1 else None), (whole if cp_size > 1 else None)
    if whole.world != tp_size * cp_size:
        raise ValueError(f"a group of {whole.world} is not {cp_size} tensor-parallel groups of {tp_size}")
    delta = datetime.timedelta(seconds=timeout)
    cp_rank, tp_rank = divmod(whole.rank, tp_size)
    tp_groups = [dist.new_group([c * tp_size + t for t in range(tp_size)], timeout=delta) for c in range(cp_size)]
    cp_groups = [dist.new_group([c * tp_size + t for c in range(cp_size)], timeout=delta) for t in range(tp_size)]

    def view(rank: int, world: int, data: dist.ProcessGroup, kind: str) -> CPGroup:
        return dataclasses.replace(whole, rank=rank, world=world, data=data, kind=kind, parent=whole)
    return (view(tp_rank, tp_size, tp_groups[cp_rank], "tensor-parallel"),
            view(cp_rank, cp_size, cp_groups[tp_rank], "context-parallel"))
