"""Greedy decoding's argmax over the vocabulary, in one Triton launch, inside the decode graphs.

At a decode step's small batches torch's argmax reduces each row of the fp32 logits (~150k
entries) with few blocks: 8.7 µs a step on the H100 (30B, batch 1), after the graph and before
the token goes back to the host, so on the step's critical path. Here CHUNK-wide programs reduce
a row's slices in parallel and write (max, first index); the program that arrives last at the
row's counter reduces those in slice order and puts the counter back to zero (no memset, as the
skinny GEMM's split-K). Ties and NaN follow torch: the first maximal index wins, NaN counts as
the maximum. The decode graphs run it on every step's logits (`cuda_graphs.DecodeGraphs`), so
its host launch cost (~0.1 ms, more than the kernel) is paid once, at capture; the sampler takes
the result for greedy rows whose logits it leaves as they are (a batch that samples spends the
kernel's ~4 µs for nothing, beside its own softmax work). Where the LM head's logits arrive in
the model's dtype (cuBLAS's, past the skinny kernel's rows), the kernel also stores them widened
to fp32 for the sampler as it reads them (`widened`): one pass, not a copy launch before it. The
reference is `argmax_ref`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096          # logits a program reduces
MAX_CHUNKS = 128      # slices a row may have (V <= 512k); the last program reduces them in one tile


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


@triton.jit
def _nan_high(x):
    """NaN as +inf, so that it wins the max as it does in torch's argmax."""
    return tl.where(x != x, float("inf"), x)


@triton.jit
def _argmax_kernel(Logits, Out, Vals, Idx, Counters, V, stride_b, Widened, stride_wb, CHUNKS, CHUNK: tl.constexpr,
                   MAX_CHUNKS: tl.constexpr, WIDEN: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(Logits + b.to(tl.int64) * stride_b + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    if WIDEN:
        tl.store(Widened + b.to(tl.int64) * stride_wb + offs, x, mask=offs < V)
    x = _nan_high(x)
    best = tl.max(x, axis=0)
    first = tl.min(tl.where(x == best, offs, V), axis=0)   # the first index holding the max
    if CHUNKS == 1:
        tl.store(Out + b, first.to(tl.int64))
    else:
        tl.store(Vals + b * MAX_CHUNKS + c, best)
        tl.store(Idx + b * MAX_CHUNKS + c, first)
        tl.debug_barrier()
        if tl.atomic_add(Counters + b, 1, sem="acq_rel") == CHUNKS - 1:
            slices = tl.arange(0, MAX_CHUNKS)
            live = slices < CHUNKS
            vals = tl.load(Vals + b * MAX_CHUNKS + slices, mask=live, other=float("-inf"), cache_modifier=".cg")
            idx = tl.load(Idx + b * MAX_CHUNKS + slices, mask=live, other=V, cache_modifier=".cg")
            top = tl.max(vals, axis=0)
            # slices hold ascending index ranges, so the smallest index among the maxima is the first
            tl.store(Out + b, tl.min(tl.where(vals == top, idx, V), axis=0).to(tl.int64))
            tl.atomic_xchg(Counters + b, 0)


class ArgmaxWorkspace:
    """The slices' (max, index) and the rows' counters (zero between launches) for up to
    `max_rows` rows: held by the caller (the decode graphs capture its addresses)."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.vals = torch.empty(max_rows * MAX_CHUNKS, dtype=torch.float32, device=device)
        self.idx = torch.empty(max_rows * MAX_CHUNKS, dtype=torch.int32, device=device)
        self.counters = torch.zeros(max_rows, dtype=torch.int32, device=device)


def argmax_triton(logits: torch.Tensor, workspace: ArgmaxWorkspace, out: torch.Tensor | None = None,
                  widened: torch.Tensor | None = None) -> torch.Tensor:
    """logits `[B, V]` (last dim contiguous) -> `[B]` int64 (into `out` if given); `widened`: an
    fp32 `[B, V]` (last dim contiguous) the logits are also stored into. Launches sharing a
    workspace must be stream-ordered."""
    B, V = logits.shape
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    chunks = triton.cdiv(V, CHUNK)
    if chunks > MAX_CHUNKS or B > workspace.max_rows or logits.stride(-1) != 1:
        raise ValueError(f"argmax: logits {tuple(logits.shape)} (stride {logits.stride()}) need rows <= "
                         f"{workspace.max_rows}, vocabulary <= {CHUNK * MAX_CHUNKS} and a contiguous last dim")
    if widened is not None and (widened.shape != logits.shape or widened.dtype != torch.float32
                                or widened.stride(-1) != 1):
        raise ValueError(f"argmax: widened must be an fp32 {tuple(logits.shape)} tensor with a contiguous last "
                         f"dim, got {widened.dtype} {tuple(widened.shape)} (stride {widened.stride()})")
    if B == 0:
        return out
    _argmax_kernel[(B, chunks)](logits, out, workspace.vals, workspace.idx, workspace.counters, V,
                                logits.stride(0), logits if widened is None else widened,
                                0 if widened is None else widened.stride(0), chunks, CHUNK=CHUNK,
                                MAX_CHUNKS=MAX_CHUNKS, WIDEN=widened is not None, num_warps=8)
    return out
