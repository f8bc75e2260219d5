"""One Qwen3-30B-A3B MoE layer on the GPU: our fused MoE vs torch._grouped_mm vs HF's expert loop.

    PYTHONPATH=$PWD python bench/moe_bench.py [--out moe_bench.json] [--tokens 1 8 64 512 4096] [--layers 8]
        [--quantization fp8] [--sweep-gemv [--only-gemv] [--write-gemv [DIR]]]

E=128, H=2048, I=768, top-8 (`--E/--H/--I/--topk`), bf16 activations, random weights and random
router logits; `--quantization fp8`: dummy FP8 experts (`tune_moe.make_fp8_weights`, 128 x 128
block scales), whose fused rows run the op's FP8 path (the torch and HF baselines, bf16 only, are
left out; the floor counts the FP8 bytes). `--layers` copies of the weights are cycled (one call
per layer, like the model), so weights come from HBM, not L2. Measured in the same run:
  fused        compiled::fused_moe's Triton path, routing given (CUDA graph of one call per layer)
  TMA          the same tuned tiles with the weight tiles loaded through TMA descriptors (TMA=1)
  (one token runs as two GEMVs with the tuned file's "gemv" tiles, else GEMV_TILES; --sweep-gemv
   times other tiles, --only-gemv that sweep alone, --write-gemv writes its best into the "gemv"
   entry of the tuned file for this shape, device and experts' dtype, keeping its other entries)
  fused+route  compiled::topk_route (Triton) + fused MoE (CUDA graph)
  gmm+route    torch routing + torch._grouped_mm for w13 and w2 (CUDA graph when capturable)
  hf_eager     transformers' Qwen3MoeExperts, eager expert loop (routing given; host syncs, events)
  hf_gmm       the same module with experts_implementation="grouped_mm" (events)
Floor: distinct experts touched per layer x 9.4 MB / the device copy bandwidth measured here
(bytes read + written). TFLOP/s = 6*T*k*H*I / time, against an 8192^3 bf16 matmul measured here:
once at the start ("% matmul") and, from --paired-from tokens on, alternately with the fused MoE
("% matmul paired": the median of five back-to-back pairs, both at the same GPU clock).
`--device cpu` (with --only-gemv, under TRITON_INTERPRET=1, tiny shapes): a smoke run of the sweep
and the file it writes, wall-clock timings."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tune_moe  # noqa: E402
import compiled.moe.routing  # noqa: E402,F401
from compiled.moe import fused_moe as fm  # noqa: E402
from compiled.moe import tuned_configs as tc  # noqa: E402
from compiled.quant.dequant import dequantize_blocks  # noqa: E402
from tune_moe import make_fp8_weights, make_weights, time_events, time_graph  # noqa: E402

E, H, I, TOP_K = 128, 2048, 768, 8   # set from the command line


def expert_bytes(fp8: bool) -> int:
    """Weight bytes of one expert: 9,437,184 in bf16 at the 30B's shape; FP8, half, plus the
    fp32 scales of 128 x 128 blocks."""
    if not fp8:
        return 3 * H * I * 2
    blocks = -(-2 * I // 128) * -(-H // 128) + -(-H // 128) * -(-I // 128)
    return 3 * H * I + 4 * blocks


def experts(L: int, fp8: bool) -> tuple[list, list, list]:
    """(w13, w2, scales) of `L` layers: bf16 experts (scales None) or dummy FP8 ones."""
    if fp8:
        return make_fp8_weights(L, E, H, I)
    return (*make_weights(L, E, H, I, torch.bfloat16), [None] * L)


def copy_bandwidth(gib: float = 2.0) -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = int(gib * (1 << 30)) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = time_events(lambda: dst.copy_(src), reps=20, warmup=3)
    return 2 * n * 2 / (us * 1e-6)


def matmul_rate(n: int = 8192, reps: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    us = time_events(lambda: a @ b, reps=reps, warmup=3)
    return 2 * n ** 3 / (us * 1e-6)


def paired_fraction(fused_fns, layers: int, flops: int, pairs: int = 5) -> tuple[float, list[float]]:
    """Median over `pairs` of (fused rate / matmul rate), the two timed back to back each time, so
    that both see the same clocks: a long compute-bound run heats the GPU and lowers its clock, and
    a matmul rate taken at the start of the run would flatter or punish whatever comes later."""
    fracs = []
    for _ in range(pairs):
        mm = matmul_rate(reps=5)
        us = time_graph(fused_fns, reps=5) / layers
        fracs.append(flops / (us * 1e-6) / mm)
    return statistics.median(fracs), fracs


def grouped_mm_moe(x, logits, w13, w2, top_k):
    """Routing + torch._grouped_mm (as HF's grouped_mm experts do), no host sync."""
    weights, ids = compiled.moe.routing.topk_route_ref(logits, top_k, True)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tokens = order // top_k
    h = torch._grouped_mm(x[tokens], w13.transpose(1, 2), offs=offs)
    gate, up = h.split(w2.shape[2], dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, y)


def hf_experts(w13_list, w2_list, impl):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe import modeling_qwen3_moe as modeling
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=TOP_K,
                         norm_topk_prob=True)
    cfg._experts_implementation = impl
    mods = []
    for w13, w2 in zip(w13_list, w2_list):
        with torch.device("meta"):
            m = modeling.Qwen3MoeExperts(cfg)
        m.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
        m.down_proj = torch.nn.Parameter(w2, requires_grad=False)
        m.act_fn = torch.nn.SiLU()
        mods.append(m)
    return mods


