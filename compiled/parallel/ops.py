"""The collective ops, opaque so each traces as a single node.

Context parallelism's, at which the compile backend splits the graph (`CP_SPLITTING_OPS`):

    x_full = compiled::cp_allgather(x)     # [T_local, ...] -> [T, ...]

It returns every rank's rows of the step in batch order (`context.gather_rows`); the cp_allgather
pass puts it on each attention's K and V and on the final hidden states. Outside a
context-parallel step (and at world size 1) it returns a copy of x: the reference, and the
CP=1 path.

Tensor parallelism's, which the tp_shard pass puts after every row-parallel output:

    y = compiled::all_reduce(x)            # the sum of x over the tensor-parallel group

    y = compiled::all_gather(x)            # every rank's x side by side along the last dimension

over the process's group (`tensor.tp_group`); without one (world size 1) each returns a copy of
x: the reference, and the TP=1 path. The vocab-parallel LM head gathers its logits with the second."""

from __future__ import annotations

import torch
import torch.distributed as dist

from compiled.forward_context import current_forward
from compiled.parallel.context import gather_rows
from compiled.parallel.tensor import tp_group

CP_SPLITTING_OPS: tuple[str, ...] = ("compiled::cp_allgather",)


@torch.library.custom_op("compiled::cp_allgather", mutates_args=())
def cp_allgather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of x, in the step's batch order."""
    step = current_forward().cp
    if step is None:
        return x.clone()
    return gather_rows(x, step)


@cp_allgather.register_fake
def _(x):
    return x.new_empty((_step_tokens(x), *x.shape[1:]))


def _step_tokens(x: torch.Tensor):
    """The step's token count under fake tensors: a size of its own, as it differs from x's. Meta
    tensors (the pass manager's check run) have no shape environment for one: x's count stands in."""
    try:
        return torch.library.get_ctx().new_dynamic_size()
    except RuntimeError:
        return x.shape[0]


@torch.library.custom_op("compiled::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the tensor-parallel group (a new tensor: x is left as it is)."""
    out = x.clone()
    group = tp_group()
    if group is not None and group.world > 1:
        dist.all_reduce(out, group=group.group)
    return out


@all_reduce.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("compiled::all_gather", mutates_args=())
def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x concatenated along the last dimension, rank 0's first."""
    group = tp_group()
    if group is None or group.world == 1:
        return x.clone()
    parts = [torch.empty_like(x) for _ in range(group.world)]
    dist.all_gather(parts, x.contiguous(), group=group.group)
    return torch.cat(parts, dim=-1)


@all_gather.register_fake
def _(x):
    group = tp_group()
    world = 1 if group is None else group.world
    return x.new_empty((*x.shape[:-1], x.shape[-1] * world))
