"""`compiled bench serving --url`: the serving workload sent to any OpenAI-compatible server
(ours or another engine) over HTTP, streamed, with the same metrics as the in-process run: each
token's time is when its chunk arrived (every chunk with a choice counts, text or not); TTFT counts from the request's Poisson arrival (or, under
--max-concurrency, from when a slot freed)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import ssl
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

from cli.bench_core import WARM_UP_REQUESTS, WARM_UP_TOKENS, Item, Trace, arrival_times, summary_ms

GRAPHS_PENDING = "compiled_cuda_graphs_pending"   # the server's /metrics gauge
WARM_UP_TIMEOUT_S = 300.0   # the longest a warm-up waits for the server's graph captures
WARM_UP_POLL_S = 0.2        # between its reads of the server's /metrics


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _models(url: str, api_key: str | None = None) -> list[dict]:
    response = httpx.get(url.rstrip("/") + "/v1/models", timeout=30, headers=_headers(api_key))
    if response.status_code != 200:
        raise RuntimeError(f"{url}/v1/models: HTTP {response.status_code}: {response.text[:300]}")
    return response.json()["data"]


def served_model(url: str, api_key: str | None = None) -> str:
    """The first model the server lists (its base model)."""
    return _models(url, api_key)[0]["id"]


def served_adapters(url: str, api_key: str | None = None) -> list[str]:
    """The adapters the server lists (models with a parent), in its order."""
    return [m["id"] for m in _models(url, api_key) if m.get("parent")]


async def _one(client: httpx.AsyncClient, url: str, model: str, item: Item, trace: Trace, start: float) -> int:
    body = {"model": item.lora or model, "prompt": item.prompt, "max_tokens": item.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if item.structured is not None:   # vLLM's field, which this server reads too
        body["structured_outputs"] = item.structured
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):   # a chunk a step: its text may be empty (a special token, a held-back byte)
                trace.token_times.append(now)
    trace.done = time.perf_counter() - start
    return tokens


class SharedSlots:
    """--max-concurrency over several client processes: one semaphore that all of them take a
    slot from (each its own share of it would leave slots idle, or overshoot where the share is
    rounded up). Waits for a slot on a thread of its own, so the process's event loop reads its
    streams on (in the loop's default executor, waits could take every thread from the address
    lookups of requests that hold slots), and its requests take their slots in order."""

    def __init__(self, semaphore) -> None:
        self._semaphore = semaphore
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slots")

    async def __aenter__(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._waiter, self._semaphore.acquire)

    async def __aexit__(self, *exc) -> None:
        self._semaphore.release()


async def _send_all(url: str, model: str, items: Sequence[Item], arrivals: Sequence[float],
                    slots: asyncio.Semaphore | SharedSlots, start: float, traces: list[Trace], outputs: list[int],
                    on_finish: Callable[[int], None] | None, api_key: str | None = None) -> None:
    """Send `items`, each at its arrival (seconds after `start`, a perf_counter time) with a slot
    of `slots` held while it is in flight; their traces and output token counts into `traces` and
    `outputs`."""
    # A client (one connection) per request in flight, reused: one client shared by all of
    # them scans every pooled connection on each chunk it reads, which makes the client, not
    # the server, the bottleneck at 96 streams.
    idle: list[httpx.AsyncClient] = []
    tls = ssl.create_default_context()   # loading the CA bundle takes ~20 ms a client

    async def send(i: int) -> None:
        await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
        async with slots:
            client = idle.pop() if idle else httpx.AsyncClient(timeout=None, verify=tls, headers=_headers(api_key))
            traces[i].sent = max(arrivals[i], time.perf_counter() - start)
            outputs[i] = await _one(client, url, model, items[i], traces[i], start)
            idle.append(client)
        if on_finish:
            on_finish(1)
    try:
        await asyncio.gather(*(send(i) for i in range(len(items))))
    finally:
        for client in idle:
            await client.aclose()


def _client_process(index: int, url: str, model: str, items: list[Item], arrivals: list[float], slots, go,
                    start, results, api_key: str | None) -> None:
    """One of --client-processes: says it is ready, waits for the common start, sends its share,
    each request holding one of the processes' common `slots` (a semaphore) while in flight."""
    traces = [Trace(0.0, len(item.prompt)) for item in items]
    outputs = [0] * len(items)
    results.put("ready")
    go.wait()
    try:
        asyncio.run(_send_all(url, model, items, arrivals, SharedSlots(slots), start.value, traces, outputs, None,
                              api_key))
    except Exception as e:   # the parent raises it
        results.put((index, None, f"{type(e).__name__}: {e}"))
        return
    results.put((index, traces, outputs))


