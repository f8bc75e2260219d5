"""A real `compiled serve` on the demo MoE model (CPU), driven by real clients: the `openai`
package and plain HTTP. Its outputs equal the offline `LLM.generate` ones."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from compiled import LLM, SamplingParams
from compiled.demo import EXAMPLE_PROMPTS, MOE_ADAPTERS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = list(EXAMPLE_PROMPTS[:4])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILED_")}
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--port", str(port), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300   # a cold start on a GPU compiles first
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--lora", "upper", "--enable-lora")
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def offline():
    return LLM(None, lora_modules={"upper": MOE_ADAPTERS["upper"]})


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none")


def test_models_lists_the_base_model_and_adapters(server):
    ids = [m.id for m in client(server).models.list().data]
    assert ids == ["qwen3-moe", "upper"]


def test_completions_equal_offline(server, offline):
    c = client(server)
    for prompt in PROMPTS:
        out = c.completions.create(model="qwen3-moe", prompt=prompt, max_tokens=8, temperature=0)
        ref = offline.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
        assert out.choices[0].text == ref.text and out.choices[0].finish_reason == ref.finish_reason
        assert out.usage.completion_tokens == len(ref.token_ids)
        assert out.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_logit_bias_equals_offline(server, offline):
    ref = offline.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))[0]
    banned, favoured = ref.token_ids[0], next(t for t in ref.token_ids if t != ref.token_ids[0])
    bias = {banned: -100.0, favoured: 5.0}
    biased = offline.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True,
                                                           logit_bias=bias))[0]
    assert biased.token_ids != ref.token_ids and ref.token_ids[0] not in biased.token_ids
    out = client(server).completions.create(model="qwen3-moe", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                            logit_bias={str(t): b for t, b in bias.items()},
                                            extra_body={"ignore_eos": True})
    assert out.choices[0].text == biased.text


def test_echo_puts_the_prompt_and_its_logprobs_in_front(server, offline):
    prompt = PROMPTS[0]   # its continuation has no special token (those are not in the text)
    ref = offline.generate([prompt], SamplingParams(max_new_tokens=5, temperature=0.0, logprobs=2,
                                                     prompt_logprobs=2))[0]
    c = client(server)
    out = c.completions.create(model="qwen3-moe", prompt=prompt, max_tokens=5, temperature=0, echo=True)
    assert out.choices[0].text == prompt + ref.text and out.usage.completion_tokens == len(ref.token_ids)
    out = c.completions.create(model="qwen3-moe", prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    ids = ref.prompt_token_ids + ref.token_ids
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == out.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [e[t] for e, t in zip(ref.prompt_logprobs[1:] + ref.logprobs, ids[1:])]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    stream = c.completions.create(model="qwen3-moe", prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                  stream=True)
    chunks = [ch.choices[0].text for ch in stream if ch.choices]
    assert chunks[0].startswith(prompt) and "".join(chunks) == prompt + ref.text
    stream = c.completions.create(model="qwen3-moe", prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                  logprobs=2, stream=True)
    streamed = [t for ch in stream if ch.choices for t in ch.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    # max_tokens 0: the prompt alone, a likelihood query
    out = c.completions.create(model="qwen3-moe", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    alone = out.choices[0].logprobs
    assert out.choices[0].text == prompt and out.usage.completion_tokens == 0
    assert alone.tokens == lp.tokens[:len(ref.prompt_token_ids)]
    assert alone.token_logprobs[1:] == pytest.approx(want[:len(ref.prompt_token_ids) - 1], abs=1e-4)


def test_prompts_as_lists_of_token_ids(server, offline):
    refs = offline.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4, temperature=0.0))
    out = client(server).completions.create(model="qwen3-moe", prompt=[r.prompt_token_ids for r in refs],
                                            max_tokens=4, temperature=0)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [r.text for r in refs]


def test_tokenize_detokenize_and_version(server, offline):
    ids = httpx.post(server + "/tokenize", json={"prompt": PROMPTS[2]}).json()
    assert ids["tokens"] == offline.tokenizer.encode(PROMPTS[2]) and ids["count"] == len(ids["tokens"])
    chat = httpx.post(server + "/tokenize", json={"messages": [{"role": "user", "content": PROMPTS[2]}]}).json()
    assert chat["count"] > ids["count"] and chat["max_model_len"] == offline.engine.max_context
    text = httpx.post(server + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text == PROMPTS[2]
    bad = httpx.post(server + "/detokenize", json={"tokens": [1, -3]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(server + "/version").json()["version"]


def test_adapter_by_model_name_and_stop_strings(server, offline):
    c = client(server)
    out = c.completions.create(model="upper", prompt="copy Bird wax:", max_tokens=8, temperature=0)
    ref = offline.generate(["copy Bird wax:"], SamplingParams(max_new_tokens=8, temperature=0.0), lora="upper")[0]
    assert out.choices[0].text == ref.text
    stop = ref.text[3:5]
    out = c.completions.create(model="upper", prompt="copy Bird wax:", max_tokens=8, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == ref.text[:ref.text.index(stop)]


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_found_off_the_engine_equal_offline(server, offline, include):
    """The server finds stop strings itself and aborts the engine's request: text, reasons, token
    count and logprobs equal the offline engine's own check, streamed and not."""
    c = client(server)
    for prompt in ("count 7:", "count 95:", "copy Mad brave fish:"):
        full = offline.generate([prompt], SamplingParams(max_new_tokens=16, temperature=0.0))[0]
        mid = len(full.text) // 2
        assert mid >= 2, full.text
        stops = [full.text[mid:mid + 2], "\u2603never"]
        params = SamplingParams(max_new_tokens=16, temperature=0.0, stop=stops, logprobs=1,
                                include_stop_str_in_output=include)
        ref = offline.generate([prompt], params)[0]
        assert ref.stop_reason == stops[0]
        extra = {"include_stop_str_in_output": include}
        out = c.completions.create(model="qwen3-moe", prompt=prompt, max_tokens=16, temperature=0, stop=stops,
                                   logprobs=1, extra_body=extra)
        choice = out.choices[0]
        assert (choice.text, choice.finish_reason) == (ref.text, ref.finish_reason)
        assert out.usage.completion_tokens == len(ref.token_ids) == len(choice.logprobs.tokens)
        assert getattr(choice, "stop_reason", None) == ref.stop_reason
        chunks = list(c.completions.create(model="qwen3-moe", prompt=prompt, max_tokens=16, temperature=0,
                                           stop=stops, stream=True, stream_options={"include_usage": True},
                                           extra_body=extra))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == ref.finish_reason
        assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_n_seeded_choices_and_logprobs(server, offline):
    c = client(server)
    out = c.completions.create(model="qwen3-moe", prompt=PROMPTS[0], max_tokens=6, temperature=1.0, n=2, seed=7,
                               logprobs=2)
    for i, choice in enumerate(out.choices):
        ref = offline.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6, temperature=1.0, seed=7 + i))[0]
        assert choice.text == ref.text
        assert "".join(choice.logprobs.tokens) == choice.text     # the token strings join to the text
        assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs)
    assert out.usage.prompt_tokens == len(offline.engine.tokenizer.encode(PROMPTS[0]))


