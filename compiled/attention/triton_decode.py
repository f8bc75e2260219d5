"""Flash-decoding over the paged KV cache (Triton), safe to capture in a CUDA graph.

One program per (request, KV head, split) serves the whole GQA group of query heads: it loads
each K/V tile of its split once (slots gathered through `req_to_token`), computes the group's
scores with one `tl.dot`, and writes a partial output and its log-sum-exp (base 2, fp32) to a
preallocated workspace. The merge needs no second launch: each program bumps a per-(request, KV
head) counter after writing its partial, and the program that arrives last merges the splits and
resets the counter to zero (so a captured graph replays with no memset). Only the splits that hold
tokens take part: at a short context most of a batch's splits are empty, and waiting for them
made the last arrival (and the merge) later. With `new_kv` the program whose split holds the
newest token first writes the step's K/V into the pools, which saves the separate store launch
of a decode step.

The number of splits is a launch parameter fixed by the batch size (so it is static inside a
captured graph); each program derives its split's token range from `seq_lens` on the device,
so nothing here reads a host value that changes from step to step, synchronises, or allocates
(except the returned output, which a captured graph allocates from its pool)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compiled.attention.reference import NormRope
from compiled.attention.triton_norm_rope import norm_rope_tile
from compiled.triton_utils import interpreter_upcast, launch_kwargs, num_sms, pdl_wait, prefetch_l2

LOG2E = 1.4426950408889634
MAX_SPLITS = 64   # upper bound on splits per request (workspace sizing)
CPU_SMS = 8       # the SMs the split heuristic assumes off CUDA (the interpreter)


@triton.jit
def _split_range(seq_len, split, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """Splits are whole BLOCK_N tiles: split s covers [s * per, min((s + 1) * per, seq_len))."""
    per = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(start + per, seq_len)
    return start, end


@triton.jit
def _live_splits(seq_len, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """How many of the splits hold tokens: the first ones (0 for an empty request)."""
    start, end = _split_range(seq_len, 0, NUM_SPLITS, BLOCK_N)
    return tl.cdiv(seq_len, tl.maximum(end - start, 1))


@triton.jit(do_not_specialize=["NUM_SPLITS"])
def _decode_kernel(
    Q, K_cache, V_cache, Req_to_token, Req_pool_indices, Seq_lens, Mid_o, Mid_lse, Counters,
    K_new, V_new, Loc, Out, Qw, Kw, Pos, Cos_sin, eps, sm_scale_log2, NUM_SPLITS,
    stride_qb, stride_qh, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_r2t,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cs,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, DIRECT: tl.constexpr,
    STORE: tl.constexpr, NORM_ROPE: tl.constexpr, MERGE_UNROLL: tl.constexpr, PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    """DIRECT (one split): write the normalised output straight to Out, no merge. NORM_ROPE: q
    and the new k arrive raw; RMSNorm (weights Qw, Kw) and RoPE at Pos[b] are applied here."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # The lengths, rows, positions and the request->token table come from the host (or an
    # ordinary kernel before the step), never from the kernel before this one: they and the first
    # tile's slots are read before waiting for it (PDL).
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    # Loaded beside the length, not after it: the slot gathers wait on both.
    row = tl.load(Req_pool_indices + b).to(tl.int64)
    start, end = _split_range(seq_len, split, NUM_SPLITS, BLOCK_N)
    r2t = Req_to_token + row * stride_r2t
    offs_n = start + tl.arange(0, BLOCK_N)
    slots = tl.load(r2t + offs_n, mask=offs_n < end, other=0).to(tl.int64)
    if NORM_ROPE:
        rope_row = Cos_sin + tl.load(Pos + b).to(tl.int64) * stride_cs
    else:
        rope_row = Cos_sin
    if PREFETCH:
        # The first tile's K/V rows, which earlier steps wrote, asked of L2 so that their DRAM
        # round trip overlaps the kernel before this one instead of following it. (The newest
        # token's row may be among them: the store below writes through to L2.)
        row_bytes: tl.constexpr = D * K_cache.dtype.element_ty.primitive_bitwidth // 8
        prefetch_l2(K_cache + kvh * stride_kch + slots * stride_kcs, row_bytes, offs_n < end)
        prefetch_l2(V_cache + kvh * stride_vch + slots * stride_vcs, row_bytes, offs_n < end)
    pdl_wait(PDL)
    offs_g = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + offs_g
    mask_h = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    out_ptrs = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if NORM_ROPE:
        q_rope = norm_rope_tile(Q + b.to(tl.int64) * stride_qb, heads * stride_qh, mask_h, offs_d, Qw, rope_row,
                                eps, D, Q.dtype.element_ty).to(Q.dtype.element_ty)
    if STORE:
        if (start < end) & (end == seq_len):   # this split holds the newest token: store it first
            _store_new_kv(K_new, V_new, Loc, K_cache, V_cache, Kw, rope_row, eps, b, kvh, offs_g, offs_d,
                          mask_d, stride_knb, stride_knh, stride_vnb, stride_vnh, stride_kcs, stride_kch,
                          stride_vcs, stride_vch, D, NORM_ROPE)
            # The loop below reads that slot back. (Taking the token from registers instead, with
            # no barrier, measured slower both ways tried: bench/RESULTS.md.)
            tl.debug_barrier()
    if start < end:
        if NORM_ROPE:
            q = q_rope
        else:
            q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        if UPCAST:   # see interpreter_upcast()
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        k_base = K_cache + kvh * stride_kch
        v_base = V_cache + kvh * stride_vch
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            if DIRECT:   # the next tile's slots, loaded every step (masked, no branch): see below
                next_slots = tl.load(r2t + offs_n + BLOCK_N, mask=offs_n + BLOCK_N < end, other=0).to(tl.int64)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_base + slots[:, None] * stride_kcs + offs_d[None, :], mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * sm_scale_log2
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            v = tl.load(v_base + slots[:, None] * stride_vcs + offs_d[None, :], mask=kv_mask, other=0.0)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
            m_i = m_new
            # Unsplit (whole requests, many tiles a program): with the slot load outside any
            # branch, Triton pipelines the loop, gathering each tile's K and V together a tile
            # ahead. Split programs hold a few tiles each; they ran faster with the load under a
            # branch, which leaves the loop unpipelined (bench/RESULTS.md, decode attention).
            if DIRECT:
                slots = next_slots
            elif n0 + BLOCK_N < end:
                slots = tl.load(r2t + offs_n + BLOCK_N, mask=offs_n + BLOCK_N < end, other=0).to(tl.int64)
        if DIRECT:
            tl.store(out_ptrs, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
        else:
            mid = Mid_o + b.to(tl.int64) * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_d[None, :]
            tl.store(mid, acc / l_i[:, None], mask=mask_h[:, None] & mask_d[None, :])
            tl.store(Mid_lse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i),
                     mask=mask_h)
    elif DIRECT:
        # A request with no cached tokens (a padding row of a captured batch) gets zeros.
        tl.store(out_ptrs, tl.zeros([BLOCK_H, BLOCK_D], tl.float32).to(Out.dtype.element_ty),
                 mask=mask_h[:, None] & mask_d[None, :])
    if not DIRECT:
        # The splits with tokens arrive (an empty request: split 0 alone, which merges nothing
        # into zeros). Every thread's partial must be written before the counter says so
        # (release); the last program's reads come after its acquire and skip L1 (.cg).
        arrivals = tl.maximum(_live_splits(seq_len, NUM_SPLITS, BLOCK_N), 1)
        if split < arrivals:
            tl.debug_barrier()
            counter = Counters + b * tl.num_programs(1) + kvh
            if tl.atomic_add(counter, 1, sem="acq_rel") == arrivals - 1:
                _merge_splits(Mid_o, Mid_lse, out_ptrs, seq_len, NUM_SPLITS, b, heads, mask_h, offs_d, mask_d,
                              stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, BLOCK_H, BLOCK_D, BLOCK_N,
                              MERGE_UNROLL)
                tl.atomic_xchg(counter, 0, sem="relaxed")


