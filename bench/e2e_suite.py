"""End-to-end numbers for one model, in one process: start-up stages,
decode step latency at several batch sizes, prefill time to first token, the decode graph's GPU
time alone (replayed back to back), profiles of a decode and a prefill step, and optionally an
exported artifact. With --artifact it measures a warm start from that artifact instead.

    python bench/e2e_suite.py MODEL --out results.json [--export DIR] [--artifact DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cli import bench_core as core
from compiled.compilation.inductor import COMPILES
from compiled.passes.variant import BASE
from compiled.runtime.config import EngineConfig


def graph_gpu_ms(llm, bucket: int, reps: int = 50) -> float | None:
    """GPU time of one decode-graph replay: replays queued back to back, timed by events."""
    graphs = llm.engine.runner.variants[BASE].decode
    if graphs is None or bucket not in graphs.graphs:
        return None
    graph = graphs.graphs[bucket]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def synchronous_decode(llm, batch: int, input_len: int, output_len: int) -> dict:
    """The decode step with overlap scheduling off (each step's tokens read back before the next
    launch), same workload and process, for the side-by-side."""
    engine = llm.engine
    engine.overlap_schedule = False
    try:
        return core.latency(llm, batch, input_len, output_len, iters=1, warmup=1, seed=0)[0]["decode_step_ms"]
    finally:
        engine.overlap_schedule = True


def host_split(llm, batch: int, input_len: int, output_len: int, steps: int = 20) -> dict:
    """Host milliseconds per decode step of the whole batch spent in each engine stage (the rest of
    the step is the wait for the GPU and the bookkeeping after it); the requests have `output_len`
    tokens beyond the timed steps, for the steps that fill the batch."""
    engine = llm.engine
    targets = {"schedule": (engine.scheduler, "schedule"), "stage": (engine.runner, "_stage"),
               "replay": (engine.runner.variants[BASE].decode, "replay"), "sampler": (engine, "sampler"),
               "append": (engine, "_append")}
    with core.timed_calls_on(targets) as seconds:
        items = [core.Item(p, steps + output_len) for p in core.random_ids(batch, input_len,
                                                                         llm.model_config.vocab_size, 5)]
        requests = core.make_requests(engine, items)
        for r in requests:
            engine.add(r)
        if core.fill_batch(engine, requests, items) < steps:
            raise ValueError(f"host_split: fewer than {steps} steps of the whole batch {batch}: raise output_len")
        seconds.clear()
        core.sync(llm.config.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - t0
        while engine.has_work:
            engine.step()
    out = {k: 1e3 * v / steps for k, v in seconds.items()}
    out["step"] = 1e3 * total / steps
    return out


def prefill_host_split(llm, prompt, reps: int = 3) -> dict:
    """Host milliseconds per prefill (time to first token) in each engine stage; `run_model` is the
    forward's launches (piece graphs and eager attention), returning before the GPU is done."""
    from compiled.attention import ops, triton_extend, triton_norm_rope
    from compiled.compilation.inductor import EagerSplitOp
    from compiled.compilation.piecewise_graphs import PieceGraphs
    engine, runner = llm.engine, llm.engine.runner
    targets = {"schedule": (engine.scheduler, "schedule"), "stage": (runner, "_stage"),
               "run_model": (runner, "_run_model"), "logits": (runner, "logits"), "sampler": (engine, "sampler"),
               "append": (engine, "_append"),
               # inside run_model (each inclusive of what it calls)
               "piece_graphs": (PieceGraphs, "__call__"), "graph_launch": (torch.cuda.CUDAGraph, "replay"),
               "attention_module": (EagerSplitOp, "forward"), "attention_impl": (ops, "_attention_triton"),
               "norm_rope_store": (triton_norm_rope, "norm_rope_store_triton"),
               "extend": (triton_extend, "extend_attention_triton")}
    total = 0.0
    with core.timed_calls_on(targets) as seconds:
        for _ in range(reps):
            total += core.first_token(llm, prompt)
    out = {k: 1e3 * v / reps for k, v in seconds.items()}
    out["ttft"] = 1e3 * total / reps
    return out


