"""The `compiled::attention` custom op: stores the step's K/V and attends over the cache.

Opaque to tracing (its fake returns a tensor shaped like q), so the model graph has one node per
layer and the compile backend can split there.

Backends: the Triton kernels (`triton_store`, `triton_decode`, `triton_extend`) when q is on CUDA,
the torch reference (`reference`) otherwise. `BACKEND` may force one: the engine config
(`configure`), where `COMPILED_ATTENTION_BACKEND=torch|triton` (read at import) wins, or
`set_backend()`; forcing Triton on CPU needs `TRITON_INTERPRET=1`."""

from __future__ import annotations

import torch

from compiled.attention.context import AttentionContext, AttentionMetadata
from compiled.attention.kv_cache import KVPool
from compiled.attention.reference import (NormRope, decode_attention_ref, extend_attention_ref, norm_rope_ref,
                                         store_kv)
from compiled.backend import BackendChoice
from compiled.forward_context import current_forward
from compiled.parallel.context import CPStep

BACKEND = BackendChoice("COMPILED_ATTENTION_BACKEND")


def set_backend(name: str) -> None:
    """'auto' (Triton on CUDA, torch elsewhere), 'torch' or 'triton'."""
    BACKEND.set(name)


def backend_for(q: torch.Tensor) -> str:
    if BACKEND.name == "auto":
        return "triton" if q.is_cuda else "torch"
    return BACKEND.name


def attention_body(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None, cos_sin: torch.Tensor | None = None,
                   eps: float = 0.0, k_full: torch.Tensor | None = None,
                   v_full: torch.Tensor | None = None) -> torch.Tensor:
    """The `compiled::attention` op's body (the op below wraps it; the eager submodules between
    compiled pieces call it directly, `compilation.split.EAGER_BODIES`).

    q `[T, Hq, D]`, k/v `[T, Hkv, D]` for the step's new tokens -> `[T, Hq, D]`.

    With `q_norm` (set by the fuse_qk_norm_rope pass, together with `k_norm`, `positions`,
    `cos_sin` and `eps`), q and k are the raw projection output: the per-head RMSNorm and RoPE
    (`reference.norm_rope_ref`) are applied here, inside the kernels' launches on Triton.

    `k_full` / `v_full` (set by the cp_allgather pass): every rank's K/V of the step in batch
    order. In a context-parallel step this rank's q/k/v are its own tokens only: all of the
    step's K/V is stored, and this rank's queries attend (`_attention_cp`)."""
    rope = _norm_rope(q, q_norm, k_norm, positions, cos_sin, eps)
    forward = current_forward()
    ctx, step = forward.attention, forward.cp
    if ctx is None:
        raise RuntimeError("attention ran outside forward_context(attention=...): the runner installs it per step")
    if step is not None and k_full is not None:
        return _attention_cp(ctx, step, q, k, v, k_full, v_full, layer, scale, rope)
    if backend_for(q) == "triton":
        return _attention_triton(ctx, q, k, v, layer, scale, rope)
    if rope is not None:
        q, k = norm_rope_ref(q, k, rope)
    meta, k_cache, v_cache = ctx.meta, ctx.kv.k[layer], ctx.kv.v[layer]
    store_kv(k_cache, v_cache, meta.out_cache_loc, k, v)
    if meta.is_decode:
        return decode_attention_ref(q, k_cache, v_cache, ctx.req_to_token, meta.req_pool_indices,
                                    meta.seq_lens, meta.max_seq_len, scale)
    return extend_attention_ref(q, k_cache, v_cache, ctx.req_to_token, meta.req_pool_indices_cpu,
                                meta.seq_lens_cpu, meta.extend_lens_cpu, scale)


attention = torch.library.custom_op("compiled::attention", mutates_args=())(attention_body)


@attention.register_fake
def _(q, k, v, layer, scale, q_norm=None, k_norm=None, positions=None, cos_sin=None, eps=0.0, k_full=None,
      v_full=None):
    return torch.empty_like(q)