@dataclass
class Bench:
    """What every token count's measurements share: the layers' experts (`scales`: FP8 ones'),
    one workspace, HF's expert modules (bf16 only), the copy bandwidth and the matmul rate."""
    w13: list
    w2: list
    scales: list
    ws: fm.MoEWorkspace
    hf: dict
    bw: float
    mm: float
    args: argparse.Namespace

    @property
    def fp8(self) -> bool:
        return self.scales[0] is not None

    def fused(self, l: int, x, w, i, **kw):
        return fm.fused_moe_triton(x, w, i, self.w13[l], self.w2[l], workspace=self.ws, scales=self.scales[l], **kw)

    def dequantized(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer l's experts as the reference computes with them (FP8 ones dequantized)."""
        sc = self.scales[l]
        if sc is None:
            return self.w13[l], self.w2[l]
        return tuple(dequantize_blocks(w, s, sc.block, torch.bfloat16) for w, s in ((self.w13[l], sc.w13),
                                                                                    (self.w2[l], sc.w2)))


def run(args) -> dict:
    torch.manual_seed(0)
    dev_name = torch.cuda.get_device_name()
    import triton
    fp8 = args.quantization == "fp8"
    info = dict(device=dev_name, torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv), layers=args.layers,
                experts="fp8 (128 x 128 blocks)" if fp8 else "bf16")
    bw = copy_bandwidth()
    mm = matmul_rate()
    info.update(copy_bytes_per_s=bw, matmul_flops=mm)
    print(f"device {dev_name}; torch {torch.__version__}; triton {triton.__version__}", flush=True)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write); bf16 matmul 8192^3 {mm / 1e12:.0f} TFLOP/s", flush=True)
    w13, w2, scales = experts(args.layers, fp8)
    hf = {}
    for impl in (() if fp8 else ("eager", "grouped_mm")):
        try:
            hf[impl] = hf_experts(w13, w2, impl)
        except Exception as exc:  # noqa: BLE001
            print(f"HF experts ({impl}) unavailable: {type(exc).__name__}: {exc}", flush=True)
    bench = Bench(w13, w2, scales, fm.MoEWorkspace(), hf, bw, mm, args)
    rows = [measure(bench, T) for T in args.tokens]
    return dict(info=info, rows=rows, targets=targets(rows))


