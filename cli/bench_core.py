"""What `compiled bench` measures, without the CLI: workloads, the engine driven step by step
(latency, throughput, serving, start-up), statistics, the profiler, and the run's environment.

Every runner drives `llm.engine` directly (`make_request`, `add`, `step`) so each step can be
timed; tokens a step produced appear in `request.output_token_ids` when it returns."""

from __future__ import annotations


import contextlib
import importlib.metadata
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import torch

from cli.prompts import read_jsonl_prompts
from cli.engine_options import build_llm
from compiled.passes.variant import BASE
from compiled.runtime.config import EngineConfig, resolve_device
from compiled.runtime.sampling_params import SamplingParams

Prompt = str | list[int]
StepHook = Callable[[], None] | None
T = TypeVar("T")


# ---- statistics ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary_ms(seconds: Sequence[float]) -> dict | None:
    """mean / p50 / p90 / p99 / min / max in milliseconds, or None for no samples."""
    if not seconds:
        return None
    ms = [1e3 * s for s in seconds]
    return {"mean": sum(ms) / len(ms), "p50": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99), "min": min(ms), "max": max(ms), "n": len(ms)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    from compiled.runtime.llm import release_frozen_heap
    release_frozen_heap()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- the engine -------------------------------------------------------------------------------


def greedy(output_len: int, structured: dict | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True, structured_outputs=structured)


def check_idle(engine) -> None:
    if engine.has_work:
        raise RuntimeError("the engine still has requests from an earlier run")


class KVPeak:
    """Peak KV slots in use during any step: slots still held after the step plus those of the
    requests that finished in it (their slots were freed before `step()` returned)."""

    def __init__(self, engine) -> None:
        self.engine, self.peak = engine, engine.kv.num_used

    def update(self, finished) -> None:
        used = self.engine.kv.num_used + sum(r.num_computed for r in finished)
        self.peak = max(self.peak, used)

    def as_dict(self) -> dict:
        total = self.engine.kv.num_slots
        return {"peak_kv_slots": self.peak, "kv_slots": total, "peak_kv_fraction": self.peak / total if total else 0.0}


# ---- workloads --------------------------------------------------------------------------------


@dataclass
class Item:
    prompt: Prompt
    output_len: int
    lora: str | None = None      # the adapter the request runs with
    structured: dict | None = None   # its structured_outputs (what its output must match)


LORA_DISTS = ("uniform", "zipf", "one", "none")


def add_random_loras(llm, num: int, rank: int, targets: str, seed: int) -> list[str]:
    """`num` random adapters of `rank` on `targets` in the model's real shapes; their names."""
    from compiled.lora.random import random_adapter
    names = [f"lora{i}" for i in range(num)]
    for i, name in enumerate(names):
        llm.add_lora(random_adapter(name, llm.model_config, rank, targets, seed=seed + i, device=llm.config.device))
    return names


def assign_loras(n: int, names: list[str], dist: str, seed: int) -> list[str | None]:
    """Each of `n` requests' adapter: uniform over `names`, Zipf (the i-th twice as likely as the
    2i-th), or the first for all; every request runs the base model when `names` is empty or
    `dist` is "none" (adapters loaded, none used: the cost of LoRA enabled but idle)."""
    if not names or dist == "none":
        return [None] * n
    if dist == "one":
        return [names[0]] * n
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(len(names))] if dist == "zipf" else None
    return rng.choices(names, weights=weights, k=n)