def _attention_cp(ctx: AttentionContext, step: CPStep, q, k, v, k_full, v_full, layer: int, scale: float,
                  rope: NormRope | None) -> torch.Tensor:
    """A context-parallel step: store every token's K/V (`k_full`, `v_full`, at the step's slots),
    then this rank's queries attend as `ctx.meta` lays them out: each of the rank's segments as a
    request whose cached prefix is everything before it (`parallel/zigzag.py`), its own new K/V
    being this rank's k/v."""
    meta, k_cache, v_cache = ctx.meta, ctx.kv.k[layer], ctx.kv.v[layer]
    full = None if rope is None else NormRope(rope.q_weight, rope.k_weight, step.positions, rope.cos_sin, rope.eps)
    if backend_for(q) == "triton":
        from compiled.attention.triton_extend import PrefixRows, extend_attention_triton
        from compiled.attention.triton_norm_rope import norm_rope_store_triton
        from compiled.attention.triton_store import store_kv_triton
        q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
        k_full, v_full = _last_dim_contiguous(k_full), _last_dim_contiguous(v_full)
        if rope is None:
            store_kv_triton(k_cache, v_cache, step.out_cache_loc, k_full, v_full)
        else:   # every rank's K/V normalised, rotated and stored; then this rank's q and k rotated
            k_full = norm_rope_store_triton(None, k_full, v_full, k_cache, v_cache, step.out_cache_loc, full)[1]
            q, k = norm_rope_store_triton(q, k, v, k_cache, v_cache, meta.out_cache_loc, rope)
        # The step's part of each segment's prefix is read from the gathered rows, not the pools.
        rows = PrefixRows(k_full, v_full, step.rows_prefix, step.rows_start)
        return extend_attention_triton(q, k, v, k_cache, v_cache, ctx.req_to_token, meta.req_pool_indices,
                                       meta.seq_lens, meta.extend_lens, extend_start_loc(meta), meta.max_extend_len,
                                       scale, max_prefix_len=meta.max_prefix_len, rows=rows)
    if rope is not None:
        q = norm_rope_ref(q, q, rope)[0]
        k_full = norm_rope_ref(k_full, k_full, full)[1]
    store_kv(k_cache, v_cache, step.out_cache_loc, k_full, v_full)
    return extend_attention_ref(q, k_cache, v_cache, ctx.req_to_token, meta.req_pool_indices_cpu,
                                meta.seq_lens_cpu, meta.extend_lens_cpu, scale)


def _norm_rope(q, q_norm, k_norm, positions, cos_sin, eps) -> NormRope | None:
    parts = dict(q_norm=q_norm, k_norm=k_norm, positions=positions, cos_sin=cos_sin)
    missing = [name for name, t in parts.items() if t is None]
    if len(missing) == len(parts):
        return None
    if missing:
        raise ValueError(f"compiled::attention: {', '.join(missing)} missing (the norm/RoPE arguments come together)")
    if q_norm.dtype != q.dtype or k_norm.dtype != q.dtype:
        raise ValueError(f"compiled::attention: q/k norm weights are {q_norm.dtype}/{k_norm.dtype}, q is {q.dtype}")
    return NormRope(q_norm, k_norm, positions, cos_sin, eps)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def decode_workspace(ctx: AttentionContext, q: torch.Tensor):
    """The stage-1 scratch of flash-decoding, kept on the KV pool: allocated once (on the first
    decode step, i.e. the warm-up before capture) for every batch up to the request table's rows."""
    return _workspace(ctx.kv, ctx.req_to_token, q)


def _workspace(kv: KVPool, req_to_token: torch.Tensor, q: torch.Tensor):
    from compiled.attention.triton_decode import DecodeWorkspace
    batch, hq, d = q.shape
    hkv = kv.k[0].shape[1]
    key = ("decode", hq, hkv, d, str(q.device))
    ws = kv.scratch.get(key)
    if ws is None or ws.max_batch < batch:
        ws = kv.scratch[key] = DecodeWorkspace(max(req_to_token.shape[0], batch), hq, hkv, d, q.device)
    return ws


def warm_token_rows(kv: KVPool, req_to_token: torch.Tensor, padding_row: int, q_heads: int, dtype: torch.dtype,
                    index_dtype: torch.dtype) -> int:
    """Launch the decode kernel as a mixed step's token rows launch it (`_token_rows_triton`: the
    K/V stored before it, q normalised and rotated) once for each split count their number can
    take (up to the request table's rows), over rows of the padding request; returns the launches.
    Its variants (split or not, the first tiles asked of L2 or not) then compile at start, not in
    the step where a server meets its first prompt tail: a compile there holds up every running
    request. `index_dtype`: the runner's table rows and positions (the kernel compiles per dtype)."""
    from compiled.attention.triton_decode import decode_attention_triton
    k_cache, v_cache = kv.k[0], kv.v[0]
    device, d = k_cache.device, k_cache.shape[-1]
    ws = _workspace(kv, req_to_token, torch.empty(1, q_heads, d, dtype=dtype, device=device))
    first_rows: dict[int, int] = {}
    for rows in range(1, req_to_token.shape[0] + 1):
        first_rows.setdefault(ws.splits_for(rows), rows)
    for rows in first_rows.values():
        q = torch.zeros(rows, q_heads, d, dtype=dtype, device=device)
        table_rows = torch.full((rows,), padding_row, dtype=index_dtype, device=device)
        lens = torch.ones(rows, dtype=index_dtype, device=device)
        decode_attention_triton(q, k_cache, v_cache, req_to_token, table_rows, lens, 1.0, ws)
    return len(first_rows)