def measure(b: Bench, T: int) -> dict:
    """One token count's row: the fused MoE (its TMA variant, with routing), the baselines over bf16
    experts, the agreement with the reference."""
    L, args = b.args.layers, b.args
    g = torch.Generator(device="cuda").manual_seed(1000 + T)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    logits = [torch.randn(T, E, device="cuda", generator=g) for _ in range(L)]
    routes = [torch.ops.compiled.topk_route(lg, TOP_K, True) for lg in logits]
    n_experts = sum(int(torch.unique(i).numel()) for _, i in routes) / L
    floor_us = n_experts * expert_bytes(b.fp8) / b.bw * 1e6
    flops = 6 * T * TOP_K * H * I
    row = dict(tokens=T, experts=n_experts, floor_us=floor_us)

    def attempt(key, fn):
        try:
            row[key] = fn()
        except Exception as exc:  # noqa: BLE001
            row[key] = None
            row[key + "_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(f"  T={T} {key}: {row[key + '_error']}", flush=True)

    fused_fns = [lambda l=l: b.fused(l, x, *routes[l]) for l in range(L)]
    attempt("fused_us", lambda: time_graph(fused_fns, reps=args.reps) / L)
    if T >= args.paired_from:
        attempt("fused_frac_matmul_paired", lambda: paired_fraction(fused_fns, L, flops)[0])
    if T > 1:   # one token runs the GEMVs, which take no config
        tma_cfg = with_tma(tc.get_config(T, E, I, torch.bfloat16, fp8=b.fp8))
        attempt("fused_tma_us", lambda: time_graph(
            [lambda l=l: b.fused(l, x, *routes[l], config=tma_cfg) for l in range(L)], reps=args.reps) / L)
    if T == 1 and args.sweep_gemv:
        row["gemv_sweep"] = sweep_gemv(b, x, routes)

    def fused_route(l):
        return b.fused(l, x, *torch.ops.compiled.topk_route(logits[l], TOP_K, True))
    attempt("fused_route_us", lambda: time_graph([lambda l=l: fused_route(l) for l in range(L)], reps=args.reps) / L)
    if not b.fp8:
        baselines(b, T, x, logits, routes, attempt)
    try:   # agreement with the reference (layer 0; FP8: over the dequantized experts)
        ours = b.fused(0, x, *routes[0])
        ref = fm.fused_moe_ref(x, *routes[0], *b.dequantized(0))
        row["max_abs_diff_vs_ref"] = (ours.float() - ref.float()).abs().max().item()
    except Exception as exc:  # noqa: BLE001
        row["max_abs_diff_vs_ref"] = f"{type(exc).__name__}: {exc}"
    if row.get("fused_us"):
        row["fused_x_floor"] = row["fused_us"] / floor_us
        row["fused_tflops"] = flops / (row["fused_us"] * 1e-6) / 1e12
        row["fused_frac_matmul"] = flops / (row["fused_us"] * 1e-6) / b.mm
    print(f"  T={T}: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in row.items() if not k.endswith("_error") and k != "gemv_sweep"),
          flush=True)
    return row


def baselines(b: Bench, T: int, x, logits, routes, attempt) -> None:
    """torch routing + torch._grouped_mm, and HF's expert modules (bf16 experts)."""
    L, reps = b.args.layers, b.args.reps

    def gmm():
        fns = [lambda l=l: grouped_mm_moe(x, logits[l], b.w13[l], b.w2[l], TOP_K) for l in range(L)]
        try:
            return time_graph(fns, reps=reps) / L
        except Exception:  # noqa: BLE001  (not capturable here: plain launches)
            torch.cuda.synchronize()
            return time_events(lambda: [f() for f in fns], reps=reps) / L
    attempt("gmm_route_us", gmm)
    for impl, key in (("eager", "hf_eager_us"), ("grouped_mm", "hf_gmm_us")):
        if impl in b.hf:
            mods = b.hf[impl]
            wts = [w.to(torch.bfloat16) for w, _ in routes]
            n = 3 if impl == "eager" and T >= 512 else max(3, reps // 2)
            attempt(key, lambda mods=mods, wts=wts, n=n: time_events(
                lambda: [mods[l](x, routes[l][1], wts[l]) for l in range(L)], reps=n, warmup=1) / L)


def with_tma(cfg: dict) -> dict:
    """The config with both GEMMs loading their weight tiles through TMA descriptors."""
    return dict(cfg, TMA=1, down=dict(cfg.get("down") or {}, TMA=1))


GEMV_MAX_CONFIGS = 0   # > 0: the first that many tiles of each stage's grid (smoke runs)
GEMV_STAGES = 3        # the pipelined variant of each tile the sweep tries


def gemv_grids(fp8: bool, start: dict | None = None) -> dict[str, list[dict]]:
    """The tiles the sweep tries for each GEMV, nearest first to `start` (the tiles the op runs now),
    else to GEMV_TILES (a first sweep's best over bf16 experts: up 4 x 1024, down 8 x 256, 4 warps),
    so that a sweep cut short by its time limit has tried the likeliest: the tiles of the start's
    bytes a K step (FP8 against GEMV_TILES: twice its elements), then the nearest column count, then
    the nearest warps. FP8 experts' rows are half the bytes, so wider tiles too."""
    up_bn, down_bn = ((2, 4, 8, 16, 32), (4, 8, 16, 32, 64)) if fp8 else ((2, 4, 8), (4, 8, 16))
    # each tile unpipelined and with STAGES K tiles in flight, side by side in the order below
    grids = dict(up=[dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st) for bn in up_bn
                     for bk in (512, 1024, 2048) for w in (2, 4, 8) for st in (1, GEMV_STAGES)],
                 down=[dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st) for bn in down_bn
                       for bk in (128, 256, 512) for w in (2, 4, 8) for st in (1, GEMV_STAGES)])
    elem_bytes = 1 if fp8 else 2
    ref_bytes_each = elem_bytes if start is not None else 2

    def distance(stage: str, tile: dict) -> tuple[float, float, float]:
        ref = (start or tc.GEMV_TILES)[stage]
        tile_bytes = tile["BLOCK_N"] * tile["BLOCK_K"] * elem_bytes
        ref_bytes = ref["BLOCK_N"] * ref["BLOCK_K"] * ref_bytes_each
        return (abs(math.log2(tile_bytes / ref_bytes)), abs(math.log2(tile["BLOCK_N"] / ref["BLOCK_N"])),
                abs(math.log2(tile["num_warps"] / ref["num_warps"])))
    grids = {stage: sorted(grid, key=lambda t, stage=stage: distance(stage, t)) for stage, grid in grids.items()}
    return {k: v[:GEMV_MAX_CONFIGS] if GEMV_MAX_CONFIGS > 0 else v for k, v in grids.items()}


