"""Triton attention kernels (store, flash-decoding, varlen extend) against their torch references.

CPU: the kernels run under `TRITON_INTERPRET=1` in a subprocess per group (the variable only
takes effect for kernels defined after it is set, so setting it in this process could turn every
later Triton kernel of the test process, GPU runs included, into an interpreted one). The subprocess
runs this file as a script. GPU (`-m gpu`): the same comparisons at real sizes in bf16."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from compiled.attention.reference import (NormRope, decode_attention_ref, extend_attention_ref,  # noqa: E402
                                         norm_rope_ref, store_kv)
from compiled.functional import rope_cos_sin  # noqa: E402
from tests.conftest import child_env  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


# ----------------------------------------------------------------------------------------------
# Random paged batches (scattered slots, rows of the table out of order, junk after each row's end)

def paged_batch(seq_lens, hkv, d, dtype, device="cpu", seed=0, extra_rows=3):
    g = torch.Generator(device="cpu").manual_seed(seed)
    b, total = len(seq_lens), sum(seq_lens)
    num_slots = total + 11
    k_cache = torch.randn(num_slots + 1, hkv, d, generator=g).to(device, dtype)
    v_cache = torch.randn(num_slots + 1, hkv, d, generator=g).to(device, dtype)
    slots = (torch.randperm(num_slots, generator=g)[:total] + 1).to(torch.int32)
    max_ctx = max(seq_lens, default=1) + 5
    table = torch.randint(1, num_slots + 1, (b + extra_rows, max_ctx), generator=g, dtype=torch.int32)
    rows = torch.randperm(b + extra_rows, generator=g)[:b]
    off = 0
    for row, s in zip(rows.tolist(), seq_lens):
        table[row, :s] = slots[off:off + s]
        off += s
    return k_cache, v_cache, table.to(device), rows.to(device)


def randn(shape, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device, dtype)


def max_err(a, b):
    """Largest difference, relative where |b| > 1 (bf16 outputs near 3 are 1/64 apart)."""
    a, b = a.float(), b.float()
    return ((a - b).abs() / b.abs().clamp(min=1.0)).max().item()


# ----------------------------------------------------------------------------------------------
# Cases: each returns (error, tolerance)

def store_case(t, hkv, d, dtype, cache_dtype, fused_view, device="cpu"):
    from compiled.attention.triton_store import store_kv_triton
    k_cache, v_cache, _, _ = paged_batch([t], hkv, d, cache_dtype, device)
    loc = torch.randperm(k_cache.shape[0] - 1)[:t].add(1).to(device)
    if fused_view:   # k and v as views of one [T, (2 * hkv + 1) * d] projection output
        qkv = randn((t, (2 * hkv + 1) * d), dtype, device, 5)
        k = qkv[:, d:(hkv + 1) * d].view(t, hkv, d)
        v = qkv[:, (hkv + 1) * d:].view(t, hkv, d)
    else:
        k, v = randn((t, hkv, d), dtype, device, 6), randn((t, hkv, d), dtype, device, 7)
    kr, vr = k_cache.clone(), v_cache.clone()
    store_kv(kr, vr, loc, k, v)
    store_kv_triton(k_cache, v_cache, loc, k, v)
    return max(max_err(kr, k_cache), max_err(vr, v_cache)), 0.0


def random_norm_rope(t, d, dtype, device, seed, max_positions=4096):
    """Norm weights around 1, positions anywhere in a RoPE table (Qwen3's theta)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    weights = [(1 + 0.3 * torch.randn(d, generator=g)).to(device, dtype) for _ in range(2)]
    positions = torch.randint(0, max_positions, (t,), generator=g).to(device)
    return NormRope(*weights, positions, rope_cos_sin(d, 1e6, max_positions, device), 1e-6)


def decode_case(seq_lens, hq, hkv, d, dtype, num_splits, device="cpu", seed=0, graph=False, store=False,
                norm_rope=False, then_lens=None, **config):
    """With `store`, the kernel also writes the step's K/V (at each request's newest slot) first;
    the pools it leaves are compared with the reference's too. With `norm_rope` (needs `store`), q
    and the new k are raw and the kernel normalises and rotates them (reference: norm_rope_ref).
    With `graph`, captured once and replayed over new lengths, queries (and K/V) written in place;
    the merge counters must have been left at zero by the first call for the replay to be right.
    With `then_lens` (no longer than seq_lens), a second call over those lengths, on the same
    workspace, is the one compared: its live splits differ from the first call's."""
    from compiled.attention.triton_decode import DecodeWorkspace, decode_attention_triton
    k_cache, v_cache, table, rows = paged_batch(seq_lens, hkv, d, dtype, device, seed)
    b = len(seq_lens)
    q = randn((b, hq, d), dtype, device, seed + 1)
    k_new, v_new = randn((b, hkv, d), dtype, device, seed + 3), randn((b, hkv, d), dtype, device, seed + 4)
    lens = torch.tensor(seq_lens, device=device)
    scale = d ** -0.5
    ws = DecodeWorkspace(max(64, b), hq, hkv, d, torch.device(device), min_rows=b * (num_splits or 1))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    rope = random_norm_rope(b, d, dtype, device, seed + 5) if norm_rope else None

    def newest_slots():
        return table[rows, (lens - 1).clamp(min=0)].long()

    def run():
        new_kv = (k_new, v_new, newest_slots()) if store else None
        return decode_attention_triton(q, k_cache, v_cache, table, rows, lens, scale, ws, num_splits,
                                       new_kv=new_kv, norm_rope=rope, **config)

    def reference():
        q_ref, k_new_ref = norm_rope_ref(q, k_new, rope) if norm_rope else (q, k_new)
        if store:
            store_kv(k_ref, v_ref, newest_slots(), k_new_ref, v_new)
        return decode_attention_ref(q_ref, k_ref, v_ref, table, rows, lens, int(lens.max()), scale)

    if graph:   # capture once, then replay over new lengths and queries written in place
        run()
        torch.cuda.synchronize()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            out = run()
        lens.copy_(torch.tensor([max(1, s - 17 * i) for i, s in enumerate(seq_lens)], device=device))
        q.copy_(randn((b, hq, d), dtype, device, seed + 2))
        k_cache.copy_(k_ref), v_cache.copy_(v_ref)
        cg.replay()
        torch.cuda.synchronize()
    elif then_lens is not None:
        run()
        lens.copy_(torch.tensor(then_lens, device=device))
        out = run()
    else:
        out = run()
    err = max_err(out, reference())
    if store:
        err = max(err, max_err(k_cache, k_ref), max_err(v_cache, v_ref))
    return err, TOL[dtype] * (truncation(dtype) if norm_rope else 1.0)


def decode_padding_case(splits, device="cpu"):
    """A request with no cached tokens (a padding row of a captured batch) gets zeros, not NaN."""
    from compiled.attention.triton_decode import DecodeWorkspace, decode_attention_triton
    k_cache, v_cache, table, rows = paged_batch([5, 0], 1, 16, torch.float32, device)
    q = randn((2, 2, 16), torch.float32, device, 3)
    ws = DecodeWorkspace(8, 2, 1, 16, torch.device(device), min_rows=2 * splits)
    out = torch.full_like(q, float("nan"))
    decode_attention_triton(q, k_cache, v_cache, table, rows, torch.tensor([5, 0], device=device), 0.25, ws,
                            splits, out=out)
    return out[1].abs().max().item() + float(torch.isnan(out).any()), 0.0


def norm_rope_store_case(t, hq, hkv, d, dtype, device="cpu", seed=0, store_only=False):
    """The extend path's prologue: normalised and rotated q/k against the model's own layers
    (exact: the kernel rounds where they do, up to the order of the sum of squares), and K/V
    stored into the pools, from views of one fused projection output. `store_only`: no q (a
    context-parallel step's every-rank K/V)."""
    from compiled.attention.triton_norm_rope import norm_rope_store_triton
    k_cache, v_cache, _, _ = paged_batch([t], hkv, d, dtype, device, seed)
    loc = torch.randperm(k_cache.shape[0] - 1)[:t].add(1).to(device)
    qkv = randn((t, (hq + 2 * hkv) * d), dtype, device, seed + 1) * 3
    q, k, v = (part.view(t, -1, d) for part in qkv.split([hq * d, hkv * d, hkv * d], -1))
    rope = random_norm_rope(t, d, dtype, device, seed + 2)
    kr, vr = k_cache.clone(), v_cache.clone()
    q_ref, k_ref = norm_rope_ref(q, k, rope)
    store_kv(kr, vr, loc, k_ref, v)
    if store_only:
        q_out, k_out = norm_rope_store_triton(None, k, v, k_cache, v_cache, loc, rope)
        assert q_out is None
        errs = [scaled_err(k_out, k_ref), scaled_err(k_cache, kr), max_err(v_cache, vr)]
    else:
        q_out, k_out = norm_rope_store_triton(q, k, v, k_cache, v_cache, loc, rope)
        errs = [scaled_err(q_out, q_ref), scaled_err(k_out, k_ref), scaled_err(k_cache, kr), max_err(v_cache, vr)]
    # Rounding steps of the largest values: products and sums round where the model's do, and
    # their sum may cancel.
    return max(errs), {torch.float32: 2e-6, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}[dtype] * truncation(dtype)


def truncation(dtype) -> float:
    """Tolerance factor for kernels that round to bf16 several times (norm/RoPE): Triton's CPU
    interpreter converts fp32 to bf16 toward zero, not to nearest, and five such roundings in a
    row drift up to four times further (the GPU tests hold the unscaled bound)."""
    return 4.0 if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1" else 1.0


def scaled_err(a, b):
    """Largest difference over the reference's largest magnitude."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max()).item()


def prefix_rows(k_cache, v_cache, table, rows, prefix_lens, seed):
    """`PrefixRows` holding the last two thirds (+1) of each prefix, copied out of the pools, with
    a random row between requests (the kernel must start where `start` says)."""
    from compiled.attention.triton_extend import PrefixRows
    ks, vs, counts, starts, at = [], [], [], [], 0
    for i, (r, p) in enumerate(zip(rows.tolist(), prefix_lens)):
        n = min(p, 2 * p // 3 + 1)
        slots = table[r, p - n:p].long()
        junk = randn((1, *k_cache.shape[1:]), k_cache.dtype, k_cache.device, seed + i)
        ks += [junk, k_cache[slots]]
        vs += [junk, v_cache[slots]]
        counts.append(n)
        starts.append(at + 1)
        at += n + 1
    dev = k_cache.device
    return PrefixRows(torch.cat(ks), torch.cat(vs), torch.tensor(counts, device=dev), torch.tensor(starts, device=dev))


def extend_case(prefix_lens, ext_lens, hq, hkv, d, dtype, device="cpu", seed=0, packed=False, in_rows=False,
                **config):
    """`packed`: q, k and v are views of one `[T, Hq + 2 Hkv, D]` projection output, as in the model.
    `in_rows`: most of each prefix read from contiguous rows (`prefix_rows`) instead of the pools."""
    from compiled.attention.triton_extend import _new_token_desc, default_config, extend_attention_triton
    seq_lens = [p + e for p, e in zip(prefix_lens, ext_lens)]
    k_cache, v_cache, table, rows = paged_batch(seq_lens, hkv, d, dtype, device, seed)
    t = sum(ext_lens)
    if packed:
        q, k, v = randn((t, hq + 2 * hkv, d), dtype, device, seed + 1).split([hq, hkv, hkv], dim=1)
    else:
        q = randn((t, hq, d), dtype, device, seed + 1)
        k, v = randn((t, hkv, d), dtype, device, seed + 2), randn((t, hkv, d), dtype, device, seed + 3)
    if config.get("tma"):  # the case is about the TMA path: it must not fall back to pointer loads
        block_n = dict(default_config(d), **config)["block_n"]
        assert _new_token_desc(k, block_n) is not None and _new_token_desc(v, block_n) is not None
    loc = torch.cat([table[r, p:s].long() for r, p, s in zip(rows.tolist(), prefix_lens, seq_lens)])
    store_kv(k_cache, v_cache, loc, k, v)
    scale = d ** -0.5
    ref = extend_attention_ref(q, k_cache, v_cache, table, rows.tolist(), seq_lens, ext_lens, scale)
    starts = torch.tensor([sum(ext_lens[:i]) for i in range(len(ext_lens))], device=device)
    extra = dict(rows=prefix_rows(k_cache, v_cache, table, rows, prefix_lens, seed + 4)) if in_rows else {}
    out = extend_attention_triton(q, k, v, k_cache, v_cache, table, rows, torch.tensor(seq_lens, device=device),
                                  torch.tensor(ext_lens, device=device), starts, max(ext_lens), scale, **extra,
                                  **config)
    return max_err(out, ref), TOL[dtype]


# (prefix lengths, new tokens) of the op's layouts; "mixed": one-token requests (a decode, a
# one-token prompt, a long decode) first, as the scheduler orders a mixed step, then prompts;
# "decode_rows": every request one token in a step that is not a decode step (padded);
# "short_chunks": chunks of a few tokens (with and without a prefix) among the leading requests,
# whose every token is a decode row (`token_rows`), then prompts; "short_only": no prompts after.
OP_LAYOUTS = {"decode": ([9, 0, 130], [1, 1, 1]), "extend": ([0, 40, 77], [23, 1, 60]),
              "mixed": ([9, 0, 130, 0, 40], [1, 1, 1, 23, 60]), "decode_rows": ([9, 0, 130], [1, 1, 1]),
              "short_chunks": ([9, 0, 130, 57, 40], [1, 5, 1, 7, 60]), "short_only": ([9, 140, 0], [1, 7, 3])}
DECODE_ROWS = {"mixed": 3, "decode_rows": 3, "short_chunks": 4, "short_only": 3}


def op_case(decode: bool, device="cpu", norm_rope=False, cp=False, layout: str | None = None):
    """The `compiled::attention` op on the Triton backend vs the torch backend (store included),
    with metadata built without `extend_start_loc` (computed on the device); with `norm_rope`,
    q/k raw and the per-head norm and RoPE arguments given (the fuse_qk_norm_rope form). With `cp`
    the Triton side runs as a one-rank context-parallel step (`cp_step_case`). `layout` (default
    "decode" or "extend" as `decode` says): one of OP_LAYOUTS; in "mixed" and "decode_rows" the
    leading one-token requests are the metadata's `decode_rows` (the decode kernel's)."""
    import compiled.attention.ops as ops
    from compiled.attention.context import AttentionContext, AttentionMetadata
    from compiled.forward_context import forward_context
    from compiled.attention.kv_cache import KVPool
    hq, hkv, d, layer = 4, 2, 32, 1
    layout = layout or ("decode" if decode else "extend")
    prefix, ext = OP_LAYOUTS[layout]
    decode_rows = DECODE_ROWS.get(layout, 0)
    seq = [p + e for p, e in zip(prefix, ext)]
    outs, pools = [], []
    for backend in ("torch", "triton"):
        kv = KVPool(2, sum(seq) + 4, hkv, d, torch.float32, torch.device(device))
        g = torch.Generator().manual_seed(0)
        for pool in kv.k + kv.v:
            pool.copy_(torch.randn(pool.shape, generator=g))
        table = torch.zeros(5, 200, dtype=torch.int32, device=device)
        rows, loc, nxt = [3, 0, 2, 4, 1][:len(seq)], [], 1
        for r, p, s in zip(rows, prefix, seq):
            table[r, :s] = torch.arange(nxt, nxt + s, dtype=torch.int32)
            loc += list(range(nxt + p, nxt + s))
            nxt += s
        meta = AttentionMetadata(
            out_cache_loc=torch.tensor(loc, device=device), req_pool_indices=torch.tensor(rows, device=device),
            seq_lens=torch.tensor(seq, device=device), extend_lens=torch.tensor(ext, device=device),
            req_pool_indices_cpu=rows, seq_lens_cpu=seq, extend_lens_cpu=ext, is_decode=decode,
            decode_rows=decode_rows)
        if layout.startswith("short"):   # each leading token a row: its request's row, its context
            lead = list(zip(rows, prefix, ext))[:decode_rows]
            meta.token_rows = torch.tensor([r for r, _, e in lead for _ in range(e)], device=device)
            meta.token_positions = torch.tensor([p + i for _, p, e in lead for i in range(e)], device=device)
        t = sum(ext)
        q, k, v = randn((t, hq, d), torch.float32, device, 1), randn((t, hkv, d), torch.float32, device, 2), \
            randn((t, hkv, d), torch.float32, device, 3)
        ops.set_backend(backend)
        try:
            rope = random_norm_rope(t, d, torch.float32, device, 4) if norm_rope else ()
            if cp and backend == "triton":
                outs.append(cp_step_case(meta, kv, table, q, k, v, layer, rope, prefix, ext))
            else:
                with forward_context(AttentionContext(meta=meta, kv=kv, req_to_token=table)):
                    outs.append(torch.ops.compiled.attention(q, k, v, layer, d ** -0.5, *rope))
        finally:
            ops.set_backend("auto")
        pools.append(kv)
    err = max(max_err(outs[0], outs[1]), max_err(pools[0].k[layer], pools[1].k[layer]),
              max_err(pools[0].v[layer], pools[1].v[layer]))
    return err, TOL[torch.float32]


def cp_step_case(meta, kv, table, q, k, v, layer, rope, prefix, ext):
    """The op in a context-parallel step of one rank: every request a split chunk cut into its
    two zigzag segments (each attending as a request of its own, the part of its prefix inside
    the step read from the gathered rows), k_full / v_full being the step's own k / v."""
    from compiled.attention.context import AttentionContext, AttentionMetadata
    from compiled.forward_context import forward_context
    from compiled.parallel.context import CPStep
    from compiled.parallel.zigzag import ChunkShape, plan
    device, t, d = q.device, q.shape[0], q.shape[-1]
    shapes, offset = [], 0
    for p, e in zip(prefix, ext):
        shapes.append(ChunkShape(offset, p, e, e >= 2))
        offset += e
    segments = plan(shapes, 1).segments[0]
    rows = [meta.req_pool_indices_cpu[s.chunk] for s in segments]
    seq = [s.position + s.length for s in segments]
    lens = [s.length for s in segments]

    def dev(x):
        return torch.tensor(x, device=device)

    seg_meta = AttentionMetadata(out_cache_loc=meta.out_cache_loc, req_pool_indices=dev(rows), seq_lens=dev(seq),
                                 extend_lens=dev(lens), req_pool_indices_cpu=rows, seq_lens_cpu=seq,
                                 extend_lens_cpu=lens, is_decode=False)
    positions = rope[2] if rope else dev(list(range(t)))
    step = CPStep(None, 1, 0, t, dev(list(range(t))), positions, meta.out_cache_loc,
                  rows_prefix=dev([s.position - shapes[s.chunk].position for s in segments]),
                  rows_start=dev([shapes[s.chunk].offset for s in segments]))
    k_full, v_full = torch.cat([k, v], 1).chunk(2, 1)   # views of one gathered tensor, as the cp_allgather pass makes
    with forward_context(AttentionContext(meta=seg_meta, kv=kv, req_to_token=table), cp=step):
        return torch.ops.compiled.attention(q, k, v, layer, d ** -0.5, *rope, k_full=k_full, v_full=v_full)


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
MIXED = [1, 7, 300, 65, 128, 33]          # lengths 1..300, several ending mid-split / mid-tile