def _send_from_processes(url: str, model: str, items: Sequence[Item], arrivals: list[float],
                         max_concurrency: int | None, processes: int, traces: list[Trace], outputs: list[int],
                         on_finish: Callable[[int], None] | None, api_key: str | None = None) -> None:
    """The requests dealt round-robin to `processes` client processes (sharing one limit on the
    requests in flight), so that reading many streams in Python does not hold back the sends: one
    process's event loop reads 32 streams' chunks and sends the next requests in turn. Their
    clocks are one (perf_counter is the system's monotonic clock); they start together."""
    # A fork server imports this module once and forks each client from it: a spawned client
    # would import the command line's whole main module (torch included) on its own.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    go, start, results = ctx.Event(), ctx.Value("d", 0.0), ctx.Queue()
    shares = [list(range(p, len(items), processes)) for p in range(processes)]
    slots = ctx.BoundedSemaphore(max_concurrency or len(items))
    workers = [ctx.Process(target=_client_process, daemon=True,
                           args=(p, url, model, [items[i] for i in share], [arrivals[i] for i in share], slots, go,
                                 start, results, api_key)) for p, share in enumerate(shares)]
    for w in workers:
        w.start()
    try:
        for _ in workers:
            results.get()   # "ready"
        start.value = time.perf_counter()
        go.set()
        for _ in workers:   # in the order they finish
            p, share_traces, share_outputs = results.get()
            if share_traces is None:
                raise RuntimeError(share_outputs)
            share = shares[p]
            for i, tr, n in zip(share, share_traces, share_outputs):
                traces[i], outputs[i] = tr, n
            if on_finish:
                on_finish(len(share))
    finally:
        for w in workers:
            w.join(5)
            if w.is_alive():
                w.terminate()


def server_metrics(url: str, api_key: str | None = None) -> dict[str, float]:
    """The server's /metrics samples without labels, by name; empty where it has none."""
    response = httpx.get(url + "/metrics", timeout=30, headers=_headers(api_key))
    if response.status_code != 200:
        return {}
    samples = (line.split() for line in response.text.splitlines() if line and not line.startswith("#"))
    return {fields[0]: float(fields[1]) for fields in samples if len(fields) == 2 and "{" not in fields[0]}


def graphs_pending(url: str, api_key: str | None = None) -> int:
    """The CUDA-graph buckets the server has left to capture while it idles
    (`compiled_cuda_graphs_pending`); 0 from a server that does not say."""
    return int(server_metrics(url, api_key).get(GRAPHS_PENDING, 0))


def kernels_between(before: dict[str, float], after: dict[str, float]) -> dict[str, int] | None:
    """The Triton kernels the server compiled and loaded between two reads of its /metrics, where it
    counts them (`compiled_triton_kernels_{compiled,cached}_total`)."""
    names = {kind: f"compiled_triton_kernels_{kind}_total" for kind in ("compiled", "cached")}
    if not all(n in before and n in after for n in names.values()):
        return None
    return {kind: int(after[n] - before[n]) for kind, n in names.items()}


def warm_up_http(url: str, model: str, items: Sequence[Item], api_key: str | None = None,
                 timeout_s: float = WARM_UP_TIMEOUT_S) -> None:
    """As the in-process run warms up (`bench_core.warm_up`): the first few requests of the
    workload, a few tokens each, then a wait while the server captures the CUDA graphs it left
    for later at start (it does one per pass while idle; a request needing one waits for it)."""
    short = [dataclasses.replace(item, output_len=min(item.output_len, WARM_UP_TOKENS))
             for item in items[:WARM_UP_REQUESTS]]
    traces, outputs = [Trace(0.0, len(item.prompt)) for item in short], [0] * len(short)
    asyncio.run(_send_all(url, model, short, [0.0] * len(short), asyncio.Semaphore(len(short)), time.perf_counter(),
                          traces, outputs, None, api_key))
    deadline = time.monotonic() + timeout_s
    while graphs_pending(url, api_key) and time.monotonic() < deadline:
        time.sleep(WARM_UP_POLL_S)


def serving_http(url: str, items: Sequence[Item], rate: float, max_concurrency: int | None, seed: int,
                 on_finish: Callable[[int], None] | None = None, processes: int = 1,
                 api_key: str | None = None, warmup: bool = False) -> dict:
    """`warmup`: `warm_up_http` first (untimed)."""
    url = url.rstrip("/")
    model = served_model(url, api_key)
    if warmup:
        warm_up_http(url, model, items, api_key)
    before = server_metrics(url, api_key)
    arrivals = arrival_times(len(items), rate, seed)
    traces = [Trace(0.0, len(item.prompt)) for item in items]
    outputs = [0] * len(items)
    if processes == 1:
        asyncio.run(_send_all(url, model, items, arrivals, asyncio.Semaphore(max_concurrency or len(items)),
                              time.perf_counter(), traces, outputs, on_finish, api_key))
    else:
        _send_from_processes(url, model, items, arrivals, max_concurrency, processes, traces, outputs, on_finish,
                             api_key)
    duration = max(t.done for t in traces)
    inp, out = sum(len(i.prompt) for i in items), sum(outputs)
    itl = [x for tr in traces for x in tr.itl]
    kernels = kernels_between(before, server_metrics(url, api_key))
    res = {
        "url": url, "model": model, "num_requests": len(items), "request_rate": rate,
        "max_concurrency": max_concurrency, "duration_s": duration, "input_tokens": inp, "output_tokens": out,
        "total_tokens": inp + out, "requests_per_s": len(items) / duration, "output_tokens_per_s": out / duration,
        "total_tokens_per_s": (inp + out) / duration,
        "ttft_ms": summary_ms([tr.ttft for tr in traces if tr.token_times]),
        "tpot_ms": summary_ms([tr.tpot for tr in traces if tr.token_times and tr.tpot is not None]),
        "itl_ms": summary_ms(itl), "e2e_ms": summary_ms([tr.e2e for tr in traces]),
    }
    if kernels is not None:   # the server's, where it counts them
        res["triton_kernels"] = kernels
    return res