def test_chat_streaming_and_not(server, offline):
    c = client(server)
    messages = [{"role": "user", "content": "copy hi:"}]
    full = c.chat.completions.create(model="upper", messages=messages, max_tokens=6, temperature=0)
    ref = offline.chat(["copy hi:"], SamplingParams(max_new_tokens=6, temperature=0.0), lora="upper")[0]
    assert full.choices[0].message.content == ref.text and full.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(model="upper", messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_32_concurrent_streams_equal_offline(server, offline):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    refs = offline.generate(prompts, params)

    async def one(c, prompt):
        stream = await c.completions.create(model="qwen3-moe", prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run_all():
        c = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none")
        return await asyncio.gather(*(one(c, p) for p in prompts))

    texts = asyncio.run(run_all())
    assert texts == [r.text for r in refs]


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}


def test_a_disconnected_stream_frees_its_kv_and_bad_requests_are_400s(server):
    body = {"model": "qwen3-moe", "prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server + "/v1/completions", json=body) as r:
            lines = r.iter_lines()   # kept: a dropped line iterator closes the response
            next(lines)
            assert _metrics(server)["compiled_requests_running"] == 1
        # the client went away after one token: the request is aborted and its KV freed
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _metrics(server)["compiled_requests_running"]:
        time.sleep(0.1)
    m = _metrics(server)
    assert m["compiled_requests_running"] == 0 and m["compiled_kv_cache_usage"] == 0
    assert m["compiled_engine_step_seconds_count"] > 0 and m["compiled_engine_step_seconds_sum"] > 0
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            # malformed requests while the stream runs: 400 naming the field, the stream goes on
            for bad, param in (({"prompt": "x", "temperature": "hot"}, "temperature"),
                               ({"prompt": "x", "max_tokens": 10 ** 6}, "max_tokens"),
                               ({"prompt": 5}, "prompt"), ({"prompt": "x", "n": 0}, "n"),
                               ({"prompt": "x", "logit_bias": {"10000000": 1}}, "logit_bias"),
                               ({"prompt": "x", "echo": "yes"}, "echo")):
                resp = httpx.post(server + "/v1/completions", json=bad)
                assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
            resp = httpx.post(server + "/v1/completions", content=b"{not json")
            assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]
            resp = httpx.post(server + "/v1/completions", json={"model": "nope", "prompt": "x"})
            assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"
            rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]   # it went on to its end


