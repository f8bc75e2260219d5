"""`compiled bench`: the decode-bytes model against hand-computed Qwen3-30B-A3B numbers, and a CPU
smoke test per subcommand whose JSON must be present and self-consistent."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from cli.bench_core import (exposed_kernel_time, gpu_idle, idle_gaps, percentile, read_dataset, runtime_calls,
                             trace_events)
from cli.main import app
from compiled.graphs.config import ModelConfig
from cli import roofline
from tests.conftest import make_checkpoint, one_line_error

runner = CliRunner()
QWEN3_30B = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "configs", "qwen3-30b-a3b")
SMALL = ["--device", "cpu", "--seed", "1"]


# ---- the bytes model -----------------------------------------------------------------------

def test_decode_bytes_qwen3_30b_a3b_by_hand():
    cfg = ModelConfig.from_pretrained(QWEN3_30B)
    # Hand-computed in bf16: one expert is gate + up + down = 3 x 2048 x 768 x 2 bytes = 9.4 MB.
    per_expert = 3 * 2048 * 768 * 2
    assert per_expert == 9_437_184 and roofline.expert_params(cfg) * 2 == per_expert
    # Attention: q 2048x4096, k and v 2048x512, o 4096x2048 = 37.7 MB (+ q/k norms, 2 x 128).
    attention = 2048 * (4096 + 512 + 512) * 2 + 4096 * 2048 * 2
    assert attention == 37_748_736 and roofline.attention_params(cfg) * 2 == attention + 2 * 128 * 2
    # KV: 2 (K, V) x 48 layers x 4 heads x 128 x 2 bytes = 96 KiB per token.
    assert cfg.kv_bytes_per_token * 2 == 96 * 1024
    # Per layer, besides attention and experts: two RMSNorms and the router (2048 x 128).
    per_layer = attention + 2 * 128 * 2 + 2 * 2048 * 2 + 2048 * 128 * 2
    lm_head = 151_936 * 2048 * 2

    def by_hand(batch: int, experts: float, context: int = 0) -> float:
        return (48 * (per_layer + experts * per_expert) + lm_head + 2048 * 2   # final norm
                + batch * 2048 * 2 + batch * context * 96 * 1024)              # embedding rows, KV

    assert roofline.expected_experts(128, 8, 1) == pytest.approx(8)
    assert roofline.expected_experts(128, 8, 8) == pytest.approx(128 * (1 - (120 / 128) ** 8))   # ~51.6
    assert roofline.expected_experts(128, 8, 64) == pytest.approx(125.94, abs=0.01)
    for batch, experts, design_gb in ((1, 8, 6.1), (8, 51.62, 25.8), (64, 125.94, 59.6)):
        b = roofline.decode_bytes(cfg, batch, 0, dtype_bytes=2)
        assert b.total == pytest.approx(by_hand(batch, roofline.expected_experts(128, 8, batch)))
        assert b.experts_per_layer == pytest.approx(experts, abs=0.01)
        assert b.total / 1e9 == pytest.approx(design_gb, rel=0.01)          # DESIGN.md section 6
    # Batch 256 at 1k context: 60.4 GB of weights + 25.8 GB of KV; floors at 4.25 TB/s (H200).
    b = roofline.decode_bytes(cfg, 256, 1024, dtype_bytes=2)
    assert b.kv == 256 * 1024 * 96 * 1024 and b.kv / 1e9 == pytest.approx(25.8, rel=0.01)
    assert b.weights / 1e9 == pytest.approx(60.4, rel=0.01)
    assert b.total == pytest.approx(by_hand(256, roofline.expected_experts(128, 8, 256), 1024))
    floors_ms = [1e3 * roofline.decode_bytes(cfg, n, 0).floor_s(4.25e12) for n in (1, 8, 64)]
    assert floors_ms == pytest.approx([1.43, 6.1, 14.0], rel=0.01)
    # Per-request contexts: the KV term is their sum.
    assert roofline.decode_bytes(cfg, 2, [100, 300]).kv == 400 * 96 * 1024


def test_param_count_matches_the_model():
    from compiled.graphs.trace import meta_model
    cfg = ModelConfig.from_pretrained(QWEN3_30B)
    assert roofline.total_params(cfg) == sum(p.numel() for p in meta_model(cfg).parameters())
    assert roofline.total_params(cfg) / 1e9 == pytest.approx(30.5, rel=0.01)
    dense = ModelConfig.from_pretrained(os.path.join(QWEN3_30B, "..", "qwen3-0.6b"))
    assert roofline.total_params(dense) == sum(p.numel() for p in meta_model(dense).parameters())
    b = roofline.decode_bytes(dense, 4, 10, dtype_bytes=2)
    assert b.experts == 0 and b.lm_head == 151_936 * 1024 * 2   # tied: the embedding is this matrix
    # DESIGN.md section 6: Qwen3-0.6B-shaped decode at batch 1 has a 0.28 ms floor on an H200.
    assert 1e3 * roofline.decode_bytes(dense, 1, 0).floor_s(4.25e12) == pytest.approx(0.28, rel=0.01)


def test_bandwidth_is_measured_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = roofline.device_bandwidth("cpu")
    second = roofline.device_bandwidth("cpu")
    assert first.source == "measured" and second.source == "cache"
    assert first.bytes_per_s == second.bytes_per_s > 1e8
    assert (tmp_path / "compiled" / "bandwidth.json").is_file()


def test_percentile_interpolates_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == 2.5 and percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 90) == pytest.approx(3.7)


def test_exposed_kernel_time_splits_the_span(tmp_path):
    # a runs 0-10; b starts early (PDL) at 4 and ends at 15: 5 of its own; c after a gap of 3,
    # 18-20; a again inside c's span adds nothing; CPU events are ignored
    kernels = [("a", 0, 10), ("b", 4, 11), ("c", 18, 2), ("a", 18.5, 1)]
    events = [{"cat": "kernel", "ph": "X", "name": n, "ts": ts, "dur": d} for n, ts, d in kernels]
    events.append({"cat": "cpu_op", "ph": "X", "name": "aten::mm", "ts": 0, "dur": 16})  # 1 µs into the gap
    events += [{"cat": "cuda_runtime", "ph": "X", "name": "cudaMalloc", "ts": t, "dur": 40} for t in (1, 60)]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    rows = {r["name"]: r for r in exposed_kernel_time(trace_events(trace))}
    assert rows["a"]["calls"] == 2 and rows["a"]["exposed_ms"] == pytest.approx(10e-3)
    assert rows["b"]["exposed_ms"] == pytest.approx(5e-3) and rows["b"]["idle_before_ms"] == 0
    assert rows["c"]["exposed_ms"] == pytest.approx(5e-3) and rows["c"]["idle_before_ms"] == pytest.approx(3e-3)
    assert sum(r["exposed_ms"] for r in rows.values()) == pytest.approx(20e-3)  # the whole span
    assert set(rows) == {"a", "b", "c"}
    assert idle_gaps(trace_events(trace)) == [{"at_us": 15, "idle_us": 3, "after": "b", "before": "c", "host": ["cudaMalloc 3", "aten::mm 1"]}]
    assert runtime_calls(trace_events(trace)) == [{"name": "cudaMalloc", "calls": 2, "ms": 0.08}]
    idle = gpu_idle(trace_events(trace))
    assert idle["span_ms"] == pytest.approx(20e-3) and idle["idle_ms"] == pytest.approx(3e-3)


def test_critical_path_table_renders_exposed_rows():
    from rich.console import Console

    from cli.bench import _critical_path_table
    console = Console(width=160, record=True)
    console.print(_critical_path_table({"exposed": [{"name": "moe_gemm1_kernel", "calls": 144,
                                                     "exposed_ms": 2.954, "idle_before_ms": 0.0}]}))
    text = console.export_text()
    assert "moe_gemm1_kernel" in text and "2.954" in text and "144" in text


def test_dataset_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt_token_ids": [1, 2, 3], "output_len": 5}\n\n[4, 5]\n"text"\n')
    items = read_dataset(path, output_len=7, output_len_max=None, seed=0)
    assert [(it.prompt, it.output_len) for it in items] == [([1, 2, 3], 5), ([4, 5], 7), ("text", 7)]
    assert len(read_dataset(path, 7, None, 0, limit=2)) == 2


# ---- the CLI on CPU -------------------------------------------------------------------------

def _demo_model() -> str | None:
    try:
        from compiled.demo import MOE_MODEL
    except ImportError:
        return None
    built = os.path.isfile(os.path.join(MOE_MODEL, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(MOE_MODEL))
    return MOE_MODEL if built else None


@pytest.fixture(scope="module")
def model_args(tmp_path_factory) -> list[str]:
    """No MODEL argument (the shipped demo MoE model) once it exists; until then a small random
    MoE checkpoint."""
    if _demo_model():
        return []
    return [make_checkpoint(tmp_path_factory.mktemp("bench_ckpt"), moe=True)]


@pytest.fixture(autouse=True)
def _cache_home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))


def _bench_with_output(*args: str) -> tuple[dict, str]:
    """The JSON record of `compiled bench ARGS` and what it printed."""
    json_path = args[args.index("--json") + 1]
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    with open(json_path) as f:
        return json.load(f), result.output


def _bench(*args: str) -> dict:
    return _bench_with_output(*args)[0]


def _ordered(s: dict) -> bool:
    return s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]


def _common_fields(record: dict, command: str) -> None:
    assert record["command"] == command
    env = record["env"]
    for key in ("device", "device_name", "torch", "triton", "transformers", "git_commit"):
        assert key in env
    assert env["device"] == "cpu" and env["torch"]
    assert record["options"]["device"] == "cpu" and record["options"]["seed"] == 1


def test_latency(model_args, tmp_path):
    out = tmp_path / "latency.json"
    rec = _bench("latency", *model_args, *SMALL, "--batch-size", "2", "--input-len", "16", "--output-len", "8",
                 "--num-iters", "2", "--num-iters-warmup", "1", "--json", str(out))
    _common_fields(rec, "latency")
    r = rec["results"]
    assert rec["options"]["batch_size"] == 2 and rec["compare"] is None
    assert r["num_iters"] == 2 and r["ttft_ms"]["n"] == 2
    assert r["output_tokens"] == 2 * 2 * 8 and r["decode_steps"] == 2 * 7 and r["decode_step_ms"]["n"] == 2 * 7
    assert r["decode_steps_not_full"] == 0 and r["retractions"] == 0
    assert r["output_tokens_per_s"] * r["elapsed_s"] == pytest.approx(r["output_tokens"])
    assert _ordered(r["decode_step_ms"]) and r["ttft_ms"]["p50"] > 0 and r["prefill_steps"] == 1
    assert r["ttft_ms"]["p50"] / 1e3 <= r["elapsed_s"]
    rf = r["roofline"]
    cfg = ModelConfig.from_pretrained(rec["model"])
    assert rf["context"] == 16 + 4
    assert rf["bytes_per_step"] == pytest.approx(roofline.decode_bytes(cfg, 2, 20, 4).total)
    assert rf["floor_ms"] == pytest.approx(1e3 * rf["bytes_per_step"] / rf["bandwidth_bytes_per_s"])
    assert rf["fraction_of_roofline"] == pytest.approx(rf["floor_ms"] / r["decode_step_ms"]["p50"])


def test_latency_and_throughput_with_random_adapters(model_args, tmp_path):
    """--num-loras random adapters in the real shapes; requests spread over them as --lora-dist says."""
    out = tmp_path / "lora.json"
    rec = _bench("latency", *model_args, *SMALL, "--batch-size", "4", "--input-len", "8", "--output-len", "4",
                 "--num-iters", "1", "--num-iters-warmup", "0", "--num-loras", "2", "--lora-rank", "4",
                 "--lora-dist", "one", "--json", str(out))
    assert rec["options"]["num_loras"] == 2 and rec["lora_requests"] == {"lora0": 4}
    assert rec["results"]["decode_steps"] == 3 and rec["results"]["decode_steps_not_full"] == 0
    rec = _bench("throughput", *model_args, *SMALL, "--num-prompts", "12", "--input-len", "8", "--output-len", "3",
                 "--num-loras", "3", "--lora-rank", "4", "--lora-targets", "attn", "--max-loras-per-batch", "2",
                 "--json", str(out))
    assert sum(rec["lora_requests"].values()) == 12 and set(rec["lora_requests"]) <= {"lora0", "lora1", "lora2"}
    assert rec["results"]["output_tokens"] == 12 * 3


def test_latency_compare_hf(model_args, tmp_path):
    out = tmp_path / "latency_hf.json"
    result_args = ("latency", *model_args, *SMALL, "--batch-size", "2", "--input-len", "16", "--output-len", "8",
                   "--num-iters", "1", "--num-iters-warmup", "0", "--compare", "hf", "--json", str(out))
    rec = _bench(*result_args)
    ours, hf = rec["results"], rec["compare"]["hf"]
    assert "AutoModelForCausalLM" in hf["implementation"]
    assert hf["output_tokens"] == ours["output_tokens"] == 16 and hf["decode_step_ms"]["n"] == 7
    assert hf["output_tokens_per_s"] * hf["elapsed_s"] == pytest.approx(hf["output_tokens"])
    assert _ordered(hf["decode_step_ms"])
    speedup = rec["compare"]["speedup"]
    assert speedup["decode_step"] == pytest.approx(hf["decode_step_ms"]["p50"] / ours["decode_step_ms"]["p50"])


def test_latency_times_decode_at_the_whole_batch_after_a_chunked_prefill(model_args, tmp_path):
    """A 16-token step budget prefills the second request after the first has begun decoding:
    the decode steps are timed once both have their first token, output_len - 1 of them at the
    whole batch, and the output says how many tokens were decoded before (untimed)."""
    out = tmp_path / "latency_chunked.json"
    rec = _bench("latency", *model_args, *SMALL, "--batch-size", "2", "--input-len", "16", "--output-len", "8",
                 "--max-num-batched-tokens", "16", "--num-iters", "1", "--num-iters-warmup", "0", "--json", str(out))
    r = rec["results"]
    assert r["prefill_steps"] > 1 and r["decoded_while_filling"] > 0 and r["retractions"] == 0
    assert r["decode_steps"] == r["decode_step_ms"]["n"] == 7 and r["decode_steps_not_full"] == 0
    assert r["decode_timing"] == "whole batch prefilled first"
    assert r["roofline"]["fraction_of_roofline"] == pytest.approx(r["roofline"]["floor_ms"] / r["decode_step_ms"]["p50"])


def test_latency_times_decode_when_the_prefill_outlasts_the_output(model_args, tmp_path):
    """More prompt tokens than one step takes and only 4 output tokens: the first requests would
    finish before the last are prefilled, yet the decode step is timed at the batch asked for,
    and the table says how."""
    out = tmp_path / "latency_long_prefill.json"
    result = runner.invoke(app, ["bench", "latency", *model_args, *SMALL, "--batch-size", "8", "--input-len", "24",
                                 "--output-len", "4", "--max-num-batched-tokens", "32", "--num-iters", "1",
                                 "--num-iters-warmup", "0", "--json", str(out)])
    assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())["results"]
    assert r["decoded_while_filling"] > 4 and r["decode_steps"] == 3 and r["decode_step_ms"]["p50"] > 0
    assert "decode timed" in result.output and "after all 8 prompts had their first token" in result.output


@pytest.mark.parametrize("output_len, whole", [(4, 0), (24, 3)])
def test_latency_profile_says_which_steps_ran_the_whole_batch(model_args, tmp_path, output_len, whole):
    """Eight prompts prefilled 32 tokens a step: with 4 output tokens the first requests are done
    before the last is prefilled, so no profiled step decodes all 8 and the profile says so; with
    24, the three profiled steps all do. The table's title says when they do not."""
    out, prof = tmp_path / "latency_profile.json", tmp_path / "prof"
    rec, output = _bench_with_output("latency", *model_args, *SMALL, "--batch-size", "8", "--input-len", "24",
                                     "--output-len", str(output_len), "--max-num-batched-tokens", "32", "--num-iters",
                                     "1", "--num-iters-warmup", "0", "--profile", str(prof), "--profile-steps", "3",
                                     "--json", str(out))
    assert rec["profile"]["whole_batch_steps"] == whole
    assert ("decoding the whole batch: raise --output-len" in " ".join(output.split())) == (whole < 3)