def sweep_gemv(b: Bench, x: torch.Tensor, routes: list) -> list[dict]:
    """µs per layer of the one-token GEMVs: the tiles they run now (the tuned file's, else
    GEMV_TILES; "start": True), then over a grid of tiles the up kernel's with the best down tile so
    far, then the down kernel's with the best up tile; best first."""
    L, reps = b.args.layers, b.args.reps
    t0, limit = time.time(), b.args.time_limit_s if b.args.time_limit_s > 0 else float("inf")

    def timed(cfg: dict) -> float | None:
        try:
            return time_graph([lambda l=l: b.fused(l, x, *routes[l], gemv_tiles=cfg) for l in range(L)],
                              reps=reps) / L
        except Exception as exc:  # noqa: BLE001  (out of registers, ...)
            print(f"  gemv {cfg}: {type(exc).__name__}", flush=True)
            return None
    start = tc.get_gemv_tiles(E, I, torch.bfloat16, x.device, b.fp8)
    us = timed(start)
    results = [] if us is None else [dict(start, us=us, start=True)]
    print(f"  gemv now: {start}: {us} us", flush=True)
    for n, (stage, grid) in enumerate(gemv_grids(b.fp8, start).items(), 1):
        base = {k: results[0][k] for k in tc.GEMV_STAGES} if results else dict(start)
        for tile in grid:
            if time.time() - t0 > limit * n / 2:   # each stage its half of the time: the best so far
                print(f"  gemv sweep: time limit, {stage} tiles from {tile} on not tried", flush=True)
                break
            cfg = dict(base, **{stage: tile})
            us = timed(cfg)
            if us is not None:
                results.append(dict(cfg, us=us))
        results.sort(key=lambda r: r["us"])
    for r in results[:8]:
        print(f"  gemv sweep: {r}", flush=True)
    return results


