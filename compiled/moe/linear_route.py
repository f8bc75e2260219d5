"""`compiled::linear_add_norm_route`: a MoE layer's attention output projection, residual add +
post-attention RMSNorm, router linear and top-k routing, as one op.

    y = linear(attn, w_o);  logits, h, normed = add_rms_norm_linear(x, y, norm_weight, eps, w_router, True)
    weights, ids = topk_route(logits, top_k, renormalize)
        -> h, normed, weights, ids = linear_add_norm_route(attn, w_o, x, norm_weight, eps, w_router, top_k, renormalize)

At decode sizes these are three launches in a row, the router's and the routing's tiny and each
paying a launch's fixed cost on the step's critical path. Where the skinny GEMM serves the
projection and the routing runs in Triton (CUDA; M <= SKINNY_MAX_M), one kernel does all of it
(`linear_route_kernels`); elsewhere (prefill, CPU) the op runs the three ops in a row."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from compiled.graphs import fused_linear
from compiled.graphs import linear_kernels as lk
from compiled.graphs.linear import dispatch, use_kernel
from compiled.moe.routing import routing_backend, topk_route_ref

OP = "compiled::linear_add_norm_route"
MAX_EXPERTS = 256        # the last program holds a row's logits for every expert in registers
NORM_TILE = 4096         # elements of the last program's [rows, columns] tiles of h


def linear_add_norm_route_ref(attn: torch.Tensor, w_o: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor,
                              eps: float, w_router: torch.Tensor, top_k: int, renormalize: bool):
    """(h, normed, weights, ids) from the three ops' torch references."""
    logits, h, normed = fused_linear.add_rms_norm_linear_ref(x, F.linear(attn, w_o), norm_weight, eps, w_router)
    return (h, normed, *topk_route_ref(logits, top_k, renormalize))