def test_load_and_unload_an_adapter_over_http(server, offline):
    r = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "first", "lora_path": MOE_ADAPTERS["first"]})
    assert r.status_code == 200, r.text
    r = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "first", "lora_path": MOE_ADAPTERS["first"]})
    assert r.status_code == 409
    assert "first" in [m.id for m in client(server).models.list().data]
    out = client(server).completions.create(model="first", prompt="copy Bird wax:", max_tokens=6, temperature=0)
    offline.load_lora("first", MOE_ADAPTERS["first"])
    ref = offline.generate(["copy Bird wax:"], SamplingParams(max_new_tokens=6, temperature=0.0), lora="first")[0]
    assert out.choices[0].text == ref.text
    assert httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "first"}).status_code == 200
    r = httpx.post(server + "/v1/completions", json={"model": "first", "prompt": "x"})
    assert r.status_code == 404
    assert httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "first"}).status_code == 404


def test_sigterm_drains_in_flight_requests_then_exits_0():
    proc, url = start_server("--api-key", "k3y")   # (and /v1 asks for the key, which bench serving sends)
    body = {"prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    assert httpx.post(url + "/v1/completions", json=body).status_code == 401
    from cli.bench_core import random_workload
    from cli.bench_http import serving_http
    res = serving_http(url, random_workload(3, 8, None, 4, None, 200, seed=3), float("inf"), 2, seed=1,
                       processes=2, api_key="k3y")
    assert res["output_tokens"] == 3 * 4
    result = {}

    def request():
        result["response"] = httpx.post(url + "/v1/completions", json=body, timeout=60,
                                        headers={"Authorization": "Bearer k3y"})

    import threading
    t = threading.Thread(target=request)
    t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not _metrics(url).get("compiled_requests_running"):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert proc.wait(timeout=60) == 0
    r = result["response"]
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 60


def test_bench_serving_drives_the_server_over_http(server):
    from cli.bench_core import random_workload
    from cli.bench_http import serving_http
    items = random_workload(6, 12, None, 5, None, 200, seed=1)
    for processes in (1, 2):   # 2: the requests dealt to two client processes, their traces merged
        res = serving_http(server, items, float("inf"), 3, seed=1, processes=processes, warmup=processes == 2)
        assert res["model"] == "qwen3-moe" and res["output_tokens"] == 6 * 5   # the warm-up's are not counted
        assert res["triton_kernels"] == {"compiled": 0, "cached": 0}       # the server's, while it served
        assert res["ttft_ms"]["n"] == 6 and res["ttft_ms"]["p50"] > 0 and res["tpot_ms"]["n"] == 6
        assert all(0 < e <= res["duration_s"] * 1e3 for e in (res["e2e_ms"]["min"], res["e2e_ms"]["max"]))


def test_bench_warm_up_waits_for_the_servers_graph_captures(server, monkeypatch):
    """`--warmup` over HTTP, as in-process: the workload's first few requests, a few tokens each,
    then polling the server's graphs left to capture (none on a CPU server) until there are none."""
    import cli.bench_http as bh
    from cli.bench_core import WARM_UP_REQUESTS, WARM_UP_TOKENS, random_workload
    assert bh.graphs_pending(server) == 0 and _metrics(server)[bh.GRAPHS_PENDING] == 0
    assert bh.kernels_between({}, bh.server_metrics(server)) is None   # a server that does not count them
    items = random_workload(6, 12, None, 9, None, 200, seed=4)
    sent, left = [], [2, 1, 0]
    send_all = bh._send_all

    async def recorded(url, model, short, *args):
        sent.extend((len(i.prompt), i.output_len) for i in short)
        return await send_all(url, model, short, *args)
    monkeypatch.setattr(bh, "_send_all", recorded)
    monkeypatch.setattr(bh, "graphs_pending", lambda url, api_key=None: left.pop(0))
    monkeypatch.setattr(bh, "WARM_UP_POLL_S", 0.0)
    bh.warm_up_http(server, "qwen3-moe", items)
    assert sent == [(12, WARM_UP_TOKENS)] * WARM_UP_REQUESTS and left == []


def test_client_processes_share_one_concurrency_limit(server):
    from cli.bench_core import Trace, random_workload
    from cli.bench_http import _send_from_processes
    items = random_workload(9, 12, None, 6, None, 200, seed=2)
    traces, outputs = [Trace(0.0, 12) for _ in items], [0] * len(items)
    # 4 in flight over 3 processes: a share each, rounded up, would let 6 run at once
    _send_from_processes(server, "qwen3-moe", items, [0.0] * len(items), 4, 3, traces, outputs, None)
    assert outputs == [6] * len(items)
    events = sorted([(t.sent, 1) for t in traces] + [(t.done, -1) for t in traces])
    in_flight = [sum(d for _, d in events[:i + 1]) for i in range(len(events))]
    assert max(in_flight) <= 4


def test_metrics_report_the_prefix_cache(server):
    prompt = PROMPTS[2] + " and then some more words to share"
    usage = [client(server).completions.create(model="qwen3-moe", prompt=prompt, max_tokens=3, temperature=0).usage
             for _ in range(2)]
    # the second found all but its last prompt token cached (usage.prompt_tokens_details, as OpenAI's)
    assert usage[1].prompt_tokens_details.cached_tokens == usage[1].prompt_tokens - 1
    m = _metrics(server)
    assert m["compiled_prefix_cache_tokens"] > 0 and 0 < m["compiled_prefix_cache_hit_rate"] <= 1


def test_metrics_split_the_time_to_first_token(server):
    before = _metrics(server)
    start = time.monotonic()
    client(server).completions.create(model="qwen3-moe", prompt=PROMPTS[0], max_tokens=2, temperature=0)
    wall = time.monotonic() - start
    after = _metrics(server)
    phases = ("inbox", "queue", "prefill")
    names = [f"compiled_first_token_{p}_seconds" for p in phases]
    assert all(after[n + "_count"] == before[n + "_count"] + 1 for n in names)
    spent = [after[n + "_sum"] - before[n + "_sum"] for n in names]
    assert all(s >= 0 for s in spent) and 0 < sum(spent) < wall, spent