@triton.jit
def _store_new_kv(K_new, V_new, Loc, K_cache, V_cache, Kw, rope_row, eps, b, kvh, offs_g, offs_d, mask_d,
                  stride_knb, stride_knh, stride_vnb, stride_vnh, stride_kcs, stride_kch, stride_vcs, stride_vch,
                  D: tl.constexpr, NORM_ROPE: tl.constexpr):
    slot = tl.load(Loc + b).to(tl.int64)
    k_row = K_new + b.to(tl.int64) * stride_knb + kvh * stride_knh
    if NORM_ROPE:   # one row as a tile (the tile helper's shape), stored from its first row
        first = offs_g == 0
        k = norm_rope_tile(k_row, offs_g * 0, first, offs_d, Kw, rope_row, eps, D, K_new.dtype.element_ty)
        tl.store(K_cache + slot * stride_kcs + kvh * stride_kch + offs_g[:, None] * 0 + offs_d[None, :],
                 k.to(K_cache.dtype.element_ty), mask=first[:, None] & mask_d[None, :])
    else:
        k = tl.load(k_row + offs_d, mask=mask_d)
        tl.store(K_cache + slot * stride_kcs + kvh * stride_kch + offs_d, k.to(K_cache.dtype.element_ty), mask=mask_d)
    v = tl.load(V_new + b.to(tl.int64) * stride_vnb + kvh * stride_vnh + offs_d, mask=mask_d)
    tl.store(V_cache + slot * stride_vcs + kvh * stride_vch + offs_d, v.to(V_cache.dtype.element_ty), mask=mask_d)