def random_ids(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def random_workload(n: int, input_len: int, input_len_max: int | None, output_len: int,
                    output_len_max: int | None, vocab: int, seed: int, shared_prefix_len: int = 0) -> list[Item]:
    """`n` requests of random token ids; lengths fixed, or uniform in [len, len_max]; with
    `shared_prefix_len`, every prompt starts with the same that many tokens (a system prompt)
    before its own `input_len`."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (shared_prefix_len,), generator=g).tolist()
    items = []
    for _ in range(n):
        i = rng.randint(input_len, input_len_max) if input_len_max else input_len
        o = rng.randint(output_len, output_len_max) if output_len_max else output_len
        items.append(Item(shared + torch.randint(0, vocab, (i,), generator=g).tolist(), o))
    return items


def read_dataset(path: Path, output_len: int, output_len_max: int | None, seed: int,
                 limit: int | None = None) -> list[Item]:
    """JSONL: each line a string, a list of token ids, or an object with "prompt" (text) or
    "prompt_token_ids" and optionally "output_len" (else --output-len / its range)."""
    rng = random.Random(seed)
    items: list[Item] = []
    for lineno, record, fields in read_jsonl_prompts(path):
        out = fields.get("output_len", fields.get("max_new_tokens"))
        if out is None:
            out = rng.randint(output_len, output_len_max) if output_len_max else output_len
        if not isinstance(out, int) or out < 1:
            raise ValueError(f"{path}:{lineno}: output_len must be a positive integer, got {out!r}")
        items.append(Item(record, out))
        if limit is not None and len(items) == limit:
            break
    if not items:
        raise ValueError(f"{path}: no requests in the dataset")
    return items


def make_requests(engine, items: Sequence[Item]) -> list:
    """Validate and tokenize every item (a bad one fails before anything is queued)."""
    requests = [engine.make_request(i, it.prompt, greedy(it.output_len, it.structured), it.lora)
                for i, it in enumerate(items)]
    for i, (r, it) in enumerate(zip(requests, items)):
        if len(r.prompt_token_ids) + it.output_len > engine.max_context:
            raise ValueError(f"request {i}: input {len(r.prompt_token_ids)} + output {it.output_len} tokens "
                             f"exceed the context of {engine.max_context} (raise --max-model-len)")
    return requests


def token_counts(requests) -> tuple[int, int]:
    return sum(len(r.prompt_token_ids) for r in requests), sum(len(r.output_token_ids) for r in requests)


# ---- latency ----------------------------------------------------------------------------------


@dataclass
class LatencyRun:
    ttft_s: float
    prefill_steps: int
    step_s: list[float]      # decode steps that ran the whole batch
    elapsed_s: float
    retractions: int
    steps_not_full: int = 0  # decode steps (calls) that ran part of the batch: not timed
    decoded_while_filling: int = 0   # most tokens a request got before the last prompt's first
    output_tokens: int = 0


def fill_headroom(engine, batch: int, input_len: int) -> int:
    """Most tokens a request can decode while the rest of the batch is still being prefilled: none
    when one step prefills every prompt, else at most one a step, and a step beside decoding
    requests prefills at least the mixed-step budget less their decodes."""
    cfg = engine.cfg
    if batch * input_len <= cfg.max_num_batched_tokens:
        return 0
    per_step = max(1, min(cfg.max_mixed_step_tokens, cfg.max_num_batched_tokens) - batch)
    return -(-batch * input_len // per_step) + 1


def check_batch_fits(engine, batch: int, input_len: int, output_len: int) -> None:
    """A one-line ValueError unless `batch` requests of `input_len` + `output_len` tokens (and what
    they may decode while the batch is prefilled) fit the KV cache together to their last token:
    otherwise the engine retracts some of them, re-prefills them and decodes the rest at smaller
    batches, and per-step times stop describing the batch."""
    slots, ahead = engine.kv.num_slots, fill_headroom(engine, batch, input_len)
    per_request = input_len + output_len + ahead
    if batch * per_request > slots:
        filling = f" + up to {ahead} decoded while the batch is prefilled" if ahead else ""
        raise ValueError(
            f"the batch does not fit the KV cache: {batch} x ({input_len} + {output_len}{filling}) tokens = "
            f"{batch * per_request:,} > {slots:,} slots; {slots // per_request} requests fit (lower "
            f"--batch-size or the lengths, or raise --kv-cache-tokens / --mem-fraction)")


def latency_once(llm, prompts: list[Prompt], output_len: int, on_step: StepHook = None,
                 loras: list[str | None] | None = None, structured: dict | None = None) -> LatencyRun:
    """One batch: prefill every prompt (TTFT: until each has its first token), then time
    `output_len - 1` decode steps of the whole batch, at the batch size asked for.

    A batch whose prompts take several steps to prefill has its first requests decoding beside
    the later prompts' chunks (mixed steps): those tokens are not timed (`decoded_while_filling`),
    and such requests may run past `output_len` until the timed steps are done; then what is left
    is aborted. No device sync between steps: `step()` returns once it has read a step's tokens
    back, and a sync would also wait for the step that overlap scheduling queued behind it. A call
    that reads back two steps' tokens (under overlap) counts as two steps of half its time;
    prefill steps do not count the decode step launched ahead while the first tokens were read.
    A call in which the requests did not all get the same number of tokens (a retraction) is
    counted in `steps_not_full` instead. `structured`: every request's structured_outputs."""
    engine = llm.engine
    check_idle(engine)
    retractions = engine.scheduler.num_retractions
    loras = loras or [None] * len(prompts)
    longest = max(len(p) for p in prompts)
    params = greedy(min(output_len + fill_headroom(engine, len(prompts), longest), engine.max_context - longest),
                    structured)
    requests = [engine.make_request(i, p, params, a) for i, (p, a) in enumerate(zip(prompts, loras))]
    sync(llm.config.device)
    t0 = time.perf_counter()
    for r in requests:
        engine.add(r)
    calls, ahead = 0, engine.num_overlapped
    while not all(r.output_token_ids for r in requests):
        engine.step()
        calls += 1
        if on_step:
            on_step()
    t1 = time.perf_counter()
    prefill_steps = calls - (engine.num_overlapped - ahead)
    filling = max(len(r.output_token_ids) for r in requests) - 1
    steps, not_full = _timed_decode(engine, requests, output_len - 1, on_step)
    for r in requests:
        engine.abort(r.id)
    while engine.has_work:
        engine.step()
    return LatencyRun(t1 - t0, prefill_steps, steps, time.perf_counter() - t0,
                      engine.scheduler.num_retractions - retractions, not_full, filling,
                      sum(len(r.output_token_ids) for r in requests))


def _timed_decode(engine, requests: list, count: int, on_step: StepHook) -> tuple[list[float], int]:
    """(the times of `count` decode steps in which every request got a token, the calls in which
    they did not all get the same number)."""
    steps, not_full = [], 0
    while len(steps) < count and engine.has_work:
        before = [len(r.output_token_ids) for r in requests]
        s = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - s
        got = {len(r.output_token_ids) - n for r, n in zip(requests, before)}
        k = got.pop() if len(got) == 1 else 0
        if k:
            steps += [dt / k] * k
        else:
            not_full += 1
        if on_step:
            on_step()
    return steps[:count], not_full


def latency(llm, batch: int, input_len: int, output_len: int, iters: int, warmup: int, seed: int,
            on_step: StepHook = None, loras: list[str | None] | None = None,
            structured: dict | None = None) -> tuple[dict, list[list[int]]]:
    """`loras`: the adapter of each of the `batch` requests (None: the base model); `structured`:
    the structured_outputs of every request. A batch that does not fit the KV cache is an error
    before anything runs (`check_batch_fits`)."""
    check_batch_fits(llm.engine, batch, input_len, output_len)
    prompts = random_ids(batch, input_len, llm.model_config.vocab_size, seed)
    for _ in range(warmup):
        latency_once(llm, prompts, output_len, loras=loras, structured=structured)
    runs = [latency_once(llm, prompts, output_len, on_step, loras, structured) for _ in range(iters)]
    steps = [s for r in runs for s in r.step_s]
    elapsed = sum(r.elapsed_s for r in runs)
    out_tokens = sum(r.output_tokens for r in runs)
    decode = summary_ms(steps)
    ttft = [r.ttft_s for r in runs]
    results = {
        "batch_size": batch, "input_len": input_len, "output_len": output_len, "num_iters": iters,
        "ttft_ms": summary_ms(ttft),
        "prefill_steps": runs[0].prefill_steps,
        "prefill_tokens_per_s": batch * input_len / (sum(ttft) / len(ttft)),
        # How the decode steps were timed: after every prompt of the batch had its first token.
        "decode_timing": "whole batch prefilled first",
        "decoded_while_filling": max(r.decoded_while_filling for r in runs),
        "decode_steps": len(steps),
        "decode_steps_not_full": sum(r.steps_not_full for r in runs),
        "decode_step_ms": decode,
        "decode_tokens_per_s": batch / (decode["p50"] / 1e3) if decode else None,
        "elapsed_s": elapsed,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / elapsed,
        "retractions": sum(r.retractions for r in runs),
    }
    return results, prompts


def with_and_without_cp(llm, fn: Callable[[], T]) -> tuple[T, T]:
    """`fn()` through the context-parallel group, then on rank 0 alone (the same engine, so the
    same weights and compiled code, with the group set aside)."""
    runner = llm.engine.runner
    with_cp = fn()
    cp, runner.cp = runner.cp, None
    try:
        alone = fn()
    finally:
        runner.cp = cp
    return with_cp, alone


def ttft_beside_cp1(llm, prompts: list[Prompt], iters: int) -> dict:
    """Time to first token of the batch `prompts` with the context-parallel group and without,
    one warm-up run each."""

    def measure() -> dict | None:
        latency_once(llm, prompts, 1)
        return summary_ms([latency_once(llm, prompts, 1).ttft_s for _ in range(iters)])

    with_cp, alone = with_and_without_cp(llm, measure)
    return {"context_parallel_size": llm.context_parallel, "ttft_ms": with_cp, "ttft_cp1_ms": alone}


def bandwidth(device: torch.device, gbps: float | None = None):
    """The device's copy bandwidth: `gbps` when given, else measured once and cached."""
    from cli.roofline import Bandwidth, device_bandwidth, device_name
    if gbps is not None:
        return Bandwidth(gbps * 1e9, device_name(device), "given")
    return device_bandwidth(device)


def roofline(llm, batch: int, input_len: int, output_len: int, decode_p50_ms: float | None, bw) -> dict:
    """The decode floor at the batch's middle context (input + output/2 tokens in the KV cache)
    against the median step."""
    from cli.roofline import decode_bytes
    context = input_len + output_len // 2
    from compiled.quant.at_load import METHODS
    quant = llm.model_config.quantization or METHODS.get(llm.config.quantization)
    b = decode_bytes(llm.model_config, batch, context, llm.config.dtype.itemsize, quant)
    floor_ms = 1e3 * b.floor_s(bw.bytes_per_s)
    return {
        "context": context, "bytes_per_step": b.total, "bytes": b.as_dict(),
        "experts_per_layer": b.experts_per_layer,
        "bandwidth_bytes_per_s": bw.bytes_per_s, "bandwidth_source": bw.source,
        "floor_ms": floor_ms,
        "fraction_of_roofline": floor_ms / decode_p50_ms if decode_p50_ms else None,
        "achieved_bytes_per_s": b.total / (decode_p50_ms / 1e3) if decode_p50_ms else None,
    }


# ---- throughput -------------------------------------------------------------------------------


def throughput(llm, items: Sequence[Item], on_finish: Callable[[int], None] | None = None) -> dict:
    """Every request queued at once, stepped until all finish (offline batch throughput)."""
    engine, device = llm.engine, llm.config.device
    check_idle(engine)
    retractions = engine.scheduler.num_retractions
    sync(device)
    t0 = time.perf_counter()
    requests = make_requests(engine, items)
    for r in requests:
        engine.add(r)
    kv = KVPeak(engine)
    steps, max_running, done = 0, 0, 0
    while done < len(requests):
        max_running = max(max_running, len(engine.scheduler.running) + len(engine.scheduler.waiting))
        finished = engine.step()
        steps += 1
        kv.update(finished)
        done += len(finished)
        if on_finish and finished:
            on_finish(len(finished))
    sync(device)
    elapsed = time.perf_counter() - t0
    inp, out = token_counts(requests)
    return {
        "num_requests": len(requests), "elapsed_s": elapsed, "steps": steps,
        "input_tokens": inp, "output_tokens": out, "total_tokens": inp + out,
        "requests_per_s": len(requests) / elapsed, "output_tokens_per_s": out / elapsed,
        "total_tokens_per_s": (inp + out) / elapsed,
        **kv.as_dict(), "retractions": engine.scheduler.num_retractions - retractions,
    }


WARM_UP_REQUESTS, WARM_UP_TOKENS = 4, 4   # the warm-up's requests, and the tokens each generates at most


def warm_up(llm, items: Sequence[Item], n: int = WARM_UP_REQUESTS, output_len: int = WARM_UP_TOKENS) -> None:
    """A few short requests first, so lazy initialisation is not timed."""
    engine = llm.engine
    requests = [engine.make_request(i, it.prompt, greedy(min(it.output_len, output_len)))
                for i, it in enumerate(items[:n])]
    for r in requests:
        engine.add(r)
    while engine.has_work:
        engine.step()
    engine.capture_pending_graphs()
    sync(llm.config.device)


# ---- serving ----------------------------------------------------------------------------------


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: exponential gaps of mean 1/rate; rate inf = everything at t=0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


@dataclass
class Trace:
    sent: float
    input_len: int
    token_times: list[float] = field(default_factory=list)
    done: float | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


def serving(llm, items: Sequence[Item], rate: float, max_concurrency: int | None, seed: int,
            on_finish: Callable[[int], None] | None = None) -> dict:
    """Requests arrive on a Poisson clock and are fed to the engine between steps; every token's
    time is the end of the step that produced it. TTFT counts from arrival (or, under
    --max-concurrency, from when a slot freed), so time spent waiting for a step counts."""
    engine, device = llm.engine, llm.config.device
    check_idle(engine)
    requests = make_requests(engine, items)
    arrivals = arrival_times(len(requests), rate, seed)
    traces: list[Trace | None] = [None] * len(requests)
    active: dict[int, int] = {}   # request id -> index
    kv = KVPeak(engine)
    sync(device)
    start = time.perf_counter()
    nxt, slot_free_at, steps, step_s = 0, 0.0, 0, 0.0
    while nxt < len(requests) or active:
        now = time.perf_counter() - start
        while nxt < len(requests) and arrivals[nxt] <= now and (max_concurrency is None or len(active) < max_concurrency):
            sent = max(arrivals[nxt], slot_free_at) if max_concurrency is not None else arrivals[nxt]
            traces[nxt] = Trace(sent, len(requests[nxt].prompt_token_ids))
            engine.add(requests[nxt])
            active[requests[nxt].id] = nxt
            nxt += 1
        if not active:
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - start)))
            continue
        full = max_concurrency is not None and len(active) >= max_concurrency
        before = time.perf_counter()
        finished = engine.step()
        t = time.perf_counter() - start
        steps += 1
        step_s += time.perf_counter() - before
        kv.update(finished)
        for rid, i in list(active.items()):
            r, tr = requests[i], traces[i]
            tr.token_times += [t] * (len(r.output_token_ids) - len(tr.token_times))
            if r.finished:
                tr.done = t
                del active[rid]
                if full:
                    slot_free_at = t
        if on_finish and finished:
            on_finish(len(finished))
    duration = max(tr.done for tr in traces)
    inp, out = token_counts(requests)
    itl = [x for tr in traces for x in tr.itl]
    per_request = []
    for tr, r in zip(traces, requests):
        s = summary_ms(tr.itl)
        per_request.append({
            "input_len": tr.input_len, "output_len": len(r.output_token_ids), "sent_s": tr.sent,
            "ttft_ms": 1e3 * tr.ttft, "e2e_ms": 1e3 * tr.e2e,
            "tpot_ms": None if tr.tpot is None else 1e3 * tr.tpot,
            "itl_ms": None if s is None else {k: s[k] for k in ("p50", "p90", "p99")},
        })
    return {
        "num_requests": len(requests), "request_rate": rate, "max_concurrency": max_concurrency,
        "duration_s": duration, "elapsed_s": duration, "steps": steps,
        "step_ms_mean": 1e3 * step_s / max(steps, 1),   # the server's /metrics has the same under HTTP
        "input_tokens": inp, "output_tokens": out, "total_tokens": inp + out,
        "requests_per_s": len(requests) / duration, "output_tokens_per_s": out / duration,
        "total_tokens_per_s": (inp + out) / duration,
        "ttft_ms": summary_ms([tr.ttft for tr in traces]),
        "tpot_ms": summary_ms([tr.tpot for tr in traces if tr.tpot is not None]),
        "itl_ms": summary_ms(itl),
        "e2e_ms": summary_ms([tr.e2e for tr in traces]),
        **kv.as_dict(),
        "requests": per_request,
    }