def write_gemv(folder: str, best: dict, b: Bench, device: torch.device) -> Path:
    """`best`'s tiles as the "gemv" entry of the tuned file for this shape, device and experts'
    dtype in `folder` (its other entries kept, `tune_moe.merge_entry`)."""
    dtype = tc.config_dtypes(torch.bfloat16, b.fp8)[0]
    path = Path(folder) / tc.config_file_name(E, I, tc.device_name(device), dtype)
    entry = tc.check_gemv({k: best[k] for k in tc.GEMV_STAGES}, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tune_moe.merge_entry(path, "gemv", entry, dict(gemv_us=round(best["us"], 2), gemv_layers=b.args.layers,
                                                   gemv_date=time.strftime("%Y-%m-%d")))
    tc.clear_caches()
    print(f"wrote gemv {entry} ({best['us']:.1f} us a layer) into {path}", flush=True)
    return path


def gemv_only(args) -> dict:
    """The one-token GEMV sweep alone (`--only-gemv`), its best tiles written with --write-gemv."""
    dev = torch.device(tune_moe.DEVICE)
    fp8 = args.quantization == "fp8"
    b = Bench(*experts(args.layers, fp8), fm.MoEWorkspace(), {}, 0.0, 0.0, args)
    g = torch.Generator(device=dev).manual_seed(1001)
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16, generator=g)
    routes = [torch.ops.compiled.topk_route(torch.randn(1, E, device=dev, generator=g), TOP_K, True)
              for _ in range(args.layers)]
    results = sweep_gemv(b, x, routes)
    if not results:
        sys.exit("moe_bench.py: no GEMV tile ran")
    out = dict(info=dict(device=tc.device_name(dev), E=E, H=H, I=I, top_k=TOP_K, layers=args.layers,
                         experts="fp8" if fp8 else "bf16", command=" ".join(sys.argv)), gemv_sweep=results)
    if args.write_gemv:
        out["wrote"] = str(write_gemv(args.write_gemv, results[0], b, dev))
    return out


