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

The expert ops can take the router's logits in place of this op's outputs (`Router`; the
`fuse_routing` pass, `routing_operands`): above 128 (token, expert) pairs the alignment's count
kernel then routes its tokens with this kernel's code (`Routed`), one launch fewer. The router
GEMM and this routing folded into the o_proj's kernel (its column blocks sharing out the router,
the last one to finish routing) measured no faster in the decode step: its serial tail cost what
the two launches did; so did routing in every program of the one-token GEMV (bench/RESULTS.md)."""

from __future__ import annotations

from typing import NamedTuple

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


class Router(NamedTuple):
    """The routing of `topk_route` as operands (router logits `[T, E]`, k, renormalise, the local
    experts' count or None) for an expert op that routes the tokens itself."""
    logits: torch.Tensor
    top_k: int
    renormalize: bool
    local_experts: int | None = None


def expert_pad(E: int) -> int:
    """The routing and alignment kernels' expert axis: E rounded up to a power of two, at least 16
    (the alignment's count kernel routes and counts on one axis)."""
    return max(16, triton.next_power_of_2(E))


def route_args(router: Router) -> tuple[tuple, dict]:
    """`routing_kernels.route_rows`'s arguments after its three pointers (logits, weights, ids):
    (T, E, the logits' row stride, the first local expert, their count) and its constexprs."""
    logits, top_k, _, local = router
    T, E = logits.shape
    first = 0 if local is None else tp_rank() * local
    return ((T, E, logits.stride(0), first, E if local is None else local),
            dict(TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)), E_PAD=expert_pad(E),
                 RENORM=bool(router.renormalize), LOCAL=local is not None))


def routed_buffers(router: Router) -> tuple[torch.Tensor, torch.Tensor]:
    """Where `router`'s weights (fp32) and ids (int64), `[T, k]`, go."""
    T = router.logits.shape[0]
    device = router.logits.device
    return (torch.empty(T, router.top_k, dtype=torch.float32, device=device),
            torch.empty(T, router.top_k, dtype=torch.int64, device=device))


def unit_rows(router: Router) -> Router:
    """`router` with its logits' rows contiguous, as the kernels read them."""
    return router if router.logits.stride(-1) == 1 else router._replace(logits=router.logits.contiguous())


class Routed(NamedTuple):
    """A routing an expert op's kernels compute into `weights` / `ids` (`routed_buffers`) before
    they read them."""
    router: Router
    weights: torch.Tensor
    ids: torch.Tensor


def topk_route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                      local_experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same contract in one Triton launch (ties pick the lower expert index)."""
    router = unit_rows(Router(router_logits, top_k, renormalize, local_experts))
    weights, ids = routed_buffers(router)
    route_into(router, weights, ids)
    return weights, ids


def route_into(router: Router, weights: torch.Tensor, ids: torch.Tensor) -> None:
    """`topk_route_kernel` over `router` (rows contiguous) into `weights` and `ids` `[T, k]`."""
    from compiled.moe.routing_kernels import topk_route_kernel
    from compiled.triton_utils import launch_kwargs

    if router.logits.shape[0] == 0:
        return
    args, consts = route_args(router)
    # few rows a program: the k rounds of max/argmin are a serial chain, keep each step short
    rows = max(2, min(4, 512 // consts["E_PAD"]))
    topk_route_kernel[(triton.cdiv(args[0], rows),)](
        router.logits, weights, ids, *args, ROWS=rows, **consts, num_warps=4, **launch_kwargs(router.logits.device))


def routing_operands(op: str, topk_weights: torch.Tensor | None, topk_ids: torch.Tensor | None,
                     router_logits: torch.Tensor | None, top_k: int, renormalize: bool, local_experts: int | None,
                     in_kernel: bool) -> tuple[torch.Tensor, torch.Tensor, Routed | None]:
    """An expert op's routing: its (topk_weights, topk_ids), or with `router_logits` (the
    `fuse_routing` pass's operands) their buffers and the `Routed` that its Triton path fills
    before reading them where `in_kernel`, else routed here by the routing op (ids and weights are
    the same either way). A one-line ValueError naming `op` for a call with both or neither, or
    a top_k the logits cannot hold."""
    if router_logits is None:
        if topk_weights is None or topk_ids is None:
            raise ValueError(f"{op}: needs topk_weights and topk_ids, or router_logits")
        return topk_weights, topk_ids, None
    if topk_weights is not None or topk_ids is not None:
        raise ValueError(f"{op}: router_logits replaces topk_weights and topk_ids (got both)")
    if not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(f"{op}: top_k={top_k} must be 1 to the {router_logits.shape[-1]} experts of router_logits")
    if not in_kernel:
        weights, ids = torch.ops.compiled.topk_route(router_logits, top_k, renormalize, local_experts)
        return weights, ids, None
    router = unit_rows(Router(router_logits, top_k, renormalize, local_experts))
    weights, ids = routed_buffers(router)
    return weights, ids, Routed(router, weights, ids)


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