@triton.jit
def _merge_splits(Mid_o, Mid_lse, out_ptrs, seq_len, NUM_SPLITS, b, heads, mask_h, offs_d, mask_d,
                  stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr):
    """Log-sum-exp merge of the non-empty splits' partials for the GQA group's heads."""
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    mid = Mid_o + b.to(tl.int64) * stride_mb + heads[:, None] * stride_mh + offs_d[None, :]
    lse_ptr = Mid_lse + b.to(tl.int64) * stride_lb + heads * stride_lh
    # Unrolled, so that the loads of several splits are in flight at once instead of one round
    # trip per split.
    for split in tl.range(0, _live_splits(seq_len, NUM_SPLITS, BLOCK_N), loop_unroll_factor=UNROLL):
        lse = tl.load(lse_ptr + split, mask=mask_h, other=0.0, cache_modifier=".cg")
        o = tl.load(mid + split * stride_ms, mask=mask_h[:, None] & mask_d[None, :], other=0.0,
                    cache_modifier=".cg")
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + o * w[:, None]
        l_i = l_i * alpha + w
        m_i = m_new
    # A request with no cached tokens (a padding row of a captured batch) gets zeros, not NaN.
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])


# Decode programs resident per SM: the default config's registers (~165 a thread) and shared
# memory (72 KB) fit 3 on Hopper (ptxas). A split count whose programs all fit at once beat the
# waves past it on an H200 (bench/RESULTS.md, decode attention).
PROGRAMS_PER_SM = 3
# The context the split count is chosen for (it is fixed per captured batch size, the context is
# not), and the fewest of its tokens a split should hold: below that, a split's fixed cost (its
# partial written and merged) outweighs its share of the reads. From `attention_bench.py
# --latency` on the H100 (bench/RESULTS.md): at batch 1, 16 splits beat 64 at 512-4096
# tokens of context (7.96 / 11.77 / 14.70 µs against 8.43 / 13.75 / 18.01).
REFERENCE_CONTEXT = 2048
MIN_SPLIT_TOKENS = 128
# Pipeline stages where a split's first tile is its whole share of REFERENCE_CONTEXT (the smallest
# batches): faster there than the default's, in the kernel and the decode step (bench/RESULTS.md).
ONE_TILE_STAGES = 3


def default_config(head_dim: int, direct: bool = False) -> dict:
    """Decode tile (KV tokens per iteration), warps, pipeline stages and the unrolling of the
    split merge. At head_dim 128, 128-token tiles: `attention_bench.py --latency` on the H100
    (bench/RESULTS.md) had them ahead of 64 at batch 1 (7.33 / 10.34 / 13.13 µs
    against 7.77 / 11.87 / 14.64 at 512 / 2,048 / 4,096 tokens) and at batch 8 up to 2,048.
    `direct` (one split: the batch fills the GPU alone, the loop is pipelined), 64-token tiles in
    3 stages there, faster on the H200 at batch 64 (bench/RESULTS.md, decode attention)."""
    block_n, stages = (32 if head_dim > 128 else 128 if head_dim == 128 else 64), 2
    if direct and head_dim == 128:
        block_n, stages = 64, 3
    return dict(block_n=block_n, num_warps=4, num_stages=stages, merge_unroll=4)