CPU_GROUPS = {
    "store": [
        ("store_f32_T37_h3_d24", lambda: store_case(37, 3, 24, F32, F32, False)),
        ("store_bf16_fused_view_h2_d64", lambda: store_case(19, 2, 64, BF16, BF16, True)),
        ("store_f32_into_f16_cache", lambda: store_case(5, 1, 128, F32, F16, False)),
    ],
    "decode": [
        ("decode_gqa1_d64_splits1", lambda: decode_case(MIXED, 2, 2, 64, F32, 1)),
        ("decode_gqa1_d64_splits5", lambda: decode_case(MIXED, 2, 2, 64, F32, 5)),
        ("decode_gqa4_d128_splits3", lambda: decode_case([300, 1, 64, 200, 129], 4, 1, 128, F32, 3)),
        ("decode_gqa8_d128_splits1", lambda: decode_case([300, 1, 64, 129], 8, 1, 128, F32, 1)),
        ("decode_gqa8_d64_splits7", lambda: decode_case([1, 299, 97, 64], 8, 1, 64, F32, 7)),
        ("decode_gqa4_d24_auto_splits", lambda: decode_case([13, 250, 2], 8, 2, 24, F32, None)),
        ("decode_gqa4_d64_bf16", lambda: decode_case([120, 3, 257], 4, 1, 64, BF16, 2)),
        ("decode_gqa8_d128_f16", lambda: decode_case([77, 200], 8, 1, 128, F16, 4)),
        # 19 non-empty splits of 16 tokens: the merge walks two chunks of splits
        ("decode_gqa4_d64_19_live_splits", lambda: decode_case([300, 5, 260], 4, 1, 64, F32, 32, block_n=16)),
        # only the splits holding tokens bump the merge counter: a second call with other live
        # counts (2, 1, 17 of 32) finds the counters the first left at zero
        ("decode_live_splits_change_between_calls",
         lambda: decode_case([300, 5, 260], 4, 1, 64, F32, 32, then_lens=[20, 5, 259], block_n=16)),
        ("decode_store_gqa4_d64_splits3", lambda: decode_case([1, 300, 64, 129], 4, 1, 64, F32, 3, store=True)),
        ("decode_store_gqa1_d24_splits1", lambda: decode_case([1, 77, 5], 2, 2, 24, F32, 1, store=True)),
        ("decode_norm_rope_gqa4_d64_splits3", lambda: decode_case([1, 300, 64, 129], 4, 1, 64, F32, 3, store=True,
                                                                  norm_rope=True)),
        ("decode_norm_rope_gqa1_d24_splits1", lambda: decode_case([1, 77, 5], 2, 2, 24, F32, 1, store=True,
                                                                  norm_rope=True)),
        ("decode_norm_rope_gqa8_d128_bf16", lambda: decode_case([200, 3], 8, 1, 128, BF16, 2, store=True,
                                                                norm_rope=True)),
        # one split: the newest token lies past the first tile, read back from the pool
        ("decode_norm_rope_gqa8_d128_bf16_splits1", lambda: decode_case([200, 3], 8, 1, 128, BF16, 1, store=True,
                                                                        norm_rope=True)),
        ("decode_padding_row_is_zero_splits3", lambda: decode_padding_case(3)),
        ("decode_padding_row_is_zero_splits1", lambda: decode_padding_case(1)),
    ],
    "norm_rope": [
        ("norm_rope_store_f32_T37_gqa4_d64", lambda: norm_rope_store_case(37, 8, 2, 64, F32)),
        ("norm_rope_store_bf16_T19_gqa8_d128", lambda: norm_rope_store_case(19, 8, 1, 128, BF16)),
        ("norm_rope_store_f32_T5_mha_d24", lambda: norm_rope_store_case(5, 3, 3, 24, F32)),
        ("norm_rope_store_only_f32_T23_gqa4_d64", lambda: norm_rope_store_case(23, 8, 2, 64, F32, store_only=True)),
        ("norm_rope_store_only_bf16_T7_gqa8_d128", lambda: norm_rope_store_case(7, 8, 1, 128, BF16, store_only=True)),
    ],
    "extend": [
        # empty and long prefixes, batches mixing extend lengths 1..300
        ("extend_gqa1_d64_mixed", lambda: extend_case([0, 50, 0, 211], [1, 37, 100, 64], 2, 2, 64, F32)),
        ("extend_gqa4_d128_long", lambda: extend_case([0, 3], [300, 1], 4, 1, 128, F32)),
        ("extend_gqa4_d128_short_prompt_tiles", lambda: extend_case([0, 3], [300, 1], 4, 1, 128, F32,
                                                                    max_prefix_len=3)),
        ("extend_gqa8_d64_small_tiles", lambda: extend_case([299, 0, 17], [1, 150, 40], 8, 1, 64, F32,
                                                            block_m=32, block_n=16, block_np=16)),
        ("extend_gqa4_d24_f16", lambda: extend_case([5, 64], [70, 2], 4, 1, 24, F16, block_m=32, block_n=32,
                                                    block_np=32)),
        ("extend_gqa4_d64_bf16", lambda: extend_case([100], [33], 4, 1, 64, BF16)),
        ("extend_prefix_rows_gqa2_d64", lambda: extend_case([0, 50, 211, 3], [37, 1, 64, 20], 4, 2, 64, F32,
                                                            in_rows=True, block_m=32, block_n=16, block_np=16)),
        ("extend_prefix_rows_gqa4_d24_bf16", lambda: extend_case([70, 130], [33, 5], 4, 1, 24, BF16, in_rows=True,
                                                                 block_m=32, block_n=32, block_np=32)),
        # the new tokens' whole tiles through TMA descriptors, k/v contiguous and as views of qkv
        ("extend_gqa4_d64_bf16_tma", lambda: extend_case([0, 40, 7], [150, 70, 33], 4, 2, 64, BF16, block_m=64,
                                                         block_n=16, block_np=16, tma=True)),
        ("extend_gqa2_d32_f16_tma_packed", lambda: extend_case([3, 0], [90, 41], 4, 2, 32, F16, packed=True,
                                                               block_m=32, block_n=16, block_np=16, tma=True)),
    ],
    "op": [
        ("op_decode_triton_vs_torch", lambda: op_case(True)),
        ("op_extend_triton_vs_torch", lambda: op_case(False)),
        ("op_decode_norm_rope_triton_vs_torch", lambda: op_case(True, norm_rope=True)),
        ("op_extend_norm_rope_triton_vs_torch", lambda: op_case(False, norm_rope=True)),
        ("op_cp_step_triton_vs_torch", lambda: op_case(False, cp=True)),
        ("op_cp_step_norm_rope_triton_vs_torch", lambda: op_case(False, norm_rope=True, cp=True)),
        ("op_mixed_decode_rows_triton_vs_torch", lambda: op_case(False, layout="mixed")),
        ("op_mixed_decode_rows_norm_rope_triton_vs_torch", lambda: op_case(False, norm_rope=True, layout="mixed")),
        ("op_only_decode_rows_triton_vs_torch", lambda: op_case(False, norm_rope=True, layout="decode_rows")),
        ("op_short_chunks_norm_rope_triton_vs_torch", lambda: op_case(False, norm_rope=True, layout="short_chunks")),
        ("op_short_chunks_triton_vs_torch", lambda: op_case(False, layout="short_chunks")),
        ("op_short_only_norm_rope_triton_vs_torch", lambda: op_case(False, norm_rope=True, layout="short_only")),
    ],
}


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, list[dict]]:
    """Every CPU group in one subprocess (one import of torch and triton)."""
    env = child_env(TRITON_INTERPRET="1", COMPILED_ATTENTION_BACKEND=None)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *CPU_GROUPS], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("group", list(CPU_GROUPS))