# ---- start-up ---------------------------------------------------------------------------------


@contextlib.contextmanager
def timed_calls(module, names: dict[str, str]) -> Iterator[dict[str, float]]:
    """While active, calls to `module.<attr>` are timed into the yielded dict under `stage`
    (names: attr -> stage). Attributes the module no longer has are skipped."""
    with timed_calls_on({stage: (module, attr) for attr, stage in names.items()}) as seconds:
        yield seconds


@contextlib.contextmanager
def timed_calls_on(targets: dict[str, tuple[object, str]]) -> Iterator[dict[str, float]]:
    """While active, calls to `owner.<attr>` are timed into the yielded dict under their stage
    (targets: stage -> (owner, attr)). Attributes an owner does not have are skipped."""
    seconds: dict[str, float] = {}
    originals = []
    for stage, (owner, attr) in targets.items():
        fn = getattr(owner, attr, None)
        if fn is None:
            continue
        originals.append((owner, attr, owner.__dict__.get(attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING))

        def wrapper(*args, _fn=fn, _stage=stage, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                seconds[_stage] = seconds.get(_stage, 0.0) + time.perf_counter() - t0
        setattr(owner, attr, wrapper)
    try:
        yield seconds
    finally:
        for owner, attr, previous in reversed(originals):
            if previous is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, previous)


_MISSING = object()


def startup(args: EngineConfig, input_len: int) -> tuple[object, dict]:
    """`LLM(...)` broken into stages: the tokenizer load, every stage the LLM reports
    (`llm.startup_seconds` / `llm.build_report.seconds`: trace, passes, load, and whatever later
    stages such as compile, kv_cache or capture it records), the engine + KV allocation when the
    report has no such stage, and "other" for the rest; then one request's time to first token,
    cold (the engine's first step) and warm. On a GPU also the Triton kernels the start compiled
    and those it found cached, and how many decode buckets it captured (of how many)."""
    import compiled.runtime.llm as llm_module
    from compiled.compilation.triton_cache import counting_compiles
    on_gpu = resolve_device(args.device).type == "cuda"
    t0 = time.perf_counter()
    with timed_calls(llm_module, {"load_tokenizer": "tokenizer", "Engine": "engine"}) as outer, \
            counting_compiles(on_gpu) as triton_kernels:
        llm = build_llm(args)
    sync(llm.config.device)
    total = time.perf_counter() - t0
    reported = getattr(llm, "startup_seconds", None)
    if not isinstance(reported, dict):
        report = getattr(llm, "build_report", None)
        reported = dict(getattr(report, "seconds", {}) or {})
    stages: dict[str, float] = {}
    if "tokenizer" in outer and "tokenizer" not in reported:
        stages["tokenizer"] = outer["tokenizer"]
    stages.update(reported)
    if "engine" in outer and not {"engine", "kv_cache"} & set(reported):
        stages["engine"] = outer["engine"]
    stages["other"] = max(total - sum(stages.values()), 0.0)
    graphs = llm.engine.runner.variants[BASE].decode
    buckets = None if graphs is None else {"captured": len(graphs.graphs), "total": len(graphs.buckets)}
    prompt = random_ids(1, input_len, llm.model_config.vocab_size, args.seed)[0]
    cold = first_token(llm, prompt)
    warm = first_token(llm, prompt)
    return llm, {
        "stages_s": stages, "llm_init_s": total, "ttft_cold_s": cold, "ttft_warm_s": warm,
        "total_s": total + cold, "input_len": input_len, "kv_slots": llm.engine.kv.num_slots,
        "triton_kernels": triton_kernels, "decode_buckets": buckets,
    }


def first_token(llm, prompt: Prompt, lora: str | None = None) -> float:
    engine = llm.engine
    check_idle(engine)
    request = engine.make_request(0, prompt, greedy(1), lora)
    sync(llm.config.device)
    t0 = time.perf_counter()
    engine.add(request)
    while not request.output_token_ids:
        engine.step()
    sync(llm.config.device)
    elapsed = time.perf_counter() - t0
    while engine.has_work:
        engine.step()
    return elapsed


# ---- profiling --------------------------------------------------------------------------------


def profile_steps(llm, items: Sequence[Item], steps: int, out_dir: Path, name: str,
                  skip_prefill: bool, top: int = 15) -> dict:
    """torch.profiler over `steps` engine steps of a fresh run of `items` (after the prefill when
    `skip_prefill`), exported as a Chrome trace; the `top` ops/kernels by self time, and with
    `skip_prefill` how many of the steps decoded the whole batch (`fill_batch`)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    engine, device = llm.engine, llm.config.device
    check_idle(engine)
    requests = make_requests(engine, items)
    for r in requests:
        engine.add(r)
    whole = fill_batch(engine, requests, items) if skip_prefill else None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    done = 0
    with profile(activities=activities) as prof:
        while done < steps and engine.has_work:
            with record_function("engine.step"):
                engine.step()
            done += 1
        sync(device)
    while engine.has_work:
        engine.step()
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / f"{name}_trace.json"
    prof.export_chrome_trace(str(trace))
    on_device = device.type == "cuda"
    key = "self_device_time_total" if on_device else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if e.key != "engine.step" and not e.key.startswith("ProfilerStep")]
    total = sum(getattr(e, key, 0.0) for e in events) or 1.0
    events.sort(key=lambda e: getattr(e, key, 0.0), reverse=True)
    rows = [{"name": e.key, "calls": e.count, "self_ms": getattr(e, key, 0.0) / 1e3,
             "self_pct": 100 * getattr(e, key, 0.0) / total,
             "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in events[:top] if getattr(e, key, 0.0) > 0]
    result = {"trace": str(trace), "steps": done, "sort_by": "self device time" if on_device else "self CPU time",
              "total_self_ms": total / 1e3, "top": rows}
    if whole is not None:
        result["whole_batch_steps"] = max(0, min(whole, done))
    if on_device:
        events = trace_events(trace)   # read once: a trace runs to tens of megabytes
        result["exposed"] = exposed_kernel_time(events, top)
        result["idle_gaps"] = idle_gaps(events)
        result["gpu_idle"] = gpu_idle(events)
        result["runtime_calls"] = runtime_calls(events)
        result["kernels_per_step"] = sum(1 for e in events if e.get("cat") == "kernel") / max(done, 1)
    return result


def fill_batch(engine, requests, items: Sequence[Item]) -> int:
    """Step `engine` until every request has its first token; returns how many steps after it still
    decode the whole batch. A batch's prompts fill in chunks while the first ones decode, so short
    outputs leave few such steps, or none: a measurement after them would see a batch draining."""
    while engine.has_work and not all(r.output_token_ids for r in requests):
        engine.step()
    # less one: with overlap scheduling a step's tokens are read a step late
    return min(it.output_len - len(r.output_token_ids) for r, it in zip(requests, items)) - 1


def trace_events(trace: Path) -> list[dict]:
    """The events of a Chrome trace file."""
    return json.loads(Path(trace).read_text()).get("traceEvents", [])


def runtime_calls(events: list[dict], top: int = 8) -> list[dict]:
    """The host's CUDA runtime and driver calls in a Chrome trace's events by total time (a
    cudaMalloc or a synchronize inside a step shows here)."""
    per_name: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("ph") == "X":
            row = per_name.setdefault(e["name"], [0, 0.0])
            row[0] += 1
            row[1] += e["dur"]
    rows = sorted(per_name.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
    return [{"name": name, "calls": n, "ms": us / 1e3} for name, (n, us) in rows]


def _device_events(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of the GPU's kernels, copies and memsets among a trace's events, by start."""
    return sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X")


def _gaps(kernels: list[tuple[float, float, str]]) -> list[dict]:
    """Every stretch between `_device_events` with nothing running on the GPU, in order."""
    gaps, prev_end, prev_name = [], kernels[0][0] if kernels else 0.0, ""
    for start, end, name in kernels:
        if start > prev_end:
            gaps.append({"at_us": prev_end - kernels[0][0], "idle_us": start - prev_end,
                         "after": prev_name[:60], "before": name[:60], "window": (prev_end, start)})
        if end > prev_end:
            prev_end, prev_name = end, name
    return gaps


def gpu_idle(events: list[dict]) -> dict:
    """The span from the GPU's first kernel start to its last end, and how much of it nothing ran
    (ms): in a prefill, what the host's launches leave on the table."""
    kernels = _device_events(events)
    span = max(end for _, end, _ in kernels) - kernels[0][0] if kernels else 0.0
    return {"span_ms": span / 1e3, "idle_ms": sum(g["idle_us"] for g in _gaps(kernels)) / 1e3}


def idle_gaps(events: list[dict], top: int = 12, host_ops: int = 4) -> list[dict]:
    """The longest stretches with nothing running on the GPU: where they start (µs after the first
    kernel), how long, the kernels on either side, and the host's longest operations that
    overlapped the stretch (what the host was doing while the GPU waited for it)."""
    kernels = _device_events(events)
    host = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
            if e.get("cat") in ("cpu_op", "cuda_runtime", "python_function", "user_annotation") and e.get("ph") == "X"]
    gaps = sorted(_gaps(kernels), key=lambda g: g["idle_us"], reverse=True)[:top]
    for g in gaps:
        lo, hi = g.pop("window")
        inside = sorted(((min(e, hi) - max(s, lo), n) for s, e, n in host if s < hi and e > lo), reverse=True)
        g["host"] = [f"{n[:50]} {us:.0f}" for us, n in inside[:host_ops] if us > 0]
    return gaps


