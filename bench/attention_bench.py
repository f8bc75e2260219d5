"""Attention kernel benchmark (GPU): Triton flash-decoding, varlen extend and the KV store.

Shapes are Qwen3-30B-A3B's attention (32 q / 4 kv heads, head_dim 128, bf16).

- Copy ceiling: a 2 GiB device-to-device copy, (bytes read + written) / time.
- Decode: batch x context, one query token per request, contiguous slots per request. Timed as
  it runs in serving: captured in a CUDA graph (stage 1 + stage 2), replayed; when one call's KV
  is small, the graph holds several calls over disjoint requests so that at least 512 MiB of KV
  is read per replay (nothing is served from the 50 MB L2). Bandwidth counts K+V read plus q
  read and out written, against the copy ceiling.
- Extend: our kernel (prefix gathered through req_to_token, new tokens causal) against torch SDPA
  forced to the flash backend on the same shapes without paging (k/v expanded to 32 heads):
  (a) 2k and 8k causal tokens, one request, no prefix: SDPA is_causal=True;
  (b) 2k new tokens over an 8k prefix: SDPA with q 2k x kv 10k and the bottom-right causal mask
      (`causal_lower_right`, which the flash backend runs natively).
  Both timed with triton.testing.do_bench (L2 flushed, median).
- Store: the Triton K+V store vs torch index_put at decode and prefill token counts.

- Latency (`--latency`, only this): decode at batch 1 and 8, 512-4096 tokens (`--latency-batches`,
  `--latency-contexts`), every split count from 1 to 64 and the heuristic's (there also other tiles
  and warp counts), as a chain of calls in one graph (a decode step's attention is one short call
  after another at these sizes, so the per-call time is what counts).

Usage: PYTHONPATH=$PWD python bench/attention_bench.py --out results/attn.json [--sweep] [--extend | --latency]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import triton
from triton.testing import do_bench

from compiled.attention import triton_decode, triton_extend
from compiled.attention.triton_decode import DecodeWorkspace, decode_attention_triton
from compiled.attention.triton_extend import extend_attention_triton
from compiled.attention.triton_store import store_kv_triton

HQ, HKV, D = 32, 4, 128
DT = torch.bfloat16
ELT = 2
BATCHES = [1, 8, 32, 64, 128, 256]
CONTEXTS = [512, 2048, 8192, 32768]
EXTEND_SHAPES = [(0, 2048), (0, 8192), (8192, 2048)]  # (cached prefix, new tokens): one request
MIN_BYTES_PER_REPLAY = 512 << 20


def copy_ceiling() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    n = 1 << 30   # elements of bf16: 2 GiB
    x = torch.empty(n, dtype=DT, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), return_mode="median")
    del x, y
    return 2 * n * ELT / (ms * 1e-3)


def graph_time_ms(fn, calls_per_replay: int, replays: int = 10, samples: int = 15) -> float:
    """Median time of one `fn` call, `fn` (which makes `calls_per_replay` calls) captured once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(replays):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / (replays * calls_per_replay))
    del g
    times.sort()
    return times[len(times) // 2]


class DecodeBench:
    """One K/V pool holding max_batch requests of max_ctx tokens; request i owns slots
    [1 + i * max_ctx, 1 + (i + 1) * max_ctx)."""

    def __init__(self, max_batch: int, max_ctx: int, min_rows: int = 0) -> None:
        """`min_rows`: request-splits the workspaces hold beyond the heuristic's (explicit splits)."""
        self.max_batch, self.max_ctx, self.min_rows = max_batch, max_ctx, min_rows
        slots = max_batch * max_ctx + 1
        self.k = torch.empty(slots, HKV, D, dtype=DT, device="cuda").normal_()
        self.v = torch.empty(slots, HKV, D, dtype=DT, device="cuda").normal_()
        self.table = (torch.arange(max_batch * max_ctx, device="cuda", dtype=torch.int32) + 1).view(max_batch, max_ctx)
        self.workspaces: dict[int, DecodeWorkspace] = {}

    def workspace(self, programs_per_sm: int) -> DecodeWorkspace:
        if programs_per_sm not in self.workspaces:
            self.workspaces[programs_per_sm] = DecodeWorkspace(self.max_batch, HQ, HKV, D, torch.device("cuda"),
                                                               programs_per_sm=programs_per_sm,
                                                               min_rows=self.min_rows)
        return self.workspaces[programs_per_sm]

    def run(self, batch: int, ctx: int, programs_per_sm: int = triton_decode.PROGRAMS_PER_SM,
            splits: int | None = None, **config) -> dict:
        kv_bytes = batch * ctx * HKV * D * ELT * 2
        io_bytes = 2 * batch * HQ * D * ELT
        reps = max(1, min(self.max_batch // batch, math.ceil(MIN_BYTES_PER_REPLAY / kv_bytes)))
        ws = self.workspace(programs_per_sm)
        splits = splits or ws.splits_for(batch)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int64, device="cuda")
        rows = [torch.arange(r * batch, (r + 1) * batch, device="cuda") for r in range(reps)]
        qs = [torch.randn(batch, HQ, D, dtype=DT, device="cuda") for _ in range(reps)]
        outs = [torch.empty_like(q) for q in qs]

        def fn():
            for q, r, o in zip(qs, rows, outs):
                decode_attention_triton(q, self.k, self.v, self.table, r, seq_lens, D ** -0.5, ws,
                                        num_splits=splits, out=o, **config)
        ms = graph_time_ms(fn, reps)
        return dict(batch=batch, ctx=ctx, splits=splits, calls_per_replay=reps, us=ms * 1e3,
                    kv_bytes=kv_bytes, gbps=(kv_bytes + io_bytes) / (ms * 1e-3) / 1e9)


def decode_latency(batches: tuple[int, ...], contexts: tuple[int, ...]) -> list[dict]:
    """A decode step's attention at small batches is a chain of short calls: µs per call of 128
    calls (distinct requests) in one graph, against the split count (None: the heuristic's)."""
    splits = (None, 1, 2, 4, 8, 16, 32, 64)
    bench = DecodeBench(max(128, max(batches)), max(contexts), min_rows=max(batches) * max(splits[1:]))
    rows = []
    for batch in batches:
        for ctx in contexts:
            for n in splits:
                r = bench.run(batch, ctx, splits=n)
                r["heuristic"] = n is None
                rows.append(r)
                print(f"  latency b={batch} ctx={ctx} splits={r['splits']}{' (heuristic)' if n is None else ''}: "
                      f"{r['us']:.2f} us", flush=True)
            for block_n, warps in ((32, 4), (64, 2), (32, 2), (128, 4), (64, 8)):   # at the heuristic's splits
                r = bench.run(batch, ctx, block_n=block_n, num_warps=warps)
                r.update(heuristic=True, block_n=block_n, num_warps=warps)
                rows.append(r)
                print(f"  latency b={batch} ctx={ctx} splits={r['splits']} block_n={block_n} warps={warps}: "
                      f"{r['us']:.2f} us", flush=True)
    return rows


def extend_flops(prefix: int, ext: int) -> float:
    visible = ext * prefix + ext * (ext + 1) / 2
    return 4 * HQ * D * visible


def bench_extend(prefix: int, ext: int, sweep: bool) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    seq = prefix + ext
    k_cache = torch.empty(seq + 1, HKV, D, dtype=DT, device="cuda").normal_()
    v_cache = torch.empty_like(k_cache).normal_()
    table = (torch.arange(seq, dtype=torch.int32, device="cuda") + 1)[None]
    q = torch.randn(ext, HQ, D, dtype=DT, device="cuda")
    k = k_cache[1 + prefix:].clone()    # the new tokens' K/V (also stored in the pool, as the op does)
    v = v_cache[1 + prefix:].clone()
    out = torch.empty_like(q)
    meta = dict(req_pool_indices=torch.zeros(1, dtype=torch.int64, device="cuda"),
                seq_lens=torch.tensor([seq], device="cuda"), extend_lens=torch.tensor([ext], device="cuda"),
                extend_start_loc=torch.zeros(1, dtype=torch.int64, device="cuda"), max_extend_len=ext,
                max_prefix_len=prefix)

    def ours(**cfg):
        return lambda: extend_attention_triton(q, k, v, k_cache, v_cache, table, scale=D ** -0.5, out=out,
                                               **meta, **cfg)

    flops = extend_flops(prefix, ext)
    res = dict(prefix=prefix, ext=ext, tflop=flops / 1e12)
    res["ours_ms"] = do_bench(ours(), return_mode="median")
    # SDPA (flash backend) on the same shapes without paging; k/v expanded to 32 heads.
    qs = q.transpose(0, 1)[None]
    ks = k_cache[1:].repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)[None]
    vs = v_cache[1:].repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)[None]
    if prefix == 0:
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)  # noqa: E731
        res["sdpa_mask"] = "is_causal"
    else:
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(ext, seq)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)  # noqa: E731
        res["sdpa_mask"] = "causal_lower_right"
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = sdpa()
        res["sdpa_ms"] = do_bench(sdpa, return_mode="median")
    res["sdpa_backend"] = "flash"
    res["sdpa_other_ms"] = {}
    if prefix == 0:   # for context: torch's own backend choice and cuDNN (a bottom-right mask is flash-only)
        res["sdpa_other_ms"]["default"] = do_bench(sdpa, return_mode="median")
        qc, kc, vc = qs.contiguous(), ks.contiguous(), vs.contiguous()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            res["sdpa_other_ms"]["flash_bhsd_contiguous"] = do_bench(
                lambda: torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=True),
                return_mode="median")
        del qc, kc, vc
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                res["sdpa_other_ms"]["cudnn"] = do_bench(sdpa, return_mode="median")
        except RuntimeError as e:
            res["sdpa_other_ms"]["cudnn"] = f"unavailable: {str(e)[:100]}"
    ours()()
    res["max_abs_diff_vs_sdpa"] = (out.float() - ref[0].transpose(0, 1).float()).abs().max().item()
    res["ours_tflops"] = flops / (res["ours_ms"] * 1e-3) / 1e12
    res["sdpa_tflops"] = flops / (res["sdpa_ms"] * 1e-3) / 1e12
    res["speed_vs_sdpa"] = res["sdpa_ms"] / res["ours_ms"]
    res["config"] = triton_extend.default_config(D, ext, prefix)
    for name, ms in res["sdpa_other_ms"].items():
        if isinstance(ms, float):
            res[f"speed_vs_sdpa_{name}"] = ms / res["ours_ms"]
    if sweep:
        res["sweep"] = []
        tiles = [(128, 64, 128, 8, 3), (128, 64, 64, 8, 3), (128, 128, 128, 8, 3), (128, 64, 128, 8, 4),
                 (64, 64, 64, 4, 3), (128, 32, 64, 4, 4), (128, 128, 128, 8, 2), (128, 64, 128, 8, 2),
                 (64, 64, 128, 4, 3), (64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 64, 64, 4, 4),
                 (64, 32, 64, 4, 3), (64, 64, 128, 8, 3)]
        for (bm, bn, bnp, w, st), tma in ((tile, tma) for tile in tiles for tma in (False, True)):
            cfg = dict(block_m=bm, block_n=bn, block_np=bnp, num_warps=w, num_stages=st, tma=tma)
            try:
                ms = do_bench(ours(**cfg), return_mode="median")
                res["sweep"].append(dict(cfg, ms=ms, tflops=flops / (ms * 1e-3) / 1e12))
            except Exception as e:  # noqa: BLE001  (out of shared memory and the like)
                res["sweep"].append(dict(cfg, error=str(e)[:120]))
    del k_cache, v_cache, ks, vs
    return res