def _check(attn, w_o, x, norm_weight, w_router, top_k) -> None:
    """One-line errors naming the op and the argument at fault."""
    if attn.dim() != 2 or w_o.dim() != 2 or attn.shape[1] != w_o.shape[1]:
        raise ValueError(f"{OP}: attn {tuple(attn.shape)} @ w_o {tuple(w_o.shape)}.T: expected attn [T, K] and "
                         f"w_o [H, K]")
    T, H = attn.shape[0], w_o.shape[0]
    for name, t, shape in (("x", x, (T, H)), ("w_router", w_router, (w_router.shape[0], H)),
                           ("norm weight", norm_weight, (H,))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{OP}: {name} {tuple(t.shape)}, expected {shape} (attn {tuple(attn.shape)}, "
                             f"w_o {tuple(w_o.shape)})")
    for name, t in (("w_o", w_o), ("x", x), ("w_router", w_router)):
        if t.dtype != attn.dtype:
            raise ValueError(f"{OP}: {name} is {t.dtype}, attn is {attn.dtype}")
    if not 0 < top_k <= w_router.shape[0]:
        raise ValueError(f"{OP}: top_k={top_k} for {w_router.shape[0]} experts")


def use_fused_kernel(attn: torch.Tensor, w_o: torch.Tensor, x: torch.Tensor, w_router: torch.Tensor) -> bool:
    """Whether the one-launch kernel serves these: the skinny GEMM takes the projection, the
    routing runs in Triton, and the layouts are the kernel's."""
    return (use_kernel(attn, w_o) and routing_backend(attn) == "triton" and w_router.shape[0] <= MAX_EXPERTS
            and x.stride(-1) == 1 and w_router.stride(-1) == 1 and w_o.shape[0] <= lk.WORKSPACE_COLS)


@torch.library.custom_op(OP, mutates_args=())
def linear_add_norm_route(attn: torch.Tensor, w_o: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float, w_router: torch.Tensor, top_k: int, renormalize: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """attn `[T, K]`, w_o `[H, K]`, x `[T, H]` (the residual stream), w_router `[E, H]` -> (h = x +
    attn @ w_o.T, normed = RMSNorm(h) * norm_weight, routing weights `[T, top_k]` fp32, expert ids
    `[T, top_k]` int64)."""
    _check(attn, w_o, x, norm_weight, w_router, top_k)
    if use_fused_kernel(attn, w_o, x, w_router):
        return linear_add_norm_route_triton(attn, w_o, x, norm_weight, eps, w_router, top_k, renormalize)
    logits, h, normed = torch.ops.compiled.add_rms_norm_linear(x, dispatch(attn, w_o), norm_weight, eps, w_router,
                                                               True)
    return (h, normed, *torch.ops.compiled.topk_route(logits, top_k, renormalize))


@linear_add_norm_route.register_fake
def _(attn, w_o, x, norm_weight, eps, w_router, top_k, renormalize):
    _check(attn, w_o, x, norm_weight, w_router, top_k)
    shape = (x.shape[0], top_k)
    return (torch.empty_like(x), torch.empty_like(x), x.new_empty(shape, dtype=torch.float32),
            x.new_empty(shape, dtype=torch.int64))


# The last program's inputs: per column block, BLOCK_M rows of partial logits (E_PAD each) and of
# sums of squares. One buffer per device, grown only outside CUDA graph capture; a replaced one
# stays alive, since captured graphs hold its address.
_WORKSPACES: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def route_workspace(device: torch.device, numel: int) -> torch.Tensor:
    buf = _WORKSPACES.get(device)
    if buf is not None and buf.numel() >= numel:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{OP}: workspace first needed inside a CUDA graph capture; run the op once before "
                           "capturing")
    if buf is not None:
        _RETIRED.append(buf)
    buf = _WORKSPACES[device] = torch.empty(numel, dtype=torch.float32, device=device)
    return buf


def linear_add_norm_route_triton(attn: torch.Tensor, w_o: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor,
                                 eps: float, w_router: torch.Tensor, top_k: int, renormalize: bool,
                                 config: lk.SkinnyConfig | None = None):
    """The op's contract in one launch (`_linear_add_norm_route_kernel`); `config` overrides the
    projection's skinny-GEMM tile (tests)."""
    from compiled.moe.linear_route_kernels import _linear_add_norm_route_kernel
    from compiled.pdl import launch_kwargs

    M, K = attn.shape
    N, E = w_o.shape[0], w_router.shape[0]
    config = lk.resolve_config(attn, N, K, config)
    block_n, block_k, split_k, num_warps, num_stages = config
    n_cb = triton.cdiv(N, block_n)
    e_pad = max(16, triton.next_power_of_2(E))
    rows = max(2, triton.next_power_of_2(M))
    split = lk.split_workspace(attn.device)   # the projection's partials; semaphores[n_cb] counts column blocks
    ws = route_workspace(attn.device, n_cb * lk.BLOCK_M * (e_pad + 1))
    r_part, sq_part = ws[:n_cb * lk.BLOCK_M * e_pad], ws[n_cb * lk.BLOCK_M * e_pad:]
    h, normed = x.new_empty((M, N)), x.new_empty((M, N))
    weights = torch.empty(M, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(M, top_k, dtype=torch.int64, device=x.device)
    _linear_add_norm_route_kernel[(n_cb, split_k)](
        attn, w_o, x, norm_weight, w_router, h, normed, weights, ids, split.partials, split.semaphores, r_part,
        sq_part, M, N, K, E, lk.k_per_split(K, config), attn.stride(0), w_o.stride(0), x.stride(0),
        w_router.stride(0), eps,
        BLOCK_M=lk.BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, EVEN_K=K % block_k == 0, N_CB=n_cb,
        ROWS=rows, E_PAD=e_pad, TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)), RENORM=bool(renormalize),
        NORM_BLOCK=min(triton.next_power_of_2(N), NORM_TILE // rows), **lk.dot_flags(attn.dtype),
        num_warps=num_warps, num_stages=num_stages, **launch_kwargs(attn.device))
    return h, normed, weights, ids