def profiled_prefill(llm, prompt, out: Path) -> None:
    """cProfile of one prefill's host work; the top functions by own time go to `out`."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.runcall(core.first_token, llm, prompt)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text.getvalue())


def short_profile(prof: dict, n: int = 12) -> list[str]:
    lines = [f"{r['self_ms']:9.3f} ms {r['self_pct']:5.1f}% x{r['calls']:<5} {r['name'][:90]}" for r in prof["top"][:n]]
    if prof.get("exposed"):
        lines.append("on the critical path (own time not overlapped + idle before, ms):")
        lines += [f"{r['exposed_ms']:9.3f} ({r['idle_before_ms']:.3f} idle) x{r['calls']:<5} {r['name'][:80]}"
                  for r in prof["exposed"][:n]]
    if prof.get("gpu_idle"):
        lines.append("GPU idle {idle_ms:.3f} of {span_ms:.3f} ms".format(**prof["gpu_idle"]))
    if prof.get("idle_gaps"):
        lines.append("longest idle stretches (µs after the first kernel: idle µs, between):")
        lines += [f"{g['at_us']:10.1f}: {g['idle_us']:8.1f}  {g['after'][:45]} -> {g['before'][:45]}"
                  f"  | host: {'; '.join(g.get('host', []))}" for g in prof["idle_gaps"]]
    if prof.get("runtime_calls"):
        lines.append("host CUDA calls: " + ", ".join(f"{r['name']} x{r['calls']} {r['ms']:.3f} ms"
                                                      for r in prof["runtime_calls"]))
    return lines


def profiled_startup(args, input_len: int, out: Path):
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    result = prof.runcall(core.startup, args, input_len)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(80)
    stats.sort_stats("tottime").print_stats(40)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text.getvalue())
    return result


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--prefill-reps", type=int, default=7, help="prefills timed (time to first token each)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--export", type=Path, default=None, help="write the compiled artifact here")
    ap.add_argument("--artifact", type=Path, default=None, help="warm start from this artifact only")
    ap.add_argument("--passes", default=None, help="comma-separated graph passes (default: all)")
    ap.add_argument("--quantization", default=None, help="quantize the weights at load (fp8)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel processes (one GPU each)")
    ap.add_argument("--enable-expert-parallel", action="store_true", help="with --tp: experts whole, 1/N a rank")
    ap.add_argument("--profile-dir", type=Path, default=None)
    ap.add_argument("--cprofile", type=Path, default=None,
                    help="profile the start-up's Python (cProfile); the top functions go to this file")
    ap.add_argument("--cprofile-prefill", type=Path, default=None,
                    help="profile one prefill's Python (cProfile); the top functions go to this file")
    return ap.parse_args()


def measure_decode(llm, a: argparse.Namespace, alone: bool) -> dict:
    """Decode step p50 per batch (overlapped and synchronous), its roofline and the graph's GPU
    time alone."""
    bw = core.bandwidth(llm.config.device)
    decode = {}
    for b in [int(x) for x in a.batches.split(",")]:
        res, _ = core.latency(llm, b, a.input_len, a.output_len, iters=1, warmup=1, seed=0)
        res["synchronous_decode_step_ms"] = synchronous_decode(llm, b, a.input_len, a.output_len)
        res["roofline"] = core.roofline(llm, b, a.input_len, a.output_len, res["decode_step_ms"]["p50"], bw)
        res["graph_gpu_ms"] = graph_gpu_ms(llm, llm.engine.runner.variants[BASE].decode.bucket_for(b)) \
            if alone and llm.engine.runner.variants[BASE].decode else None
        decode[b] = res
        print(f"batch {b}: decode p50 {res['decode_step_ms']['p50']:.3f} ms "
              f"(synchronous {res['synchronous_decode_step_ms']['p50']:.3f}), graph GPU {res['graph_gpu_ms']} ms, "
              f"floor {res['roofline']['floor_ms']:.3f} ms", flush=True)
    return decode


def measure_prefill(llm, a: argparse.Namespace, prompt: list[int]) -> dict:
    """Time to first token of `prompt`, prefill_reps times, and the host's share of one prefill."""
    ttft = [core.first_token(llm, prompt) for _ in range(a.prefill_reps)]
    prefill = {"tokens": a.prefill_len, "ttft_ms": [1e3 * t for t in ttft]}
    print(f"prefill {a.prefill_len}: ttft ms {[round(1e3 * t, 2) for t in ttft]}", flush=True)
    prefill["host_split_ms"] = prefill_host_split(llm, prompt)
    print("host ms per prefill:", json.dumps(prefill["host_split_ms"]), flush=True)
    return prefill