def exposed_kernel_time(events: list[dict], top: int = 15) -> list[dict]:
    """Each GPU kernel's share of the stream's critical path, from a Chrome trace's events: the
    time from the end of what ran before it to its own end (its run not hidden behind the previous
    kernel, plus the idle gap before it). With programmatic dependent launch a kernel starts early and
    waits, so its own duration counts the previous kernel too; this does not. The rows add up to
    the span from the first kernel's start to the last one's end."""
    kernels = _device_events(events)
    per_name: dict[str, list[float]] = {}
    prev_end = kernels[0][0] if kernels else 0.0
    for start, end, name in kernels:
        row = per_name.setdefault(name, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += max(0.0, end - max(start, prev_end))   # its own, not overlapped
        row[2] += max(0.0, start - prev_end)             # idle before it
        prev_end = max(prev_end, end)
    rows = sorted(per_name.items(), key=lambda kv: kv[1][1] + kv[1][2], reverse=True)
    return [{"name": name, "calls": n, "exposed_ms": (run + idle) / 1e3, "idle_before_ms": idle / 1e3}
            for name, (n, run, idle) in rows[:top]]


# ---- the run's environment -------------------------------------------------------------------


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> dict:
    root = Path(__file__).resolve().parent.parent
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit, "git_dirty": bool(status) if status is not None else None}


def environment(device: torch.device) -> dict:
    from cli.roofline import device_name
    return {
        "device": str(device), "device_name": device_name(device),
        "torch": torch.__version__, "triton": _version("triton"), "transformers": _version("transformers"),
        "compiled": _version("compiled"), "python": platform.python_version(), "platform": platform.platform(),
        "cuda": torch.version.cuda, **git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[1:],
    }


def _clean(x):
    """JSON-safe: non-finite floats become strings, paths and dtypes become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def write_json(path: Path, record: dict) -> None:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_clean(record), indent=1) + "\n")
    tmp.replace(path)