def test_interpreted_kernels_match_reference(interpreted_results, group):
    results = interpreted_results[group]
    assert [r["case"] for r in results] == [name for name, _ in CPU_GROUPS[group]]
    bad = [r for r in results if not r["err"] <= r["tol"]]
    assert not bad, bad


def test_split_count_leaves_each_split_enough_tokens():
    """Short-context batches are latency-bound: at most REFERENCE_CONTEXT / MIN_SPLIT_TOKENS splits
    (batch 1 of the 30B shape: 16, where 64 filled the waves); a batch that fills the GPU alone is
    not split."""
    from compiled.attention.triton_decode import MIN_SPLIT_TOKENS, REFERENCE_CONTEXT, num_kv_splits
    most = REFERENCE_CONTEXT // MIN_SPLIT_TOKENS
    counts = [num_kv_splits(b, 4, 132) for b in range(1, 257)]
    assert all(1 <= s <= most for s in counts)
    assert counts[0] == most and counts[255] == 1


def test_split_count_keeps_programs_in_one_wave():
    """The most splits whose programs all fit at once (3 an SM of 132: 396): the 30B's 4 KV heads
    at batch 48 take 2 (384 programs), at 64 one (512 would make a second wave)."""
    from compiled.attention.triton_decode import num_kv_splits
    counts = {b: num_kv_splits(b, 4, 132, programs_per_sm=3) for b in range(1, 257)}
    assert counts[8] == 12 and counts[48] == 2 and counts[64] == 1 and counts[99] == 1
    assert all(b * 4 * s <= 396 for b, s in counts.items() if s > 1)
    assert all(b * 4 * (s + 1) > 396 or s == 16 for b, s in counts.items() if b * 4 <= 396)
    assert all(counts[b] >= counts[b + 1] for b in range(1, 256))


