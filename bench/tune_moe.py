"""Tune the fused-MoE Triton configs on this GPU and write the JSON table the op loads.

    PYTHONPATH=$PWD python bench/tune_moe.py --E 128 --H 2048 --I 768 --topk 8 \
        [--dtype bfloat16] [--out-dir compiled/moe/configs] [--tokens 1 8 64 ...] [--budget-s 240]

For every token count: random router logits -> top-k; for each candidate BLOCK_SIZE_M the up GEMM
(w13 + silu*up) and the down GEMM (w2 + weight) are timed separately over the same small search
space (they are independent once BLOCK_SIZE_M fixes the alignment), so the search is additive rather
than multiplicative; the best BLOCK_SIZE_M by alignment + up + down wins, and the down GEMM's own
best tile goes into the entry's "down" field. Every timing is a CUDA graph of one launch per layer
over `--layers` copies of the weights (more bytes than L2), median of replays. All configs are
compiled first by a pool of worker processes (Triton's on-disk cache is shared). The file is
rewritten after each token count, so a run cut short still leaves a usable table."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from compiled.moe import fused_moe as fm  # noqa: E402

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
ORDER = [1, 8, 64, 512, 4096, 2048, 16, 128, 1024, 32, 256, 4, 2]  # most important first (time budget)
SMEM_BYTES = 227 * 1024
DEVICE = "cuda"  # "cpu" only for a smoke run under TRITON_INTERPRET=1 (wall-clock timing)


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


def make_routing(layers: int, T: int, E: int, top_k: int, seed: int = 1):
    g = torch.Generator(device=DEVICE).manual_seed(seed + T)
    logits = [torch.randn(T, E, device=DEVICE, generator=g) for _ in range(layers)]
    return logits, [fm_route(lg, top_k) for lg in logits]


def fm_route(logits, top_k):
    from compiled.moe.routing import topk_route_ref
    return topk_route_ref(logits, top_k, True)


# ----------------------------------------------------------------------------- search space

def block_m_candidates(T: int) -> list[int]:
    if T <= 16:
        return [16]
    if T <= 64:
        return [16, 32]
    if T <= 256:
        return [16, 32, 64]
    if T <= 1024:
        return [32, 64, 128]
    return [64, 128, 256]


MAX_CONFIGS = 0  # > 0: keep that many configs per space (smoke runs)
TMA_CHOICES = (0, 1)


def _space(bm: int, down: bool) -> list[dict]:
    """Candidate tiles for one GEMM at this BLOCK_SIZE_M, pruned by shared memory and registers."""
    n_acc = 1 if down else 2
    combos = []  # (BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_SIZE_M)
    if bm == 16:  # decode: streaming weights; narrow tiles and more CTAs help wave balance
        for bn in (16, 32, 64, 128):
            for bk in ((128, 256, 512) if bn <= 32 else (64, 128, 256)):
                for w in ((2, 4) if bn <= 32 else (4,)):
                    combos += [(bn, bk, w, st, 1) for st in (3, 4, 5)]
    elif bm == 32:
        combos = [(bn, bk, 4, st, 1) for bn in (32, 64, 128) for bk in (64, 128, 256) for st in (3, 4, 5)]
    elif bm == 64:
        bns = (64, 128, 256) if down else (64, 128)
        combos = [(bn, bk, w, st, 8) for bn in bns for bk in (64, 128) for w in (4, 8) for st in (3, 4)]
    elif bm == 128:
        bns = (128, 256) if down else (64, 128)
        combos = [(bn, bk, w, st, g) for bn in bns for bk in (64, 128) for w in (4, 8) for st in (3, 4, 5)
                  for g in (8, 32)]
    else:  # 256 rows: half the blocks, so each expert's weight tiles are read half as often
        bns = (64, 128) if down else (64,)
        combos = [(bn, bk, 8, st, g) for bn in bns for bk in (32, 64) for st in (3, 4) for g in (8, 32)]
    out = []
    for bn, bk, w, st, g in combos:
        smem = st * (bm * bk + n_acc * bn * bk) * 2
        regs = n_acc * bm * bn / (w * 32)
        if smem > SMEM_BYTES or regs > 128:
            continue
        for half in ((0, 1, 2) if bm >= 64 else (0,)):  # half/quarter-height tiles for partial blocks
            for tma in TMA_CHOICES:  # weight tiles through TMA descriptors or pointer loads
                out.append(dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=g,
                                num_warps=w, num_stages=st, HALF_M=half, TMA=tma))
    return out[:MAX_CONFIGS] if MAX_CONFIGS > 0 else out


def all_jobs(tokens) -> list[tuple]:
    """(kind, config) for every kernel variant the search will launch."""
    jobs = set()
    for T in tokens:
        for bm in block_m_candidates(T):
            for down in (False, True):
                for cfg in _space(bm, down):
                    jobs.add(("down" if down else "up", tuple(sorted(cfg.items()))))
    return sorted(jobs)


# ----------------------------------------------------------------------------- one problem

class Problem:
    """Buffers for timing the two GEMMs at T tokens over several layers."""

    def __init__(self, w13, w2, T, top_k, E, seed=1):
        self.w13, self.w2, self.T, self.top_k, self.E = w13, w2, T, top_k, E
        self.layers = len(w13)
        H, I = w13[0].shape[2], w2[0].shape[2]
        dtype = w13[0].dtype
        self.x = torch.randn(T, H, device=DEVICE, dtype=dtype)
        _, routes = make_routing(self.layers, T, E, top_k, seed)
        self.weights = [w.reshape(-1).contiguous() for w, _ in routes]
        self.ids = [i.contiguous() for _, i in routes]
        rows = max(fm.intermediate_rows(T * top_k, E, bm) for bm in block_m_candidates(T))
        self.inter = torch.randn(rows, I, device=DEVICE, dtype=dtype)   # gemm1 writes by block
        self.y = torch.empty(T * top_k, H, device=DEVICE, dtype=dtype)
        self.aligned: dict[int, list] = {}

    def align(self, bm):
        if bm not in self.aligned:
            self.aligned[bm] = [fm.moe_align_block_size(ids, self.E, bm) for ids in self.ids]
        return self.aligned[bm]

    def time_align(self, bm, reps=10):
        ws = [fm.MoEWorkspace() for _ in self.ids]
        return time_graph([lambda i=i, w=w: fm.moe_align_block_size(i, self.E, bm, w) for i, w in zip(self.ids, ws)],
                          reps) / self.layers

    def fns(self, cfg, down):
        out = []
        for layer, blocks in enumerate(self.align(cfg["BLOCK_SIZE_M"])):
            if down:
                out.append(lambda l=layer, b=blocks: fm.launch_gemm2(
                    self.inter, self.w2[l], self.y, self.weights[l], b, cfg, self.top_k))
            else:
                out.append(lambda l=layer, b=blocks: fm.launch_gemm1(
                    self.x, self.w13[l], self.inter, b, self.top_k, cfg))
        return out

    def time(self, cfg, down, reps=10):
        return time_graph(self.fns(cfg, down), reps) / self.layers


# ----------------------------------------------------------------------------- parallel compile

def _compile_worker(args):
    jobs, E, H, I, top_k, dtype_name = args
    import torch as _torch
    dtype = getattr(_torch, dtype_name)
    e_small = min(E, 8)
    w13, w2 = make_weights(1, e_small, H, I, dtype)
    failed = []
    probs = {}
    for kind, items in jobs:
        cfg = dict(items)
        T = 16
        try:
            if T not in probs:
                probs[T] = Problem(w13, w2, T, min(top_k, e_small), e_small, seed=3)
            fn = probs[T].fns(cfg, kind == "down")[0]
            fn()
            if DEVICE == "cuda":
                _torch.cuda.synchronize()
        except Exception as exc:  # out of resources etc.: dropped from the search
            failed.append((kind, items, type(exc).__name__))
    return failed


def precompile(jobs, E, H, I, top_k, dtype_name, workers):
    if workers <= 1 or not jobs:
        return []
    chunks = [jobs[i::workers] for i in range(workers)]
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        results = pool.map(_compile_worker, [(c, E, H, I, top_k, dtype_name) for c in chunks if c])
    return [f for r in results for f in r]


# ----------------------------------------------------------------------------- main

def tune(args) -> dict:
    dtype = getattr(torch, args.dtype)
    E, H, I, top_k = args.E, args.H, args.I, args.topk
    tokens = sorted(set(args.tokens), key=lambda t: (ORDER.index(t) if t in ORDER else len(ORDER), t))
    t0 = time.time()
    jobs = all_jobs(tokens)
    print(f"{len(jobs)} kernel variants; compiling with {args.workers} workers", flush=True)
    failed = {(k, i) for k, i, _ in precompile(jobs, E, H, I, top_k, args.dtype, args.workers)}
    print(f"compiled in {time.time() - t0:.0f}s; {len(failed)} variants dropped", flush=True)
    w13, w2 = make_weights(args.layers, E, H, I, dtype)
    name = fm.config_file_name(E, I, fm.device_name(), dtype)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    table, old_timings = kept_entries(path, tokens) if args.merge else ({}, {})
    meta = dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch=torch.__version__,
                triton=_triton_version(),
                E=E, H=H, I=I, top_k=top_k, dtype=args.dtype, layers=args.layers, timings_us=old_timings)
    for T in tokens:
        over = time.time() - t0 > args.budget_s
        prob = Problem(w13, w2, T, top_k, E)
        best = None
        for bm in block_m_candidates(T):
            res = {}
            for down in (False, True):
                space = [c for c in _space(bm, down)
                         if ("down" if down else "up", tuple(sorted(c.items()))) not in failed]
                if over:  # out of time: a few plausible tiles only
                    space = space[:: max(1, len(space) // 4)]
                scored = []
                for cfg in space:
                    try:
                        scored.append((prob.time(cfg, down), cfg))
                    except Exception as exc:  # noqa: BLE001
                        print(f"  T={T} {cfg} {'down' if down else 'up'}: {type(exc).__name__}", flush=True)
                if not scored:
                    break
                res[down] = min(scored, key=lambda s: s[0])
            if len(res) < 2:
                continue
            t_align = prob.time_align(bm)
            total = t_align + res[False][0] + res[True][0]
            print(f"T={T:5d} BM={bm:3d} align {t_align:7.1f} up {res[False][0]:8.1f} down {res[True][0]:8.1f} "
                  f"total {total:8.1f} us", flush=True)
            if best is None or total < best[0]:
                best = (total, bm, res, t_align)
        if best is None:
            continue
        total, bm, res, t_align = best
        entry = dict(res[False][1])
        d = res[True][1]
        entry["down"] = {k: d[k] for k in fm.DOWN_KEYS}
        table[str(T)] = entry
        meta["timings_us"][str(T)] = dict(total=round(total, 2), align=round(t_align, 2), up=round(res[False][0], 2),
                                          down=round(res[True][0], 2))
        _write(path, table, meta)
        print(f"T={T:5d} best BM={bm} total {total:.1f} us  ({time.time() - t0:.0f}s elapsed)", flush=True)
    print(f"wrote {path}")
    return table


def kept_entries(path: Path, tokens) -> tuple[dict, dict]:
    """(entries, their timings) of the table being merged into (`path`, else the checked-in file of
    that name), for the token counts not in `tokens`."""
    for p in (path, fm.CONFIG_DIR / path.name):
        if p.is_file():
            print(f"merging into {p}", flush=True)
            old = json.loads(p.read_text())
            timings = old.pop("_meta", {}).get("timings_us", {})
            # token-count entries not re-tuned, and the other entries as they are
            table = {k: v for k, v in old.items() if not k.isdigit() or int(k) not in set(tokens)}
            return table, {k: v for k, v in timings.items() if k in table}
    return {}, {}


def _triton_version():
    import triton
    return triton.__version__


def _write(path: Path, table: dict, meta: dict) -> None:
    ordered = {str(k): table[str(k)] for k in sorted(int(k) for k in table if str(k).isdigit())}
    ordered.update({k: v for k, v in table.items() if not str(k).isdigit()})
    ordered["_meta"] = meta
    path.write_text(json.dumps(ordered, indent=1) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--E", type=int, default=128)
    p.add_argument("--H", type=int, default=2048)
    p.add_argument("--I", type=int, default=768)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, nargs="*", default=TOKENS)
    p.add_argument("--layers", type=int, default=4, help="weight copies cycled per timing (beats L2)")
    p.add_argument("--out-dir", default=str(fm.CONFIG_DIR))
    p.add_argument("--budget-s", type=float, default=240.0, help="after this, search a thinned space")
    p.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    p.add_argument("--max-configs", type=int, default=0, help="> 0: first N configs of each space only")
    p.add_argument("--tma", choices=("0", "1", "both"), default="both",
                   help="weight tiles through TMA descriptors (1), pointer loads (0), or search both")
    p.add_argument("--merge", action="store_true",
                   help="keep the existing table's entries for the token counts not tuned now")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: interpreter smoke run
    args = p.parse_args(argv)
    global DEVICE, MAX_CONFIGS, TMA_CHOICES
    DEVICE, MAX_CONFIGS = args.device, args.max_configs
    TMA_CHOICES = (0, 1) if args.tma == "both" else (int(args.tma),)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("tune_moe.py needs a CUDA device")
    tune(args)


if __name__ == "__main__":
    main()
