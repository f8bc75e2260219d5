"""Varlen extend (prefill) attention over the paged KV cache (Triton), after SGLang's
extend_attention: the new tokens of many requests, packed request after request, attend to their
cached prefix (read from the pools through `req_to_token`) and causally to themselves (read
straight from the step's packed k/v, which are contiguous).

One program per (query head, request, BLOCK_M query rows), heaviest (last) row blocks launched
first. Both phases run whole tiles (BLOCK_NP prefix tokens, BLOCK_N new tokens) without masks
and mask only the prefix's tail tile and the tiles that cross the causal diagonal. Scores and softmax statistics in fp32 (base-2 exponentials
with the scale folded in). The grid uses the host's max extend length: prefill runs outside CUDA
graphs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from compiled.attention.triton_decode import LOG2E
from compiled.triton_utils import interpreter_upcast, tma_descriptor


@dataclass
class PrefixRows:
    """The last `prefix[b]` tokens of request b's prefix as contiguous rows `start[b]`.. of k / v
    `[rows, Hkv, D]` (a context-parallel step's gathered K/V, already normalised and rotated)."""
    k: torch.Tensor
    v: torch.Tensor
    prefix: torch.Tensor   # [batch] int
    start: torch.Tensor    # [batch] int


@triton.jit
def _softmax_step(acc, m_i, l_i, q, k, v, mask, sm_scale_log2,
                  MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * sm_scale_log2
    if MASKED:
        qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["First_request"])
def _extend_kernel(
    Q, K_new, V_new, O, K_cache, V_cache, Req_to_token, Req_pool_indices, Seq_lens, Extend_lens, Extend_start,
    K_desc, V_desc, sm_scale_log2, First_request,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kcs, stride_kch, stride_vcs, stride_vch, stride_r2t,
    K_rows, V_rows, Rows_prefix, Rows_start, K_rows_desc, V_rows_desc, stride_krt, stride_krh, stride_vrt, stride_vrh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_NP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    ROWS: tl.constexpr, ROWS_TMA: tl.constexpr,
):
    h = tl.program_id(0)
    b = tl.program_id(1) + First_request
    start_m = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_M
    EVEN_D: tl.constexpr = BLOCK_D == D
    ext = tl.load(Extend_lens + b).to(tl.int32)
    if start_m < ext:
        prefix = tl.load(Seq_lens + b).to(tl.int32) - ext
        q_start = tl.load(Extend_start + b).to(tl.int64)
        row = tl.load(Req_pool_indices + b).to(tl.int64)
        kvh = h // GROUP
        offs_m = start_m + tl.arange(0, BLOCK_M)
        mask_m = offs_m < ext
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        offs_n0 = tl.arange(0, BLOCK_N)
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        if UPCAST:   # see interpreter_upcast()
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # Phase 1: the cached prefix, gathered from the pools in tiles of BLOCK_NP tokens (with
        # ROWS, only the part before the prefix's last `Rows_prefix` tokens).
        in_rows = 0
        if ROWS:
            in_rows = tl.load(Rows_prefix + b).to(tl.int32)
            prefix -= in_rows
        offs_p0 = tl.arange(0, BLOCK_NP)
        r2t = Req_to_token + row * stride_r2t
        kc = K_cache + kvh * stride_kch + offs_d[None, :]
        vc = V_cache + kvh * stride_vch + offs_d[None, :]
        prefix_full = (prefix // BLOCK_NP) * BLOCK_NP
        for n0 in range(0, prefix_full, BLOCK_NP):
            slots = tl.load(r2t + n0 + offs_p0).to(tl.int64)
            if EVEN_D:
                k = tl.load(kc + slots[:, None] * stride_kcs)
                v = tl.load(vc + slots[:, None] * stride_vcs)
            else:
                k = tl.load(kc + slots[:, None] * stride_kcs, mask=mask_d[None, :], other=0.0)
                v = tl.load(vc + slots[:, None] * stride_vcs, mask=mask_d[None, :], other=0.0)
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, None, sm_scale_log2, False, DOT_PRECISION)
        if prefix_full < prefix:
            offs_n = prefix_full + offs_p0
            mask_n = offs_n < prefix
            slots = tl.load(r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(kc + slots[:, None] * stride_kcs, mask=kv_mask, other=0.0)
            v = tl.load(vc + slots[:, None] * stride_vcs, mask=kv_mask, other=0.0)
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, mask_n[None, :], sm_scale_log2, True,
                                          DOT_PRECISION)

        # Phase 1b (ROWS): the prefix's last tokens, contiguous rows of K_rows / V_rows from Rows_start.
        if ROWS:
            r0 = tl.load(Rows_start + b).to(tl.int64)
            kr = K_rows + (r0 + offs_n0)[:, None] * stride_krt + kvh * stride_krh + offs_d[None, :]
            vr = V_rows + (r0 + offs_n0)[:, None] * stride_vrt + kvh * stride_vrh + offs_d[None, :]
            rows_full = (in_rows // BLOCK_N) * BLOCK_N
            for n0 in range(0, rows_full, BLOCK_N):
                if ROWS_TMA:
                    k = K_rows_desc.load([(r0 + n0).to(tl.int32), kvh * D])
                    v = V_rows_desc.load([(r0 + n0).to(tl.int32), kvh * D])
                else:
                    k = tl.load(kr + n0 * stride_krt, mask=mask_d[None, :], other=0.0)
                    v = tl.load(vr + n0 * stride_vrt, mask=mask_d[None, :], other=0.0)
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, None, sm_scale_log2, False, DOT_PRECISION)
            if rows_full < in_rows:
                mask_n = (rows_full + offs_n0) < in_rows
                kv_mask = mask_n[:, None] & mask_d[None, :]
                k = tl.load(kr + rows_full * stride_krt, mask=kv_mask, other=0.0)
                v = tl.load(vr + rows_full * stride_vrt, mask=kv_mask, other=0.0)
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, mask_n[None, :], sm_scale_log2, True,
                                              DOT_PRECISION)

        # Phase 2: the new tokens, causal; tiles wholly below the diagonal need no mask.
        kn = K_new + (q_start + offs_n0)[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
        vn = V_new + (q_start + offs_n0)[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :]
        below = (start_m // BLOCK_N) * BLOCK_N
        for n0 in range(0, below, BLOCK_N):
            if TMA:   # K_desc / V_desc: the new tokens' k / v as [T, Hkv * D] (EVEN_D)
                k = K_desc.load([(q_start + n0).to(tl.int32), kvh * D])
                v = V_desc.load([(q_start + n0).to(tl.int32), kvh * D])
            elif EVEN_D:
                k = tl.load(kn + n0 * stride_kt)
                v = tl.load(vn + n0 * stride_vt)
            else:
                k = tl.load(kn + n0 * stride_kt, mask=mask_d[None, :], other=0.0)
                v = tl.load(vn + n0 * stride_vt, mask=mask_d[None, :], other=0.0)
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, None, sm_scale_log2, False, DOT_PRECISION)
        end_n = tl.minimum(start_m + BLOCK_M, ext)
        for n0 in range(below, end_n, BLOCK_N):
            offs_n = n0 + offs_n0
            kv_mask = (offs_n < ext)[:, None] & mask_d[None, :]
            k = tl.load(kn + n0 * stride_kt, mask=kv_mask, other=0.0)
            v = tl.load(vn + n0 * stride_vt, mask=kv_mask, other=0.0)
            causal = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] < ext)
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, causal, sm_scale_log2, True, DOT_PRECISION)

        out = acc / l_i[:, None]
        tl.store(O + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


# At most this many new tokens and cached prefix tokens per request: 64-row query tiles (twice the
# programs, better balanced over the SMs). With 2,048 new tokens they win up to a 256-token prefix,
# tie at 512 and lose from 1,024 on (bench/RESULTS.md).
SHORT_EXTEND, SHORT_PREFIX = 2048, 512


def default_config(head_dim: int, max_extend_len: int | None = None, max_prefix_len: int | None = None) -> dict:
    """Query rows, new-token and prefix tile sizes, warps, pipeline stages and whether the new
    tokens' whole tiles come through TMA, tuned on an H200 (triton 3.6; bench/RESULTS.md): at
    head_dim 128 the gathered prefix runs best in 128-token tiles, the causal part in
    64, and a short prompt with little prefix in 64-row query tiles (2k tokens: 90.8 against 98.7 µs)."""
    if head_dim <= 64:
        return dict(block_m=128, block_n=64, block_np=64, num_warps=4, num_stages=3, tma=False)
    if head_dim <= 128:
        short = max_extend_len is not None and max_extend_len <= SHORT_EXTEND
        if short and max_prefix_len is not None and max_prefix_len <= SHORT_PREFIX:
            return dict(block_m=64, block_n=64, block_np=64, num_warps=4, num_stages=3, tma=True)
        return dict(block_m=128, block_n=64, block_np=128, num_warps=8, num_stages=4, tma=True)
    return dict(block_m=64, block_n=32, block_np=32, num_warps=8, num_stages=2, tma=False)


def _new_token_desc(x: torch.Tensor, block_n: int):
    """TMA descriptor over the new tokens' k or v `[T, Hkv, D]` seen as `[T, Hkv * D]`, block
    `[block_n, D]` (one head's rows); None where TMA cannot take it."""
    t, hkv, d = x.shape
    if x.stride(1) != d or x.stride(2) != 1 or d != triton.next_power_of_2(d):
        return None
    return tma_descriptor(x.as_strided((t, hkv * d), (x.stride(0), 1)), [block_n, d])


def extend_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                            req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                            extend_start_loc: torch.Tensor, max_extend_len: int, scale: float,
                            out: torch.Tensor | None = None, max_prefix_len: int | None = None,
                            rows: PrefixRows | None = None, first_request: int = 0, **config) -> torch.Tensor:
    """q `[T, Hq, D]`, k/v `[T, Hkv, D]` (new tokens, packed request after request; they need not be
    stored yet) with each request's prefix `seq_lens - extend_lens` read from the pools -> `[T, Hq, D]`.
    `max_prefix_len` (None: unknown, taken as long) picks the tiles with `max_extend_len`. `rows`:
    the prefixes' last tokens are also contiguous rows elsewhere, read there (no gather).
    `first_request`: only requests first_request.. attend (their rows of `out`), an offset rather
    than slices of the per-request arrays, which would start unaligned and compile again."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if out is None:
        out = torch.empty_like(q)
    batch = req_pool_indices.shape[0] - first_request
    if t == 0 or batch <= 0 or max_extend_len <= 0:
        return out
    cfg = dict(default_config(d, max_extend_len, max_prefix_len), **config)
    block_d = max(16, triton.next_power_of_2(d))
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and out.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    grid = (hq, batch, triton.cdiv(max_extend_len, cfg["block_m"]))
    k_desc = v_desc = None
    if cfg["tma"]:
        k_desc, v_desc = _new_token_desc(k, cfg["block_n"]), _new_token_desc(v, cfg["block_n"])
        if k_desc is None or v_desc is None:
            k_desc = v_desc = None
    kr, vr = (rows.k, rows.v) if rows is not None else (k, v)
    kr_desc = vr_desc = None
    if rows is not None and cfg["tma"]:
        kr_desc, vr_desc = _new_token_desc(kr, cfg["block_n"]), _new_token_desc(vr, cfg["block_n"])
        if kr_desc is None or vr_desc is None:
            kr_desc = vr_desc = None
    _extend_kernel[grid](
        q, k, v, out, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_lens, extend_start_loc,
        k_desc, v_desc, scale * LOG2E, first_request,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0),
        kr, vr, rows.prefix if rows is not None else seq_lens, rows.start if rows is not None else seq_lens,
        kr_desc, vr_desc, kr.stride(0), kr.stride(1), vr.stride(0), vr.stride(1),
        GROUP=hq // hkv, D=d, BLOCK_D=block_d, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
        BLOCK_NP=cfg["block_np"],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreter_upcast(q.dtype), TMA=k_desc is not None,
        ROWS=rows is not None, ROWS_TMA=kr_desc is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