def test_latency_batch_larger_than_the_kv_cache_fails_up_front(model_args, tmp_path):
    result = runner.invoke(app, ["bench", "latency", *model_args, *SMALL, "--batch-size", "4", "--input-len", "16",
                                 "--output-len", "8", "--kv-cache-tokens", "64", "--max-model-len", "64",
                                 "--json", str(tmp_path / "never.json")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert "does not fit the KV cache" in lines[0] and "4 x (16 + 8) tokens = 96 > 64 slots" in lines[0]
    assert "2 requests fit" in lines[0]
    assert not (tmp_path / "never.json").exists()


def test_throughput_with_profile(model_args, tmp_path):
    out, prof = tmp_path / "throughput.json", tmp_path / "prof"
    rec = _bench("throughput", *model_args, *SMALL, "--num-prompts", "5", "--input-len", "8", "--input-len-max", "16",
                 "--output-len", "4", "--output-len-max", "8", "--profile", str(prof), "--profile-steps", "3",
                 "--json", str(out))
    _common_fields(rec, "throughput")
    r = rec["results"]
    assert r["num_requests"] == 5 and 5 * 8 <= r["input_tokens"] <= 5 * 16 and 5 * 4 <= r["output_tokens"] <= 5 * 8
    assert r["total_tokens"] == r["input_tokens"] + r["output_tokens"]
    for key, n in (("requests_per_s", 5), ("output_tokens_per_s", r["output_tokens"]),
                   ("total_tokens_per_s", r["total_tokens"])):
        assert r[key] * r["elapsed_s"] == pytest.approx(n)
    # All five fit at once: at the peak, every request's prompt is in the KV cache.
    assert r["input_tokens"] <= r["peak_kv_slots"] <= min(r["kv_slots"], r["total_tokens"])
    p = rec["profile"]
    assert p["steps"] == 3 and p["top"] and len(p["top"]) <= 15
    trace = json.loads((prof / "throughput_trace.json").read_text())
    assert trace["traceEvents"]


def test_serving(model_args, tmp_path):
    out = tmp_path / "serving.json"
    rec = _bench("serving", *model_args, *SMALL, "--num-prompts", "5", "--request-rate", "50",
                 "--input-len", "16", "--output-len", "8", "--json", str(out))
    _common_fields(rec, "serving")
    r = rec["results"]
    assert r["num_requests"] == 5 and r["output_tokens"] == 40 and r["request_rate"] == 50
    assert r["requests_per_s"] * r["duration_s"] == pytest.approx(5)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert _ordered(r[key]), key
    assert r["itl_ms"]["n"] == 5 * 7
    for req in r["requests"]:
        assert 0 < req["ttft_ms"] <= req["e2e_ms"] and req["output_len"] == 8
        assert req["itl_ms"]["p50"] <= req["itl_ms"]["p90"] <= req["itl_ms"]["p99"]
    sent = [req["sent_s"] for req in r["requests"]]
    assert sent == sorted(sent) and sent[-1] > 0          # Poisson arrivals, not all at once


def test_serving_under_a_json_schema_reports_compile_and_mask_times(tmp_path):
    out = tmp_path / "serving.json"
    rec = _bench("serving", *SMALL, "--num-prompts", "3", "--input-len", "8", "--output-len", "6",
                 "--structured", "json", "--json", str(out))
    st = rec["results"]["structured"]
    assert st["requests"] == 3 and st["compiles"] == 1 and st["compile_cache_hits"] == 2
    # the schema cannot end within 6 tokens: every row of every step is masked
    assert rec["results"]["output_tokens"] == 18 and st["mask_rows"] >= 18
    assert 0 < st["mask_ms"]["p50"] <= st["mask_ms"]["p99"] and st["compile_ms"]["p50"] > 0


def test_startup(model_args, tmp_path):
    out = tmp_path / "startup.json"
    rec = _bench("startup", *model_args, *SMALL, "--json", str(out))
    _common_fields(rec, "startup")
    r = rec["results"]
    stages = r["stages_s"]
    for stage in ("trace", "passes", "load"):
        assert stages[stage] > 0, stage
    assert all(v >= 0 for v in stages.values())
    assert sum(stages.values()) == pytest.approx(r["llm_init_s"], rel=0.01)
    assert r["ttft_cold_s"] > 0 and r["ttft_warm_s"] > 0
    assert r["total_s"] == pytest.approx(r["llm_init_s"] + r["ttft_cold_s"])


@pytest.mark.parametrize("args, needle", [
    (["latency", "--batch-size", "0"], "--batch-size"),
    (["latency", "--batch-size", "9", "--max-num-seqs", "8"], "--max-num-seqs"),
    (["latency", "--compare", "vllm"], "--compare"),
    (["serving", "--request-rate", "0"], "--request-rate"),
    (["serving", "--compare", "hf"], "serving"),
    (["serving", "--client-processes", "2"], "--client-processes needs --url"),
    (["serving", "--url", "http://127.0.0.1:1", "--client-processes", "0"], "--client-processes"),
    (["serving", "--api-key", "k"], "--api-key needs --url"),
    (["serving", "--structured", "yaml"], "--structured 'yaml'"),
    (["throughput", "--input-len", "16", "--input-len-max", "8"], "--input-len-max"),
    (["throughput", "--dataset", "/nonexistent.jsonl"], "/nonexistent.jsonl"),
    (["startup", "--load-format", "pickle"], "pickle"),
    (["latency", "/nonexistent/model"], "/nonexistent/model"),
])
def test_bad_option_is_one_line_error(args, needle):
    result = runner.invoke(app, ["bench", *args, "--device", "cpu"])
    assert result.exit_code == 1
    assert needle in one_line_error(result.output), result.output


def test_bad_dataset_line_names_it(model_args, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('[1, 2]\n{oops\n')
    result = runner.invoke(app, ["bench", "throughput", *model_args, *SMALL, "--dataset", str(path)])
    assert result.exit_code == 1 and f"{path}:2" in result.output


def test_shared_prefix_workload():
    from cli.bench_core import random_workload
    items = random_workload(5, 4, 7, 3, None, 100, seed=2, shared_prefix_len=20)
    assert all(item.prompt[:20] == items[0].prompt[:20] for item in items)
    assert all(24 <= len(item.prompt) <= 27 for item in items)
    assert len({tuple(item.prompt[20:]) for item in items}) == 5


def test_startup_with_fresh_caches(model_args, tmp_path, monkeypatch):
    import os
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "warm"))      # restored after the test
    rec = _bench("startup", *model_args, *SMALL, "--fresh-caches", "--json", str(tmp_path / "s.json"))
    assert rec["results"]["fresh_caches"] is True
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert os.environ[name] != str(tmp_path / "warm") and os.path.isdir(os.environ[name])


@pytest.mark.parametrize("tokenizer", [True, False], ids=["demo-tokenizer", "stand-in-vocabulary"])
def test_latency_with_a_json_schema_on_every_request(model_args, tmp_path, tokenizer):
    """--structured json: every step of every row is masked (the schema cannot end within the
    output), and the mask and compile times are reported beside the step time."""
    model = model_args if tokenizer else [make_checkpoint(tmp_path / "ckpt", moe=True, vocab_size=600)]
    out = tmp_path / "structured.json"
    rec = _bench("latency", *model, *SMALL, "--batch-size", "2", "--input-len", "8", "--output-len", "6",
                 "--num-iters", "2", "--num-iters-warmup", "1", "--structured", "json", "--json", str(out))
    r, st = rec["results"], rec["results"]["structured"]
    assert r["decode_steps"] == 2 * 5 and r["decode_steps_not_full"] == 0
    assert st["requests"] == 3 * 2 and st["compiles"] == 1 and st["compile_cache_hits"] == 5
    assert st["mask_rows"] >= 3 * 2 * 6 and 0 < st["mask_ms"]["p50"] <= st["mask_ms"]["p99"]
    assert 0 < st["compile_ms"]["p50"] <= st["compile_ms"]["max"]
    result = runner.invoke(app, ["bench", "latency", *SMALL, "--structured", "yaml"])
    assert result.exit_code != 0 and "--structured 'yaml': choose from json" in result.output