def profile_all(llm, a: argparse.Namespace, prompt: list[int], big: int) -> dict:
    """Profiles of three decode steps at batch 1 and at `big`, and of the prompt's prefill."""
    vocab = llm.model_config.vocab_size
    items = [core.Item(core.random_ids(1, a.input_len, vocab, 2)[0], 8)]
    dec = core.profile_steps(llm, items, 3, a.profile_dir, "decode_b1", skip_prefill=True, top=25)
    pre = core.profile_steps(llm, [core.Item(prompt, 1)], 1, a.profile_dir, "prefill", skip_prefill=False, top=25)
    # as long as the timed runs: the batch's prompts fill in chunks while the first ones decode
    items = [core.Item(p, a.output_len) for p in core.random_ids(big, a.input_len, vocab, 3)]
    dec_big = core.profile_steps(llm, items, 3, a.profile_dir, f"decode_b{big}", skip_prefill=True, top=25)
    if dec_big["whole_batch_steps"] < dec_big["steps"]:
        print(f"warning: {dec_big['whole_batch_steps']} of the b{big} profile's steps ran the whole batch "
              f"(--output-len {a.output_len}: raise it)", flush=True)
    print("decode b1 profile (3 steps):", *short_profile(dec, 25), sep="\n  ")
    print(f"decode b{big} profile (3 steps):", *short_profile(dec_big, 25), sep="\n  ")
    print("prefill profile:", *short_profile(pre, 25), sep="\n  ")
    return {"decode_b1": dec, "prefill": pre, f"decode_b{big}": dec_big}


def measure(llm, a: argparse.Namespace, record: dict) -> None:
    """Everything after a cold start, into `record`."""
    # Rank 0 alone cannot replay a graph holding collectives: the graph-only timings need one process.
    alone = a.tp == 1
    record["decode"] = measure_decode(llm, a, alone)
    if alone and llm.engine.runner.variants[BASE].decode is not None:
        record["host_split_ms"] = {b: host_split(llm, b, a.input_len, a.output_len)
                                   for b in (1, max(record["decode"]))}
        print("host ms per decode step:", json.dumps(record["host_split_ms"]), flush=True)
    prompt = core.random_ids(1, a.prefill_len, llm.model_config.vocab_size, 1)[0]
    record["prefill"] = measure_prefill(llm, a, prompt)
    if a.cprofile_prefill is not None:
        profiled_prefill(llm, prompt, a.cprofile_prefill)
    if a.profile_dir is not None:
        record["profile"] = profile_all(llm, a, prompt, max(record["decode"]))
    if a.export is not None:
        t0 = time.perf_counter()
        llm.export_artifact(str(a.export))
        record["export_s"] = time.perf_counter() - t0


def main() -> None:
    a = parse_args()
    args = EngineConfig(model=a.model, load_format="dummy", max_model_len=a.max_model_len,
                        max_num_seqs=a.max_num_seqs, quantization=a.quantization, tensor_parallel_size=a.tp,
                        enable_expert_parallel=a.enable_expert_parallel, artifact=None if a.artifact is None else str(a.artifact),
                        passes=None if a.passes is None else tuple(p for p in a.passes.split(",") if p))
    compiles_before = COMPILES["count"]
    if a.cprofile is None:
        llm, start = core.startup(args, a.input_len)
    else:
        llm, start = profiled_startup(args, a.input_len, a.cprofile)
    start["compiles"] = COMPILES["count"] - compiles_before
    start["excluding_load_s"] = start["llm_init_s"] - start["stages_s"].get("load", 0.0) + start["ttft_cold_s"]
    record: dict = {"model": a.model, "environment": core.environment(llm.config.device), "startup": start}
    print("startup:", json.dumps(start, indent=1), flush=True)
    if a.artifact is None:
        measure(llm, a, record)
    record["compiles_after_warmup"] = COMPILES["count"] - compiles_before - start["compiles"]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(core._clean(record), indent=1))


if __name__ == "__main__":
    main()