def test_cpu_backend_is_torch_and_env_is_validated():
    import compiled.attention.ops as ops
    assert ops.backend_for(torch.zeros(1)) in ("torch", "triton")
    assert ops.BACKEND.name != "auto" or ops.backend_for(torch.zeros(1)) == "torch"
    with pytest.raises(ValueError, match="COMPILED_ATTENTION_BACKEND"):
        ops.set_backend("cuda")


# ----------------------------------------------------------------------------------------------
# GPU: real sizes (Qwen3-30B-A3B heads: 32 q / 4 kv, d=128), bf16, contexts up to 8k

def _lens(n, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def test_norm_rope_arguments_come_together():
    """The fused form needs every norm/RoPE argument: a partial set is a one-line error naming
    what is missing (before any cache is touched), and mismatched norm weights name both dtypes."""
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    w = torch.ones(8)
    with pytest.raises(ValueError, match=r"k_norm, cos_sin missing"):
        torch.ops.compiled.attention(q, k, k, 0, 0.3, w, None, torch.zeros(2, dtype=torch.long), None, 1e-6)
    with pytest.raises(ValueError, match=r"norm weights are torch.bfloat16/torch.float32, q is torch.float32"):
        torch.ops.compiled.attention(q, k, k, 0, 0.3, w.bfloat16(), w, torch.zeros(2, dtype=torch.long),
                                     torch.zeros(16, 8), 1e-6)


@pytest.mark.gpu
def test_gpu_store_real_size():
    err, tol = store_case(4096, 4, 128, BF16, BF16, True, device="cuda")
    assert err <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("batch,hi,splits", [(1, 8192, None), (16, 8192, None), (64, 2048, None),
                                             (7, 8192, 5), (3, 8191, 64), (1, 512, None)])
def test_gpu_decode_real_size(batch, hi, splits):
    lens = _lens(batch, 1, hi, batch) if batch > 1 else [hi]
    err, tol = decode_case(lens, 32, 4, 128, BF16, splits, device="cuda", store=batch % 2 == 1)
    assert err <= tol, err


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d", [(16, 2, 64), (16, 4, 256), (16, 16, 128), (8, 1, 24)])
def test_gpu_decode_head_dims(hq, hkv, d):
    err, tol = decode_case(_lens(9, 1, 5000, d), hq, hkv, d, BF16, None, device="cuda")
    assert err <= tol, err


@pytest.mark.gpu
def test_gpu_decode_cuda_graph_replay():
    err, tol = decode_case(_lens(24, 100, 8192, 3), 32, 4, 128, BF16, None, device="cuda", graph=True)
    assert err <= tol, err
    err, tol = decode_case(_lens(3, 1, 700, 4), 32, 4, 128, BF16, None, device="cuda", graph=True, store=True)
    assert err <= tol, err


@pytest.mark.gpu
@pytest.mark.parametrize("batch,splits,graph", [(1, None, False), (33, None, False), (5, 1, False), (24, None, True)])
def test_gpu_decode_norm_rope(batch, splits, graph):
    """Raw q/k normalised and rotated inside the decode kernel (Qwen3-30B-A3B's heads)."""
    lens = _lens(batch, 1, 4000, batch) if batch > 1 else [512]
    err, tol = decode_case(lens, 32, 4, 128, BF16, splits, device="cuda", store=True, norm_rope=True, graph=graph)
    assert err <= tol, err


@pytest.mark.gpu
@pytest.mark.parametrize("t,hq,hkv,d", [(2048, 32, 4, 128), (77, 16, 8, 128), (5, 8, 1, 64), (9, 3, 3, 24)])
@pytest.mark.parametrize("store_only", [False, True])
def test_gpu_norm_rope_store(t, hq, hkv, d, store_only):
    err, tol = norm_rope_store_case(t, hq, hkv, d, BF16, device="cuda", store_only=store_only)
    assert err <= tol, err


@pytest.mark.gpu
@pytest.mark.parametrize("prefix,ext", [([0], [8192]), ([8000], [2048]), ([0, 8000, 5000, 17, 0], [2048, 300, 1, 999, 1])])
@pytest.mark.parametrize("tma", [False, True])
def test_gpu_extend_real_size(prefix, ext, tma):
    err, tol = extend_case(prefix, ext, 32, 4, 128, BF16, device="cuda", packed=tma, tma=tma)
    assert err <= tol, err


@pytest.mark.gpu
@pytest.mark.parametrize("prefix,ext", [([8192, 0], [4096, 4096]), ([0, 8000, 5000, 17], [2048, 300, 1, 999])])
@pytest.mark.parametrize("tma", [False, True])
def test_gpu_extend_prefix_rows(prefix, ext, tma):
    err, tol = extend_case(prefix, ext, 32, 4, 128, BF16, device="cuda", packed=tma, tma=tma, in_rows=True)
    assert err <= tol, err


@pytest.mark.gpu
@pytest.mark.parametrize("prefix,ext", [([0], [2048]), ([0, 500, 3], [2000, 17, 1])])
def test_gpu_extend_short_prompt_tiles(prefix, ext):
    err, tol = extend_case(prefix, ext, 32, 4, 128, BF16, device="cuda", packed=True, max_prefix_len=max(prefix))
    assert err <= tol, err


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d", [(16, 2, 64), (16, 4, 256), (8, 1, 24)])
def test_gpu_extend_head_dims(hq, hkv, d):
    err, tol = extend_case([0, 700, 3000], [1000, 129, 1], hq, hkv, d, BF16, device="cuda")
    assert err <= tol, err


@pytest.mark.gpu
@pytest.mark.parametrize("norm_rope", [False, True])
@pytest.mark.parametrize("decode", [True, False])
def test_gpu_op_triton_matches_torch(decode, norm_rope):
    err, tol = op_case(decode, device="cuda", norm_rope=norm_rope)
    assert err <= tol, err


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["mixed", "decode_rows", "short_chunks", "short_only"])
def test_gpu_op_decode_rows_of_a_mixed_step(layout):
    err, tol = op_case(False, device="cuda", norm_rope=True, layout=layout)
    assert err <= tol, err


if __name__ == "__main__":   # CPU groups, run by the fixture above under TRITON_INTERPRET=1
    torch.manual_seed(0)
    results = {}
    for group in sys.argv[1:]:
        results[group] = []
        for name, case in CPU_GROUPS[group]:
            err, tol = case()
            results[group].append(dict(case=name, err=err, tol=tol))
    print(json.dumps(results))
