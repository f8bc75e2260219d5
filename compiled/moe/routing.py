"""Expert routing: softmax over all experts in fp32, top-k, then renormalise if asked.

This is the order HF and SGLang use (one reference document describes it the other way round).
With `local_experts=count` (expert parallelism: rank r holds experts [r * count, (r + 1) * count)
whole) the op then keeps each (token, expert) pair of a local expert, its id made local, and marks
every other pair with the id NOT_LOCAL (-1) and weight 0. The expert ops skip those pairs: the
alignment never places them, the one-token GEMVs read no weight for them and the top-k sums leave
their rows out, so a rank computes its own experts' pairs only. The rank is the process's
(`parallel.tensor.tp_rank`, read at run time), so every rank's graph is the same code; without
the operand (None) the op routes over all experts as before.
On CUDA the op runs one Triton kernel (`routing_kernels.py`). `BACKEND` ('auto': the kernel on
CUDA, the reference elsewhere; from `COMPILED_ROUTING_BACKEND`, read at import, or the engine
config) set to 'torch' forces the torch reference, 'triton' the kernel (also on CPU under
TRITON_INTERPRET=1).

The router GEMM and this routing folded into the o_proj's kernel (its column blocks sharing out the
router, the last one to finish routing) measured no faster in the decode step: its serial tail
cost what the two launches did (bench/RESULTS.md)."""

from __future__ import annotations

import torch
import triton

from compiled.backend import BackendChoice
from compiled.parallel.tensor import tp_rank

BACKEND = BackendChoice("COMPILED_ROUTING_BACKEND")
NOT_LOCAL = -1   # the id of a pair whose expert another rank holds (the kernels test ids >= 0)


def topk_route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   local_experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits `[T, E]` -> (weights `[T, k]` fp32, expert ids `[T, k]` int64); with
    `local_experts`, the pairs of this rank's experts only (the module docstring says how)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if local_experts is None:
        return weights, ids
    local = ids - tp_rank() * local_experts
    mine = (local >= 0) & (local < local_experts)
    return torch.where(mine, weights, 0.0), torch.where(mine, local, NOT_LOCAL)


def topk_route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                      local_experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same contract in one Triton launch (ties pick the lower expert index)."""
    from compiled.moe.routing_kernels import topk_route_kernel
    from compiled.triton_utils import launch_kwargs

    T, E = router_logits.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    if T == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    e_pad = max(16, triton.next_power_of_2(E))
    # few rows a program: the k rounds of max/argmin are a serial chain, keep each step short
    rows = max(2, min(4, 512 // e_pad))
    first = 0 if local_experts is None else tp_rank() * local_experts
    topk_route_kernel[(triton.cdiv(T, rows),)](
        logits, weights, ids, T, E, logits.stride(0), first, E if local_experts is None else local_experts,
        TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)), E_PAD=e_pad, ROWS=rows,
        RENORM=bool(renormalize), LOCAL=local_experts is not None, num_warps=4, **launch_kwargs(logits.device))
    return weights, ids


def _routing_backend(router_logits: torch.Tensor) -> str:
    if BACKEND.name == "auto":
        return "triton" if router_logits.is_cuda else "torch"
    return BACKEND.name


@torch.library.custom_op("compiled::topk_route", mutates_args=())
def topk_route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
               local_experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if _routing_backend(router_logits) == "triton":
        return topk_route_triton(router_logits, top_k, renormalize, local_experts)
    return topk_route_ref(router_logits, top_k, renormalize, local_experts)


@topk_route.register_fake
def _(router_logits, top_k, renormalize, local_experts=None):
    shape = (router_logits.shape[0], top_k)
    return (router_logits.new_empty(shape, dtype=torch.float32),
            router_logits.new_empty(shape, dtype=torch.int64))