def num_kv_splits(batch: int, kv_heads: int, num_sms: int, max_splits: int = MAX_SPLITS,
                  programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Splits per request: a function of the batch shape only, so it is fixed for a captured
    batch size. The most whose programs (request x KV head x split) all fit on the GPU at once,
    `programs_per_sm` an SM: a second wave of programs waits for the first, which costs more than
    the splits save (H200: batch 64 at 512-4,096 tokens of context, one split 14-17% faster than
    two). At least MIN_SPLIT_TOKENS of REFERENCE_CONTEXT a split; a batch that fills the GPU alone
    is not split."""
    wave = programs_per_sm * num_sms
    most = max(1, min(max_splits, REFERENCE_CONTEXT // MIN_SPLIT_TOKENS))
    return max(1, min(most, wave // max(batch * kv_heads, 1)))


class DecodeWorkspace:
    """Partial outputs `[B, Hq, S, D]` and log-sum-exps `[B, Hq, S]` (fp32), allocated once for
    every batch size up to `max_batch` that the heuristic splits (unsplit batches need none; at
    most one wave of programs, so the size does not grow with `max_batch`), then viewed per call;
    and the merge counters `[B, Hkv]` (int32, zero between calls). `min_rows` reserves room for
    explicit `num_splits` (batch x splits rows)."""

    def __init__(self, max_batch: int, num_q_heads: int, kv_heads: int, head_dim: int,
                 device: torch.device, max_splits: int = MAX_SPLITS,
                 programs_per_sm: int = PROGRAMS_PER_SM, min_rows: int = 0) -> None:
        self.num_q_heads, self.kv_heads, self.head_dim = num_q_heads, kv_heads, head_dim
        self.max_batch, self.max_splits, self.device = max_batch, max_splits, torch.device(device)
        self.programs_per_sm = programs_per_sm
        self.num_sms = num_sms(self.device, off_gpu=CPU_SMS)
        self._splits = [1] + [num_kv_splits(b, kv_heads, self.num_sms, max_splits, programs_per_sm)
                              for b in range(1, max_batch + 1)]
        rows = max([b * s for b, s in enumerate(self._splits) if s > 1] + [min_rows, 1])
        self.capacity = rows   # batch x splits the buffers hold
        self.o = torch.empty(rows * num_q_heads * head_dim, dtype=torch.float32, device=self.device)
        self.lse = torch.empty(rows * num_q_heads, dtype=torch.float32, device=self.device)
        self.counters = torch.zeros(rows * kv_heads, dtype=torch.int32, device=self.device)

    def splits_for(self, batch: int) -> int:
        if batch < len(self._splits):
            return self._splits[batch]
        return num_kv_splits(batch, self.kv_heads, self.num_sms, self.max_splits, self.programs_per_sm)

    def views(self, batch: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = batch * splits
        if n > self.capacity:
            raise ValueError(f"decode workspace holds {self.capacity} request-splits, asked for {batch}x{splits}")
        h, d = self.num_q_heads, self.head_dim
        return self.o[:n * h * d].view(batch, h, splits, d), self.lse[:n * h].view(batch, h, splits)


def _bulk_aligned(*pools: torch.Tensor) -> bool:
    """Whether every K/V row of the pools starts and ends on 16 bytes (the bulk prefetch's unit)."""
    return all(p.data_ptr() % 16 == 0 and all(s * p.element_size() % 16 == 0 for s in (p.stride(0), p.stride(1)))
               and p.shape[-1] * p.element_size() % 16 == 0 for p in pools)


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, workspace: DecodeWorkspace,
                            num_splits: int | None = None, out: torch.Tensor | None = None,
                            new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                            norm_rope: NormRope | None = None, **config) -> torch.Tensor:
    """q `[B, Hq, D]` (one token per request) over pools `[slots, Hkv, D]` -> `[B, Hq, D]`.
    `new_kv` = (k, v `[B, Hkv, D]`, slots `[B]`): the step's K/V, written into the pools first
    (the slot of each request's newest token, i.e. position seq_len - 1 in its table row; rows
    with seq_len 0 store nothing). `norm_rope`: q and the new k are the raw projection output,
    normalised and rotated here (needs `new_kv`). `config` overrides `default_config` (block_n,
    num_warps, num_stages)."""
    batch, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    splits = num_splits or workspace.splits_for(batch)
    direct = splits == 1
    if direct:   # no partial results: each program writes its output
        mid_o, mid_lse, mid_strides = workspace.o, workspace.lse, (0, 0, 0, 0, 0)
    else:
        mid_o, mid_lse = workspace.views(batch, splits)
        mid_strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1))
    k_new, v_new, loc = new_kv if new_kv is not None else (q, q, seq_lens)   # unread unless STORE
    if norm_rope is not None and new_kv is None:
        raise ValueError("decode attention: norm_rope needs new_kv (the raw k to normalise and store)")
    qw, kw, pos, cos_sin, eps = norm_rope if norm_rope is not None else (q, q, seq_lens, q, 0.0)  # unread
    cfg = dict(default_config(d, direct), **config)
    pdl = launch_kwargs(q.device)
    # Only where a split's first tile is its whole share of the context the split count is planned
    # for (the smallest batches): where splits hold more, asking L2 for the first tile measured
    # slower, and at batch 8 even in a decode step (bench/RESULTS.md).
    one_tile = splits * cfg["block_n"] >= REFERENCE_CONTEXT
    prefetch = pdl["PDL"] and one_tile and _bulk_aligned(k_cache, v_cache)
    if one_tile and "num_stages" not in config:
        cfg["num_stages"] = ONE_TILE_STAGES
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_new.stride(-1) == 1 and v_new.stride(-1) == 1
    _decode_kernel[(batch, hkv, splits)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, workspace.counters,
        k_new, v_new, loc, out, qw, kw, pos, cos_sin, eps, scale * LOG2E, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0), *mid_strides, out.stride(0), out.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), cos_sin.stride(0),
        GROUP=group, D=d, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=cfg["block_n"],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=interpreter_upcast(q.dtype),
        DIRECT=direct, STORE=new_kv is not None, NORM_ROPE=norm_rope is not None, MERGE_UNROLL=cfg["merge_unroll"],
        PREFETCH=prefetch, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl,
    )
    return out
