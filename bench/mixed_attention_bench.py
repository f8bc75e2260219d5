"""A mixed step's attention (GPU): decode rows beside one prompt chunk, the chunk's tokens as rows of
the decode kernel (`AttentionMetadata.token_rows`) against the chunk through the extend kernel.

Qwen3-30B-A3B's attention (32 q / 4 kv heads, head_dim 128, bf16, q/k norm + RoPE inside), the
`compiled::attention` op as a mixed step calls it: `--rows` decode rows at `--context` tokens, then
one chunk of each `--chunks` length over each `--prefixes` cached tokens. Timed as a CUDA graph of
48 calls, one a layer's pools, so that K/V comes from HBM; µs a call.

Usage: PYTHONPATH=$PWD python bench/mixed_attention_bench.py [--rows 9 --context 2048 --chunks 2,9,16,32 --prefixes 0,500,2039]
"""

from __future__ import annotations

import argparse

import torch

from bench.attention_bench import graph_time_ms
from compiled.attention.context import AttentionContext, AttentionMetadata
from compiled.attention.kv_cache import KVPool
from compiled.attention.reference import NormRope
from compiled.forward_context import forward_context
from compiled.functional import rope_cos_sin

HQ, HKV, D, LAYERS = 32, 4, 128, 48
DT = torch.bfloat16
SLOTS_A_ROW = 4096


def metadata(rows: int, context: int, chunk: int, prefix: int, as_rows: bool) -> AttentionMetadata:
    """`rows` one-token requests at `context`, then the chunk's request; request r owns slots
    [1 + r * SLOTS_A_ROW, ...)."""
    dev = torch.device("cuda")
    reqs = list(range(rows + 1))
    prefixes, news = [context - 1] * rows + [prefix], [1] * rows + [chunk]
    seq = [p + n for p, n in zip(prefixes, news)]
    loc = [1 + r * SLOTS_A_ROW + p + i for r, p, n in zip(reqs, prefixes, news) for i in range(n)]
    t = lambda x: torch.tensor(x, device=dev)  # noqa: E731
    meta = AttentionMetadata(out_cache_loc=t(loc), req_pool_indices=t(reqs), seq_lens=t(seq), extend_lens=t(news),
                             req_pool_indices_cpu=reqs, seq_lens_cpu=seq, extend_lens_cpu=news, is_decode=False,
                             extend_start_loc=t([sum(news[:i]) for i in range(len(news))]),
                             decode_rows=rows + 1 if as_rows else rows)
    if as_rows:
        meta.token_rows = t([r for r, n in zip(reqs, news) for _ in range(n)])
        meta.token_positions = t([p + i for p, n in zip(prefixes, news) for i in range(n)])
    return meta


def time_call(kv: KVPool, table: torch.Tensor, meta: AttentionMetadata) -> float:
    """µs a call: a CUDA graph of one call a layer, replayed (`attention_bench.graph_time_ms`)."""
    tokens = meta.out_cache_loc.shape[0]
    q = torch.randn(tokens, HQ, D, dtype=DT, device="cuda")
    k, v = torch.randn(tokens, HKV, D, dtype=DT, device="cuda"), torch.randn(tokens, HKV, D, dtype=DT, device="cuda")
    weights = [1 + 0.1 * torch.randn(D, dtype=DT, device="cuda") for _ in range(2)]
    # (RoPE's positions do not change the time: all zero)
    rope = NormRope(*weights, torch.zeros_like(meta.out_cache_loc), rope_cos_sin(D, 1e6, 8192, "cuda"), 1e-6)

    def call():
        for layer in range(LAYERS):
            torch.ops.compiled.attention(q, k, v, layer, D ** -0.5, *rope)
    with forward_context(AttentionContext(meta=meta, kv=kv, req_to_token=table)):
        return graph_time_ms(call, LAYERS) * 1e3


def main() -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=9)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--chunks", type=ints, default=[2, 9, 16, 24, 32, 48, 64])
    ap.add_argument("--prefixes", type=ints, default=[0, 500, 2039])
    a = ap.parse_args()
    requests = a.rows + 1
    kv = KVPool(LAYERS, requests * SLOTS_A_ROW + 1, HKV, D, DT, torch.device("cuda"))
    for pool in kv.k + kv.v:
        pool.normal_()
    table = (torch.arange(requests * SLOTS_A_ROW, dtype=torch.int32, device="cuda") + 1).view(requests, SLOTS_A_ROW)
    print(f"{torch.cuda.get_device_name()}: {a.rows} decode rows at {a.context} tokens + one chunk, µs a call")
    for prefix in a.prefixes:
        for chunk in a.chunks:
            extend = time_call(kv, table, metadata(a.rows, a.context, chunk, prefix, as_rows=False))
            rows = time_call(kv, table, metadata(a.rows, a.context, chunk, prefix, as_rows=True))
            print(f"  chunk {chunk:3d} over {prefix:5d}: extend kernel {extend:7.2f}, as decode rows {rows:7.2f}", flush=True)


if __name__ == "__main__":
    main()