def extend_start_loc(meta: AttentionMetadata) -> torch.Tensor:
    """The runner fills `meta.extend_start_loc`; metadata built elsewhere gets it computed here,
    on the device (no host sync), once per step."""
    if meta.extend_start_loc is None:
        lens = meta.extend_lens
        meta.extend_start_loc = torch.cumsum(lens, 0) - lens
    return meta.extend_start_loc


def token_lens(meta: AttentionMetadata) -> torch.Tensor:
    """The context length of each decode row of `meta.token_rows` (its position + 1), computed on
    the device once per step (metadata no kernel reads, a prompt graph's, launches nothing)."""
    if meta.token_lens is None:
        meta.token_lens = meta.token_positions + 1
    return meta.token_lens


def _attention_triton(ctx: AttentionContext, q, k, v, layer: int, scale: float, rope: NormRope | None) -> torch.Tensor:
    from compiled.attention.triton_decode import decode_attention_triton
    from compiled.attention.triton_extend import extend_attention_triton
    from compiled.attention.triton_norm_rope import norm_rope_store_triton
    from compiled.attention.triton_store import store_kv_triton
    meta, k_cache, v_cache = ctx.meta, ctx.kv.k[layer], ctx.kv.v[layer]
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    out = None if ctx.attention_out is None else ctx.attention_out(q)
    if meta.is_decode:
        if q.shape[0] != meta.seq_lens.shape[0]:
            raise ValueError(f"decode step with {q.shape[0]} tokens for {meta.seq_lens.shape[0]} requests")
        # The decode kernel stores the step's K/V itself (one launch instead of two).
        return decode_attention_triton(q, k_cache, v_cache, ctx.req_to_token, meta.req_pool_indices,
                                       meta.seq_lens, scale, decode_workspace(ctx, q),
                                       new_kv=(k, v, meta.out_cache_loc), norm_rope=rope, out=out)
    # In a mixed step the leading requests (`decode_rows`) attend through the decode kernel, the
    # others through the extend kernel, which finds their rows by offset.
    n, extend_len = meta.decode_rows, meta.max_extend_len
    out = torch.empty_like(q) if out is None else out
    if meta.token_rows is not None:
        q, k = _token_rows_triton(ctx, q, k, v, out, layer, scale, rope)
    else:
        # Each of them one token: the decode kernel also normalises, rotates and stores their K/V
        # as in a decode step (the same compiled kernel: whole arrays of which it reads the first
        # n, not slices).
        if rope is None:
            store_kv_triton(k_cache, v_cache, meta.out_cache_loc, k, v)
        if n:
            new_kv = None if rope is None else (k, v, meta.out_cache_loc)
            decode_attention_triton(q[:n], k_cache, v_cache, ctx.req_to_token, meta.req_pool_indices, meta.seq_lens,
                                    scale, decode_workspace(ctx, q[:n]), new_kv=new_kv, norm_rope=rope, out=out[:n])
        if extend_len and rope is not None:   # one launch normalises, rotates and stores
            q, k = norm_rope_store_triton(q, k, v, k_cache, v_cache, meta.out_cache_loc, rope, first=n)
    if extend_len:
        extend_attention_triton(q, k, v, k_cache, v_cache, ctx.req_to_token, meta.req_pool_indices,
                                meta.seq_lens, meta.extend_lens, extend_start_loc(meta), extend_len,
                                scale, out=out, max_prefix_len=meta.max_prefix_len, first_request=n)
    return out


def _token_rows_triton(ctx: AttentionContext, q, k, v, out: torch.Tensor, layer: int, scale: float,
                       rope: NormRope | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The leading requests of a mixed step with chunks of several tokens among them: every
    token's K/V is stored first (a chunk's later tokens attend to its earlier ones, which other
    programs of one decode launch would be storing), then each of their tokens attends as a
    decode row of its own (`meta.token_rows`, `token_lens`) into `out`. Returns q and k as
    the extend kernel reads them (normalised and rotated where `rope`)."""
    from compiled.attention.triton_decode import decode_attention_triton
    from compiled.attention.triton_norm_rope import norm_rope_store_triton
    from compiled.attention.triton_store import store_kv_triton
    meta, k_cache, v_cache = ctx.meta, ctx.kv.k[layer], ctx.kv.v[layer]
    if rope is None:
        store_kv_triton(k_cache, v_cache, meta.out_cache_loc, k, v)
    else:
        q, k = norm_rope_store_triton(q, k, v, k_cache, v_cache, meta.out_cache_loc, rope)
    rows = meta.token_rows.shape[0]
    decode_attention_triton(q[:rows], k_cache, v_cache, ctx.req_to_token, meta.token_rows, token_lens(meta), scale,
                            decode_workspace(ctx, q[:rows]), out=out[:rows])
    return q, k