def sweep_align(tokens: list[int], layers: int, reps: int) -> dict[int, list[dict]]:
    """µs per call of moe_align_block_size over a grid of launch shapes, at each token count with
    the tuned BLOCK_SIZE_M; every variant's segments checked against the default's."""
    out = {}
    for T in tokens:
        bm = tc.split_config(tc.get_config(T, E, I, torch.bfloat16))[0]["BLOCK_SIZE_M"]
        ids = [torch.ops.compiled.topk_route(torch.randn(T, E, device="cuda"), TOP_K, True)[1] for _ in range(layers)]
        want = [_segments(*fm.moe_align_block_size(i, E, bm), bm) for i in ids]
        default = fm.align_launch(T * TOP_K, E, bm)
        results = []
        for chunk in (16, 32, 64, 128, 256, 512, 1024):
            for sub in (32, 64):
                for bb in (16, 32):
                    for warps in (1, 2, 4):
                        if sub > chunk or chunk > max(16, 4 * T * TOP_K):
                            continue
                        lc = fm.AlignLaunch(chunk, sub, bb, warps)
                        ws = [fm.MoEWorkspace() for _ in ids]
                        try:
                            got = [_segments(*fm.moe_align_block_size(i, E, bm, w, lc), bm) for i, w in zip(ids, ws)]
                            assert got == want, "segments differ from the default launch's"
                            us = time_graph([lambda i=i, w=w: fm.moe_align_block_size(i, E, bm, w, lc)
                                             for i, w in zip(ids, ws)], reps=reps) / layers
                        except Exception as exc:  # noqa: BLE001
                            print(f"  align T={T} {lc}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                            continue
                        results.append(dict(chunk=chunk, sub=sub, bb=bb, warps=warps, us=us,
                                            default=lc == default))
        results.sort(key=lambda r: r["us"])
        base = next((r for r in results if r["default"]), None)
        print(f"  align T={T} BM={bm}: default {base}; best: " + "; ".join(str(r) for r in results[:5]), flush=True)
        out[T] = results
    return out


def _segments(sorted_ids, expert_ids, num_post, bm: int) -> tuple:
    """(padded total, expert of each live block, each expert's pairs): what the GEMMs compute on
    (the order of pairs inside a segment depends on the launch and changes nothing)."""
    n = int(num_post.item())
    experts = expert_ids[:n // bm].tolist()
    rows = sorted_ids[:n].view(-1, bm).tolist()
    pairs: dict[int, list[int]] = {}
    for e, row in zip(experts, rows):
        pairs.setdefault(e, []).extend(row)
    return n, experts, {e: sorted(v) for e, v in pairs.items()}


def targets(rows) -> dict:
    by_t = {r["tokens"]: r for r in rows}
    out = {}
    if by_t.get(1, {}).get("fused_x_floor"):
        out["1_token_le_1.4x_floor"] = dict(value=by_t[1]["fused_x_floor"], met=by_t[1]["fused_x_floor"] <= 1.4)
    if by_t.get(64, {}).get("fused_x_floor"):
        out["64_tokens_le_1.25x_floor"] = dict(value=by_t[64]["fused_x_floor"], met=by_t[64]["fused_x_floor"] <= 1.25)
    for key, name in (("fused_frac_matmul", "4096_tokens_ge_50pct_matmul"),
                      ("fused_frac_matmul_paired", "4096_tokens_ge_50pct_matmul_paired")):
        if by_t.get(4096, {}).get(key):
            out[name] = dict(value=by_t[4096][key], met=by_t[4096][key] >= 0.5)
    return out


def table(result) -> str:
    def f(v, fmt="{:.1f}"):
        return fmt.format(v) if isinstance(v, (int, float)) and v is not None else "-"
    info = result["info"]
    lines = [f"MoE layer E={E} H={H} I={I} top-{TOP_K} {info.get('experts', 'bf16')} experts on {info['device']} "
             f"(torch {info['torch']}, triton {info['triton']}, {info['layers']} layers cycled)",
             f"copy {info['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {info['matmul_flops'] / 1e12:.0f} TFLOP/s",
             "| tokens | experts | floor µs | fused µs | ×floor | TMA µs | fused+route µs "
             "| gmm+route µs | HF eager µs | HF gmm µs | fused TFLOP/s | % matmul | % matmul paired |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append("| " + " | ".join([
            str(r["tokens"]), f(r["experts"]), f(r["floor_us"]), f(r.get("fused_us")),
            f(r.get("fused_x_floor"), "{:.2f}"), f(r.get("fused_tma_us")),
            f(r.get("fused_route_us")),
            f(r.get("gmm_route_us")),
            f(r.get("hf_eager_us"), "{:.0f}"), f(r.get("hf_gmm_us")), f(r.get("fused_tflops"), "{:.0f}"),
            f(100 * r["fused_frac_matmul"] if r.get("fused_frac_matmul") else None, "{:.0f}"),
            f(100 * r["fused_frac_matmul_paired"] if r.get("fused_frac_matmul_paired") else None, "{:.1f}")]) + " |")
    for name, t in result["targets"].items():
        lines.append(f"target {name}: {t['value']:.2f} -> {'MET' if t['met'] else 'MISSED'}")
    return "\n".join(lines)


