"""Tune the fused-MoE Triton configs on this GPU and write the JSON table the op loads.

    PYTHONPATH=$PWD python bench/tune_moe.py --E 128 --H 2048 --I 768 --topk 8 \
        [--dtype bfloat16] [--quantization fp8 [--fp8-mode op]] [--out-dir compiled/moe/configs] [--tokens 1 8 64 ...] \
        [--budget-s 240] [--time-limit-s 0]

For every token count: random router logits -> top-k; for each candidate BLOCK_SIZE_M the up GEMM
(w13 + silu*up) and the down GEMM (w2 + weight) are timed separately over the same small search
space (they are independent once BLOCK_SIZE_M fixes the alignment), so the search is additive rather
than multiplicative; the best BLOCK_SIZE_M by alignment + up + down wins, and the down GEMM's own
best tile goes into the entry's "down" field (from 64-row blocks its tiles may be half as tall:
`gemm_space`). Every timing is a CUDA graph of one launch per layer over `--layers` copies of the
weights (more bytes than L2), median of replays. All configs are
compiled first by a pool of worker processes (Triton's on-disk cache is shared). The file is
rewritten after each token count, so a run cut short still leaves a usable table; a "gemv" entry
already in it (`moe_bench.py --write-gemv`) is kept.

`--quantization fp8`: dummy FP8 experts (random float8_e4m3fn weights, random block scales at
`--weight-block`, 128 x 128 by default), both modes at every token count: W8A16 and W8A8 (the
activations' quantization pass counted in its total, the intermediate's in the up GEMM's time (its
epilogue quantizes it where its N tiles hold whole scale blocks, else a pass follows it); 64-row tiles added
to its candidates at a few tokens, where fp8 dots reach the wgmma). The faster goes into the entry
with its mode (`tuned_configs.MODE_KEY`), which the op then runs. K tiles are fitted to the scale
blocks as the op fits them; configs the op would not run W8A8 (K tiles under FP8_DOT_MIN_K or
straddling a block) are left out of the W8A8 search, and TMA is searched only where it changes a
launch (W8A16's FP8 weights take none). The table goes to the FP8 experts' file
(`tuned_configs.config_dtypes`). `--fp8-mode w8a16|w8a8` times that mode alone (nothing written)."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from compiled.moe import fused_moe as fm  # noqa: E402
from compiled.moe import tuned_configs as tc  # noqa: E402
from compiled.quant.act_quant import quantize_per_token_group  # noqa: E402
from compiled.quant.dequant import FP8, fit_block_k, resolve_block  # noqa: E402
from compiled.triton_utils import fp8_dot_fits  # noqa: E402

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
ORDER = [1, 8, 64, 512, 4096, 2048, 16, 128, 1024, 32, 256, 4, 2]  # most important first (time budget)
SMEM_BYTES = 227 * 1024
DEVICE = "cuda"  # "cpu" only for a smoke run under TRITON_INTERPRET=1 (wall-clock timing)
FP8_BLOCK = (128, 128)  # Qwen's and DeepSeek's FP8 checkpoints


# ----------------------------------------------------------------------------- timing helpers

def time_graph(fns, reps: int = 10, warmup: int = 2) -> float:
    """Median µs of one pass over `fns` (each called once), captured as one CUDA graph."""
    for f in fns:  # compile / autotune outside the capture
        f()
    if DEVICE == "cpu":
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    del graph
    return statistics.median(times)


def time_events(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median µs of fn() (host syncs allowed) measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def make_weights(layers: int, E: int, H: int, I: int, dtype, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = [(torch.randn(E, 2 * I, H, device=DEVICE, generator=g, dtype=dtype) * H ** -0.5) for _ in range(layers)]
    w2 = [(torch.randn(E, H, I, device=DEVICE, generator=g, dtype=dtype) * I ** -0.5) for _ in range(layers)]
    return w13, w2


def dummy_fp8(g: torch.Generator, lead: tuple, rows: int, cols: int, block=FP8_BLOCK) -> tuple:
    """(q `[*lead, rows, cols]`, s): random float8_e4m3fn weights (normal values, inside e4m3's range)
    and random fp32 block scales at `block` around 1/sqrt(cols), so the dequantized weight is of a
    bf16 one's magnitude."""
    bo, bi = resolve_block(block, rows, cols)
    q = torch.randn(*lead, rows, cols, device=DEVICE, generator=g, dtype=torch.bfloat16).to(FP8)
    s = (0.5 + torch.rand(*lead, -(-rows // bo), -(-cols // bi), device=DEVICE, generator=g)) * cols ** -0.5
    return q, s


def make_fp8_weights(layers: int, E: int, H: int, I: int, block=FP8_BLOCK, seed: int = 0):
    """(w13, w2, scales): `layers` copies of dummy FP8 experts (`dummy_fp8`), scales a
    `fm.ExpertScales` each."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w13, w2, scales = [], [], []
    for _ in range(layers):
        (q13, s13), (q2, s2) = dummy_fp8(g, (E,), 2 * I, H, block), dummy_fp8(g, (E,), H, I, block)
        w13.append(q13)
        w2.append(q2)
        scales.append(fm.ExpertScales(s13, s2, list(block)))
    return w13, w2, scales


def make_routing(layers: int, T: int, E: int, top_k: int, seed: int = 1):
    g = torch.Generator(device=DEVICE).manual_seed(seed + T)
    logits = [torch.randn(T, E, device=DEVICE, generator=g) for _ in range(layers)]
    return logits, [fm_route(lg, top_k) for lg in logits]


def fm_route(logits, top_k):
    from compiled.moe.routing import topk_route_ref
    return topk_route_ref(logits, top_k, True)


# ----------------------------------------------------------------------------- search space

@dataclass(frozen=True)
class Mode:
    """How the op runs the grouped GEMMs at a token count: over bf16 experts (not `fp8`), or FP8
    experts W8A16 or (`w8a8`) W8A8, whose weights' scale blocks are `bi_up` (w13, along H) and
    `bi_down` (w2, along I) wide."""
    fp8: bool = False
    w8a8: bool = False
    bi_up: int = 0
    bi_down: int = 0

    @property
    def name(self) -> str:
        return "w8a8" if self.w8a8 else "w8a16" if self.fp8 else "plain"

    def tma_counts(self, down: bool) -> bool:
        """Whether TMA changes a launch: W8A16's FP8 weights take no descriptor (its down GEMM's
        16-bit intermediate does); W8A8's weights and intermediate do."""
        return not self.fp8 or self.w8a8 or down


FP8_MODE = "op"   # --fp8-mode: "op" (both modes, the faster written), "w8a16" or "w8a8" alone


def modes_at(T: int, block: tuple[int, int] | None, H: int, I: int) -> list[Mode]:
    """The modes searched at T tokens: plain experts' one (`block` None); for FP8 experts (`block`:
    their scale block) W8A16 and W8A8, the faster going into the entry, or FP8_MODE's one."""
    if block is None:
        return [Mode()]
    bi_up, bi_down = resolve_block(block, 2 * I, H)[1], resolve_block(block, H, I)[1]
    w8a8 = (False, True) if FP8_MODE == "op" else (FP8_MODE == "w8a8",)
    return [Mode(True, w, bi_up, bi_down) for w in w8a8]


WGMMA_MIN_M = 64   # tl.dot on fp8 operands reaches Hopper's fp8 wgmma from 64 rows; below, 16-bit MMAs


def block_m_candidates(T: int, mode: Mode = Mode()) -> list[int]:
    if T <= 16:
        out = [16]
    elif T <= 64:
        out = [16, 32]
    elif T <= 256:
        out = [16, 32, 64]
    elif T <= 1024:
        out = [32, 64, 128]
    else:
        out = [64, 128, 256]
    # W8A8 at a few tokens: a 64-row tile of one or two live rows, but the weights' fp8 tiles go to
    # the tensor cores as they are, where the smaller tiles convert them to 16 bits
    return out + [WGMMA_MIN_M] if mode.w8a8 and max(out) < WGMMA_MIN_M else out


MAX_CONFIGS = 0  # > 0: keep that many configs per space (smoke runs)
TMA_CHOICES = (0, 1)


def _combos(bm: int, down: bool) -> list[tuple]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_SIZE_M) candidates at this BLOCK_SIZE_M."""
    if bm == 16:  # decode: streaming weights; narrow tiles and more CTAs help wave balance
        # 8 warps for the wide tiles too: two 4-warp programs an SM leave each scheduler two warps
        # to hide the chain from a tile's load through its conversion (FP8) to the MMA
        combos = []
        for bn in (16, 32, 64, 128):
            for bk in ((128, 256, 512) if bn <= 32 else (64, 128, 256)):
                for w in ((2, 4) if bn <= 32 else (4, 8)):
                    combos += [(bn, bk, w, st, 1) for st in (3, 4, 5)]
        return combos
    if bm == 32:
        return [(bn, bk, 4, st, 1) for bn in (32, 64, 128) for bk in (64, 128, 256) for st in (3, 4, 5)]
    if bm == 64:
        bns = (64, 128, 256) if down else (64, 128)
        return [(bn, bk, w, st, 8) for bn in bns for bk in (64, 128) for w in (4, 8) for st in (3, 4)]
    if bm == 128:
        bns = (128, 256) if down else (64, 128)
        return [(bn, bk, w, st, g) for bn in bns for bk in (64, 128) for w in (4, 8) for st in (3, 4, 5)
                for g in (8, 32)]
    # 256 rows: half the blocks, so each expert's weight tiles are read half as often
    bns = (64, 128) if down else (64,)
    return [(bn, bk, 8, st, g) for bn in bns for bk in (32, 64) for st in (3, 4) for g in (8, 32)]


def _fit_k(bk: int, down: bool, mode: Mode) -> int | None:
    """The K tile the op launches for `bk` in this mode (FP8: fitted to the scale block), or None
    where the mode cannot take it (W8A8: tiles under FP8_DOT_MIN_K or not inside one block)."""
    if not mode.fp8:
        return bk
    bi = mode.bi_down if down else mode.bi_up
    bk = fit_block_k(bi, bk)
    if mode.w8a8 and not fp8_dot_fits(bk, bi):
        return None
    return bk


def _smem(bm: int, bn: int, bk: int, st: int, down: bool, mode: Mode) -> int:
    """Shared memory of the pipelined tiles (bytes): FP8 weights are 1-byte loads, converted to
    16-bit for the dot (one more tile) unless W8A8, whose activations are 1-byte too."""
    n_acc = 1 if down else 2
    a_bytes, w_bytes = (1 if mode.w8a8 else 2), (1 if mode.fp8 else 2)
    converted = n_acc * bn * bk * 2 if mode.fp8 and not mode.w8a8 else 0
    return st * (bm * bk * a_bytes + n_acc * bn * bk * w_bytes) + converted


def _space(bm: int, down: bool, mode: Mode = Mode()) -> list[dict]:
    """Candidate tiles for one GEMM at this BLOCK_SIZE_M in this mode, pruned by shared memory and
    registers, without two configs the op would launch alike."""
    n_acc = 1 if down else 2
    out = []
    for bn, bk, w, st, g in _combos(bm, down):
        bk = _fit_k(bk, down, mode)
        if bk is None or _smem(bm, bn, bk, st, down, mode) > SMEM_BYTES or n_acc * bm * bn / (w * 32) > 128:
            continue
        for half in ((0, 1, 2) if bm >= 64 else (0,)):  # half/quarter-height tiles for partial blocks
            for tma in (TMA_CHOICES if mode.tma_counts(down) else (0,)):  # TMA descriptors or pointer loads
                for swap in ((0, 1) if mode.w8a8 and bm == 16 else (0,)):  # W8A8: weight x rows MMAs
                    cfg = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=g,
                               num_warps=w, num_stages=st, HALF_M=half, TMA=tma, SWAP_AB=swap)
                    if cfg not in out:
                        out.append(cfg)
    return out[:MAX_CONFIGS] if MAX_CONFIGS > 0 else out


ALIGN_KEY = "ALIGN_M"   # a down candidate's alignment block height, where its tiles are shorter


def gemm_space(bm: int, down: bool, mode: Mode = Mode()) -> list[dict]:
    """`_space` at this BLOCK_SIZE_M (the alignment's blocks); for the down GEMM from 64 rows also
    its tiles at half that height (ALIGN_KEY: the blocks' height; a program runs a block's two in
    turn), so that a tall up tile need not make the short-K down GEMM's tiles as tall."""
    out = _space(bm, down, mode)
    if down and bm >= 64:
        out += [dict(c, **{ALIGN_KEY: bm}) for c in _space(bm // 2, True, mode)]
    return out


def align_m(cfg: dict) -> int:
    """The alignment's block height a candidate runs on."""
    return cfg.get(ALIGN_KEY, cfg["BLOCK_SIZE_M"])


def all_jobs(tokens, block: tuple[int, int] | None = None, H: int = 0, I: int = 0) -> list[tuple]:
    """(kind, mode, config) for every kernel variant the search will launch."""
    jobs = set()
    for T in tokens:
        for mode in modes_at(T, block, H, I):
            for bm in block_m_candidates(T, mode):
                for down in (False, True):
                    for cfg in gemm_space(bm, down, mode):
                        jobs.add(("down" if down else "up", mode, tuple(sorted(cfg.items()))))
    return sorted(jobs, key=lambda j: (j[0], j[1].name, j[2]))


# ----------------------------------------------------------------------------- one problem

class Problem:
    """Buffers for timing the two GEMMs at T tokens over several layers (`scales`: the layers' FP8
    experts' `fm.ExpertScales`; `mode.w8a8`: the GEMMs read x and the intermediate quantized)."""

    def __init__(self, w13, w2, T, top_k, E, seed=1, scales=None, mode: Mode = Mode(), dtype=torch.bfloat16,
                 block_ms: tuple[int, ...] = ()):
        """`block_ms`: BLOCK_SIZE_Ms launched beside T's own candidates (the compile workers launch
        every config at a few tokens): the intermediate holds the rows of the largest."""
        self.w13, self.w2, self.T, self.top_k, self.E = w13, w2, T, top_k, E
        self.layers = len(w13)
        self.scales, self.mode = scales or [None] * self.layers, mode
        H, I = w13[0].shape[2], w2[0].shape[2]
        dtype = dtype if mode.fp8 else w13[0].dtype
        self.x = torch.randn(T, H, device=DEVICE, dtype=dtype)
        _, routes = make_routing(self.layers, T, E, top_k, seed)
        self.weights = [w.reshape(-1).contiguous() for w, _ in routes]
        self.ids = [i.contiguous() for _, i in routes]
        rows = max(fm.intermediate_rows(T * top_k, E, bm) for bm in (*block_m_candidates(T, mode), *block_ms))
        self.inter = torch.randn(rows, I, device=DEVICE, dtype=dtype)   # gemm1 writes by block
        self.y = torch.empty(T * top_k, H, device=DEVICE, dtype=dtype)
        self.aligned: dict[int, list] = {}
        if mode.w8a8:   # (fp8 tensor, group scales) of x and of every intermediate row
            self.xq = quantize_per_token_group(self.x, mode.bi_up)
            self.iq = quantize_per_token_group(self.inter, mode.bi_down)

    def align(self, bm):
        if bm not in self.aligned:
            self.aligned[bm] = [fm.moe_align_block_size(ids, self.E, bm) for ids in self.ids]
        return self.aligned[bm]

    def time_align(self, bm, reps=10):
        ws = [fm.MoEWorkspace() for _ in self.ids]
        return time_graph([lambda i=i, w=w: fm.moe_align_block_size(i, self.E, bm, w) for i, w in zip(self.ids, ws)],
                          reps) / self.layers

    def time_quant(self, bm, reps=10) -> float:
        """W8A8: µs of the op's quantization pass over x; 0 otherwise."""
        if not self.mode.w8a8:
            return 0.0
        xq, xs = self.xq
        return time_graph([lambda: quantize_per_token_group(self.x, self.mode.bi_up, out=xq, scale_out=xs)
                           for _ in self.align(bm)], reps) / self.layers

    def check_rows(self, bm: int) -> None:
        """Raise unless the intermediate holds gemm1's rows at this BLOCK_SIZE_M: writing past it
        would fault and poison the process's CUDA context for every later config."""
        if fm.intermediate_rows(self.T * self.top_k, self.E, bm) > self.inter.shape[0]:
            raise ValueError(f"BLOCK_SIZE_M={bm}: the intermediate was sized for {self.T} tokens' candidates only")

    def fns(self, cfg, down):
        self.check_rows(align_m(cfg))
        out = []
        w8a8 = self.mode.w8a8
        for layer, blocks in enumerate(self.align(align_m(cfg))):
            sc = self.scales[layer]
            if down:
                a, a_s = self.iq if w8a8 else (self.inter, None)
                out.append(lambda l=layer, b=blocks, sc=sc, a=a, a_s=a_s: fm.launch_gemm2(
                    a, self.w2[l], self.y, self.weights[l], b, cfg, self.top_k, scales=sc, a_scale=a_s))
            else:
                out.append(lambda l=layer, b=blocks, sc=sc: self.up(cfg, l, b, sc))
        return out

    def up(self, cfg, layer, blocks, sc):
        """The up GEMM as the op launches it (W8A8: with the intermediate's quantization)."""
        if not self.mode.w8a8:
            fm.launch_gemm1(self.x, self.w13[layer], self.inter, blocks, self.top_k, cfg, scales=sc)
            return
        (xq, xs), (iq, is_) = self.xq, self.iq
        fm.launch_w8a8_gemm1(xq, xs, self.w13[layer], self.inter, (iq, is_, self.mode.bi_down), blocks, self.top_k,
                             cfg, sc)

    def time(self, cfg, down, reps=10):
        return time_graph(self.fns(cfg, down), reps) / self.layers


# ----------------------------------------------------------------------------- parallel compile

def _compile_worker(args):
    jobs, E, H, I, top_k, dtype_name, block, device = args
    global DEVICE
    DEVICE = device
    dtype = getattr(torch, dtype_name)
    e_small = min(E, 8)
    if block is None:
        w13, w2, scales = (*make_weights(1, e_small, H, I, dtype), None)
    else:
        w13, w2, scales = make_fp8_weights(1, e_small, H, I, block)
    failed = []
    probs = {}
    for kind, mode, items in jobs:
        cfg = dict(items)
        try:
            if mode not in probs:   # 16 tokens, in the job's mode
                probs[mode] = Problem(w13, w2, 16, min(top_k, e_small), e_small, seed=3, scales=scales, mode=mode,
                                      dtype=dtype, block_ms=tuple({align_m(dict(j[2])) for j in jobs}))
            probs[mode].fns(cfg, kind == "down")[0]()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # out of resources etc.: dropped from the search
            failed.append((kind, mode, items, f"{type(exc).__name__}: {str(exc)[:160]}"))
    return failed


def precompile(jobs, E, H, I, top_k, dtype_name, workers, block=None):
    if workers <= 1 or not jobs:
        return []
    chunks = [jobs[i::workers] for i in range(workers)]
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        results = pool.map(_compile_worker, [(c, E, H, I, top_k, dtype_name, block, DEVICE) for c in chunks if c])
    return [f for r in results for f in r]


# ----------------------------------------------------------------------------- main

def _best_tile(prob: Problem, T: int, space: list[dict], down: bool) -> tuple[float, dict] | None:
    """(µs, config) of the fastest config of `space` for one GEMM; None if none ran."""
    scored = []
    for cfg in space:
        try:
            scored.append((prob.time(cfg, down), cfg))
        except Exception as exc:  # noqa: BLE001
            print(f"  T={T} {cfg} {'down' if down else 'up'}: {type(exc).__name__}", flush=True)
    return min(scored, key=lambda s: s[0]) if scored else None


def tune_tokens(prob: Problem, T: int, failed: set, thin: bool) -> dict | None:
    """The best entry at T tokens over the BLOCK_SIZE_M candidates (with its timings), or None."""
    best = None
    for bm in block_m_candidates(T, prob.mode):
        res = {}
        for down in (False, True):
            space = [c for c in gemm_space(bm, down, prob.mode)
                     if ("down" if down else "up", prob.mode, tuple(sorted(c.items()))) not in failed]
            if thin:  # out of time: a few plausible tiles only
                space = space[:: max(1, len(space) // 4)]
            res[down] = _best_tile(prob, T, space, down)
            if res[down] is None:
                break
        if res.get(False) is None or res.get(True) is None:
            continue
        t_align, t_quant = prob.time_align(bm), prob.time_quant(bm)
        total = t_align + t_quant + res[False][0] + res[True][0]
        print(f"T={T:5d} BM={bm:3d} {prob.mode.name} align {t_align:7.1f} quant {t_quant:6.1f} "
              f"up {res[False][0]:8.1f} down {res[True][0]:8.1f} total {total:8.1f} us", flush=True)
        if best is None or total < best["total"]:
            best = dict(total=total, align=t_align, quant=t_quant, up=res[False], down=res[True])
    return best


def best_over_modes(w13, w2, scales, T: int, top_k: int, E: int, dtype, modes: list[Mode], failed: set,
                    thin: bool) -> dict | None:
    """`tune_tokens`' best entry at T over `modes` (each its own buffers), its mode under "mode"."""
    best = None
    for mode in modes:
        prob = Problem(w13, w2, T, top_k, E, scales=scales, mode=mode, dtype=dtype)
        found = tune_tokens(prob, T, failed, thin)
        if found is not None and (best is None or found["total"] < best["total"]):
            best = dict(found, mode=mode)
        del prob   # its buffers before the next mode's
    return best


def tune(args) -> dict:
    dtype = getattr(torch, args.dtype)
    E, H, I, top_k = args.E, args.H, args.I, args.topk
    block = tuple(args.weight_block) if args.quantization == "fp8" else None
    tokens = sorted(set(args.tokens), key=lambda t: (ORDER.index(t) if t in ORDER else len(ORDER), t))
    t0 = time.time()
    jobs = all_jobs(tokens, block, H, I)
    print(f"{len(jobs)} kernel variants; compiling with {args.workers} workers", flush=True)
    failures = precompile(jobs, E, H, I, top_k, args.dtype, args.workers, block)
    failed = {(k, m, i) for k, m, i, _ in failures}
    print(f"compiled in {time.time() - t0:.0f}s; {len(failed)} variants dropped", flush=True)
    for reason in sorted({r for *_, r in failures})[:5]:
        print(f"  dropped for {reason}", flush=True)
    if jobs and len(failed) == len(jobs):   # the workers' set-up failed, not the kernels: time them here
        print("every variant failed in the compile workers: none dropped, each compiled when timed", flush=True)
        failed = set()
    if block is None:
        w13, w2, scales = (*make_weights(args.layers, E, H, I, dtype), None)
    else:
        w13, w2, scales = make_fp8_weights(args.layers, E, H, I, block)
    name = tc.config_file_name(E, I, tc.device_name(), tc.config_dtypes(dtype, block is not None)[0])
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    table, old_timings = kept_entries(path) if args.merge else (kept_extras(path), {})
    meta = dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch=torch.__version__,
                triton=_triton_version(), E=E, H=H, I=I, top_k=top_k, dtype=args.dtype, layers=args.layers,
                timings_us=old_timings, **kept_gemv_meta(path))
    if block is not None:
        meta.update(quantization="fp8", weight_block=list(block), w8a8_min_tokens=fm.W8A8_MIN_TOKENS)
    for T in tokens:
        elapsed = time.time() - t0
        if args.time_limit_s and elapsed > args.time_limit_s and T != tokens[0]:
            print(f"time limit: T={T} and later not tuned ({elapsed:.0f}s elapsed)", flush=True)
            break
        best = best_over_modes(w13, w2, scales, T, top_k, E, dtype, modes_at(T, block, H, I), failed,
                               thin=elapsed > args.budget_s)
        if best is None:
            continue
        entry = dict(best["up"][1])
        entry["down"] = {k: best["down"][1][k] for k in tc.DOWN_KEYS}
        if block is not None:
            entry[tc.MODE_KEY] = int(best["mode"].w8a8)
        table[str(T)] = entry
        meta["timings_us"][str(T)] = dict(total=round(best["total"], 2), align=round(best["align"], 2),
                                          up=round(best["up"][0], 2), down=round(best["down"][0], 2),
                                          **(dict(quant=round(best["quant"], 2), mode=best["mode"].name)
                                             if block is not None else {}))
        if FP8_MODE == "op":   # a forced mode's tiles are not what the op would launch at T
            _write(path, table, meta)
        print(f"T={T:5d} best BM={entry['BLOCK_SIZE_M']} total {best['total']:.1f} us  "
              f"({time.time() - t0:.0f}s elapsed)", flush=True)
    print(f"wrote {path}" if FP8_MODE == "op" else f"--fp8-mode {FP8_MODE}: timings only, nothing written")
    return table


def existing_table(path: Path) -> dict:
    """The table at `path`, else the checked-in file of that name, else {}."""
    for p in (path, tc.CONFIG_DIR / path.name):
        if p.is_file():
            print(f"merging into {p}", flush=True)
            return json.loads(p.read_text())
    return {}


def kept_entries(path: Path) -> tuple[dict, dict]:
    """(entries, their timings) of the table being merged into (`path`, else the checked-in file of
    that name). Each token count tuned replaces its own; one a run cut short does not reach keeps
    its old entry, so the file never loses a token count it had."""
    old = existing_table(path)
    timings = old.pop("_meta", {}).get("timings_us", {})
    return old, {k: v for k, v in timings.items() if k in old}


def kept_extras(path: Path) -> dict:
    """The entries other than token counts (the one-token "gemv" tiles) of the table at `path`,
    else of the checked-in file of that name: a retuned table keeps them."""
    return {k: v for k, v in existing_table(path).items() if not k.isdigit() and k != "_meta"}


def kept_gemv_meta(path: Path) -> dict:
    """The "_meta" fields of the table's "gemv" entry (`moe_bench.py --write-gemv`'s timing and
    date), which travel with the entry when the token counts are retuned."""
    return {k: v for k, v in existing_table(path).get("_meta", {}).items() if k.startswith("gemv_")}


def merge_entry(path: Path, key: str, value, meta: dict) -> None:
    """Write `value` as the table's top-level `key` (and `meta` into its "_meta"), keeping every
    other entry of the table at `path` (else of the checked-in file of that name)."""
    table = existing_table(path)
    table[key] = value
    merged = dict(table.pop("_meta", {}))
    merged.update(meta)
    _write(path, table, merged)


def _triton_version():
    import triton
    return triton.__version__


def _write(path: Path, table: dict, meta: dict) -> None:
    """The table, token counts in order, then the other entries and "_meta"; replaced whole (a
    run stopped mid-write leaves the previous file)."""
    ordered = {str(k): table[str(k)] for k in sorted(int(k) for k in table if str(k).isdigit())}
    ordered.update({k: v for k, v in table.items() if not str(k).isdigit()})
    ordered["_meta"] = meta
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(ordered, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--E", type=int, default=128)
    p.add_argument("--H", type=int, default=2048)
    p.add_argument("--I", type=int, default=768)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", help="the activations' dtype")
    p.add_argument("--quantization", choices=("none", "fp8"), default="none",
                   help="fp8: dummy FP8 experts with block scales, written to the FP8 experts' file")
    p.add_argument("--weight-block", type=int, nargs=2, default=list(FP8_BLOCK), metavar=("BO", "BI"),
                   help="the FP8 experts' scale block")
    p.add_argument("--fp8-mode", choices=("op", "w8a16", "w8a8"), default="op",
                   help="FP8 experts' grouped GEMMs in both modes, the faster written with its mode, or one "
                        "mode at every count (timings only, no table written)")
    p.add_argument("--tokens", type=int, nargs="*", default=TOKENS)
    p.add_argument("--layers", type=int, default=4, help="weight copies cycled per timing (beats L2)")
    p.add_argument("--out-dir", default=str(tc.CONFIG_DIR))
    p.add_argument("--budget-s", type=float, default=240.0, help="after this, search a thinned space")
    p.add_argument("--time-limit-s", type=float, default=0.0,
                   help="> 0: start no token count but the first after this many seconds (those done are "
                        "written)")
    p.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    p.add_argument("--max-configs", type=int, default=0, help="> 0: first N configs of each space only")
    p.add_argument("--tma", choices=("0", "1", "both"), default="both",
                   help="weight tiles through TMA descriptors (1), pointer loads (0), or search both")
    p.add_argument("--merge", action="store_true",
                   help="keep the existing table's entries for the token counts not tuned now (or not reached)")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: interpreter smoke run
    args = p.parse_args(argv)
    global DEVICE, MAX_CONFIGS, TMA_CHOICES, FP8_MODE
    DEVICE, MAX_CONFIGS, FP8_MODE = args.device, args.max_configs, args.fp8_mode
    if FP8_MODE != "op" and args.quantization != "fp8":
        sys.exit("tune_moe.py: --fp8-mode goes with --quantization fp8")
    TMA_CHOICES = (0, 1) if args.tma == "both" else (int(args.tma),)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("tune_moe.py needs a CUDA device")
    tune(args)


if __name__ == "__main__":
    main()