def run_extend(result: dict, args) -> None:
    result["extend"] = []
    for prefix, ext in args.extend_shapes or EXTEND_SHAPES:
        result["extend"].append(bench_extend(prefix, ext, args.sweep))
        print("  extend", {k: v for k, v in result["extend"][-1].items() if k != "sweep"}, flush=True)
        for row in result["extend"][-1].get("sweep", []):
            print("    sweep", row, flush=True)
        _dump(result, args.out)


def bench_store(t: int) -> dict:
    slots = 1 << 20
    k_cache = torch.zeros(slots, HKV, D, dtype=DT, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    loc = torch.randperm(slots - 1, device="cuda")[:t] + 1
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, dtype=DT, device="cuda")   # k/v as views of a fused projection
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(t, HKV, D)

    def torch_store():
        k_cache[loc] = k
        v_cache[loc] = v
    calls = max(1, 4096 // t)
    tri = graph_time_ms(lambda: [store_kv_triton(k_cache, v_cache, loc, k, v) for _ in range(calls)], calls)
    ref = graph_time_ms(lambda: [torch_store() for _ in range(calls)], calls)
    return dict(tokens=t, triton_us=tri * 1e3, torch_index_put_us=ref * 1e3)


def _dump(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attention_bench.json")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile/warp/stage configs")
    ap.add_argument("--max-ctx", type=int, default=max(CONTEXTS))
    ap.add_argument("--extend", action="store_true", help="only the extend shapes (with --sweep: their configs)")
    ap.add_argument("--extend-shapes", type=lambda s: tuple(int(x) for x in s.split("+")), nargs="+",
                    help="PREFIX+NEW pairs instead of the default extend shapes, e.g. 512+2048")
    ap.add_argument("--latency", action="store_true",
                    help="only the split-count sweep at small batches and contexts (a chain of calls in one graph)")
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    ap.add_argument("--latency-batches", type=ints, default=(1, 8), help="batches of --latency, e.g. 1,8,10,16")
    ap.add_argument("--latency-contexts", type=ints, default=(512, 2048, 4096), help="contexts of --latency")
    return ap.parse_args()


def run_decode(result: dict, args: argparse.Namespace, props, ceiling: float) -> None:
    """The decode grid, the batches between its rows and (--sweep) other configs, into `result`."""
    max_b, max_ctx = max(BATCHES), args.max_ctx
    free = torch.cuda.mem_get_info()[0]
    while 2 * max_b * max_ctx * HKV * D * ELT > 0.8 * free:
        max_ctx //= 2
    bench = DecodeBench(max_b, max_ctx)
    result["decode"] = []
    print(f"{props.name}: copy ceiling {ceiling / 1e9:.0f} GB/s; decode pool for {max_b} x {max_ctx}", flush=True)
    for batch in BATCHES:
        for ctx in CONTEXTS:
            if ctx > max_ctx:
                continue
            r = bench.run(batch, ctx)
            r["pct_of_copy"] = 100 * r["gbps"] * 1e9 / ceiling
            result["decode"].append(r)
            print(f"  decode b={batch} ctx={ctx}: {r['us']:.1f} us, {r['pct_of_copy']:.1f}% of copy", flush=True)
    _dump(result, args.out)
    # Batches between the grid's, where the split heuristic meets wave quantisation.
    result["decode_extra"] = []
    for batch in (48, 96, 160, 192, 224):
        for ctx in (2048, 8192):
            r = bench.run(batch, ctx)
            r["pct_of_copy"] = 100 * r["gbps"] * 1e9 / ceiling
            result["decode_extra"].append(r)
            print(f"  decode b={batch} ctx={ctx}: {r['us']:.1f} us, {r['pct_of_copy']:.1f}% of copy", flush=True)
    result["decode_config"] = dict(split=triton_decode.default_config(D),
                                   unsplit=triton_decode.default_config(D, direct=True),
                                   programs_per_sm=triton_decode.PROGRAMS_PER_SM)
    if args.sweep:
        result["decode_sweep"] = []
        shapes = [(32, 8192), (64, 2048), (8, 32768), (256, 2048), (128, 8192)]
        configs = [dict(block_n=bn, num_warps=w, num_stages=st, programs_per_sm=pps)
                   for bn, w, st, pps in [(64, 4, 2, 4), (64, 4, 3, 4), (128, 4, 2, 4), (32, 2, 3, 4),
                                          (64, 4, 2, 5), (64, 4, 2, 2)]]
        for cfg in configs:
            row = dict(cfg)
            for batch, ctx in shapes:
                if ctx > max_ctx:
                    continue
                kw = dict(cfg)
                pps = kw.pop("programs_per_sm")
                try:
                    r = bench.run(batch, ctx, programs_per_sm=pps, **kw)
                    row[f"b{batch}_c{ctx}_pct"] = round(100 * r["gbps"] * 1e9 / ceiling, 1)
                except Exception as e:  # noqa: BLE001
                    row[f"b{batch}_c{ctx}_pct"] = f"error: {str(e)[:80]}"
            result["decode_sweep"].append(row)
            print("  sweep", row, flush=True)
        _dump(result, args.out)
    del bench
    torch.cuda.empty_cache()


def print_tables(result: dict, args: argparse.Namespace) -> None:
    print(f"\n{result['device']}  torch {result['torch']}  triton {result['triton']}  "
          f"copy ceiling {result['copy_ceiling_gbps']:.0f} GB/s (read+write)")
    print(f"decode (32q/4kv, d=128, bf16, CUDA graph)  config {result['decode_config']}")
    print(f"{'batch':>5} {'ctx':>6} {'splits':>6} {'us':>9} {'GB/s':>7} {'%copy':>6}  target")
    for r in result["decode"]:
        target = r["batch"] >= 32 and r["ctx"] >= 2048
        mark = ("ok" if r["pct_of_copy"] >= 70 else "MISS") if target else "-"
        print(f"{r['batch']:>5} {r['ctx']:>6} {r['splits']:>6} {r['us']:>9.1f} {r['gbps']:>7.0f} "
              f"{r['pct_of_copy']:>6.1f}  {mark}")
    if args.sweep:
        print("decode sweep (% of copy ceiling)")
        for row in result["decode_sweep"]:
            print("  ", row)
    print("decode, other batch sizes")
    for r in result["decode_extra"]:
        print(f"{r['batch']:>5} {r['ctx']:>6} {r['splits']:>6} {r['us']:>9.1f} {r['gbps']:>7.0f} {r['pct_of_copy']:>6.1f}")
    print("extend (32q/4kv, d=128, bf16) vs SDPA flash on unpaged, kv-expanded tensors")
    print(f"{'case':>22} {'ours ms':>8} {'TF/s':>6} {'sdpa ms':>8} {'TF/s':>6} {'speed':>6}  target  mask")
    for r in result["extend"]:
        case = f"{r['ext']} new / {r['prefix']} prefix"
        mark = "ok" if r["speed_vs_sdpa"] >= 0.8 else "MISS"
        print(f"{case:>22} {r['ours_ms']:>8.3f} {r['ours_tflops']:>6.0f} {r['sdpa_ms']:>8.3f} "
              f"{r['sdpa_tflops']:>6.0f} {r['speed_vs_sdpa']:>6.2f}  {mark:>6}  {r['sdpa_mask']}/{r['sdpa_backend']}"
              f"  maxdiff {r['max_abs_diff_vs_sdpa']:.3g}")
        other = {k: (f"{v:.3f} ms" if isinstance(v, float) else v) for k, v in r["sdpa_other_ms"].items()}
        print(f"{'':>22} SDPA other backends: {other}")
        for s in r.get("sweep", []):
            print("    ", s)
    print("store (K+V, 4 kv heads, d=128, bf16): tokens, triton us, torch index_put us")
    for r in result["store"]:
        print(f"{r['tokens']:>8} {r['triton_us']:>8.1f} {r['torch_index_put_us']:>8.1f}")


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    result = dict(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                  triton=triton.__version__, date=time.strftime("%Y-%m-%d"))
    ceiling = copy_ceiling()
    result["copy_ceiling_gbps"] = ceiling / 1e9

    if args.latency:
        result["decode_latency"] = decode_latency(args.latency_batches, args.latency_contexts)
        _dump(result, args.out)
        return
    if args.extend:
        run_extend(result, args)
        return
    run_decode(result, args, props, ceiling)
    run_extend(result, args)
    torch.cuda.empty_cache()
    # ---- store
    result["store"] = [bench_store(t) for t in (32, 256, 8192)]
    result["seconds"] = time.time() - t0
    print_tables(result, args)
    _dump(result, args.out)
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