def kernel_profile(tokens: list[int], layers: int, calls: int = 5) -> dict[int, dict[str, float]]:
    """µs per call of each kernel of fused_moe_triton (routing given), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    w13, w2 = make_weights(layers, E, H, I, torch.bfloat16)
    ws = fm.MoEWorkspace()
    out = {}
    for T in tokens:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        w, i = torch.ops.compiled.topk_route(torch.randn(T, E, device="cuda"), TOP_K, True)
        for l in range(layers):   # compile and warm up
            fm.fused_moe_triton(x, w, i, w13[l], w2[l], workspace=ws)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for c in range(calls):
                fm.fused_moe_triton(x, w, i, w13[c % layers], w2[c % layers], workspace=ws)
            torch.cuda.synchronize()
        times = {e.key: e.device_time_total / calls for e in prof.key_averages() if e.device_time_total > 0}
        out[T] = dict(sorted(times.items(), key=lambda kv: -kv[1]))
        print(f"  T={T} kernels (µs per call): " + ", ".join(f"{k[:40]} {v:.1f}" for k, v in out[T].items()),
              flush=True)
    return out


def main(argv=None):
    global E, H, I, TOP_K, GEMV_MAX_CONFIGS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 64, 512, 4096])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="moe_bench.json")
    p.add_argument("--E", type=int, default=E)
    p.add_argument("--H", type=int, default=H)
    p.add_argument("--I", type=int, default=I)
    p.add_argument("--topk", type=int, default=TOP_K)
    p.add_argument("--quantization", choices=("none", "fp8"), default="none",
                   help="fp8: dummy FP8 experts (128 x 128 block scales) through the op's FP8 path")
    p.add_argument("--paired-from", type=int, default=2048,
                   help="from this token count on, also time the fused MoE and the matmul alternately")
    p.add_argument("--sweep-gemv", action="store_true",
                   help="time the one-token GEMVs over a grid of (up, down) tiles")
    p.add_argument("--only-gemv", action="store_true", help="the GEMV sweep alone (nothing else is timed)")
    p.add_argument("--write-gemv", nargs="?", const=str(tc.CONFIG_DIR), default=None, metavar="DIR",
                   help="write the sweep's best tiles into the \"gemv\" entry of DIR's tuned file for this "
                        "shape, device and experts' dtype (default DIR: the checked-in configs)")
    p.add_argument("--max-configs", type=int, default=0, help="> 0: the first N tiles of each GEMV grid only")
    p.add_argument("--time-limit-s", type=float, default=0.0,
                   help="> 0: the GEMV sweep's time (half for each GEMV's tiles; the best so far wins)")
    p.add_argument("--sweep-align", type=int, nargs="*", default=None,
                   help="time the alignment kernels' launch shapes at these token counts (and nothing else)")
    p.add_argument("--profile", type=int, nargs="*", default=None,
                   help="also profile the kernels of one call at these token counts")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: --only-gemv smoke run
    args = p.parse_args(argv)
    E, H, I, TOP_K, GEMV_MAX_CONFIGS = args.E, args.H, args.I, args.topk, args.max_configs
    tune_moe.DEVICE = args.device
    args.sweep_gemv = args.sweep_gemv or args.only_gemv or args.write_gemv is not None
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("moe_bench.py needs a CUDA device")
    if args.device != "cuda" and not args.only_gemv:
        sys.exit("moe_bench.py: --device cpu runs --only-gemv only")
    if args.write_gemv is not None and not args.only_gemv:
        sys.exit("moe_bench.py: --write-gemv goes with --only-gemv")
    if args.only_gemv:
        Path(args.out).write_text(json.dumps(gemv_only(args), indent=1) + "\n")
        return
    if args.sweep_align:
        Path(args.out).write_text(json.dumps(sweep_align(args.sweep_align, args.layers, args.reps), indent=1) + "\n")
        return
    result = run(args)
    if args.profile:
        result["kernels_us"] = kernel_profile(args.profile, args.layers)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
