"""`/health`, `/version`, and `/metrics` (Prometheus text) from the engine's `MetricsSnapshot`."""

from __future__ import annotations

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import PlainTextResponse

from compiled.version import __version__
from compiled.server.messages import FIRST_TOKEN_PHASES, GetMetrics, MetricsSnapshot
from compiled.server.protocol import APIError
from compiled.server.routes.common import server_of
from compiled.structured.stats import StructuredStats

router = APIRouter()


@router.get("/health", response_model=None)
async def health(http: HTTPRequest) -> dict:
    if not server_of(http).engine.alive:
        raise APIError(503, "the engine has stopped")
    return {}


@router.get("/version", response_model=None)
async def version() -> dict:
    return {"version": __version__}


@router.get("/metrics")
async def metrics(http: HTTPRequest) -> PlainTextResponse:
    snapshot = await server_of(http).engine.call(GetMetrics())
    return PlainTextResponse(prometheus_text(snapshot), media_type="text/plain; version=0.0.4")


def prometheus_text(m: MetricsSnapshot) -> str:
    lines = [
        "# TYPE compiled_requests_running gauge", f"compiled_requests_running {m.running}",
        "# TYPE compiled_requests_waiting gauge", f"compiled_requests_waiting {m.waiting}",
        "# HELP compiled_kv_cache_usage share of KV slots held by requests (cached prefixes excluded)",
        "# TYPE compiled_kv_cache_usage gauge", f"compiled_kv_cache_usage {m.kv_in_use:.6f}",
        "# TYPE compiled_prefix_cache_tokens gauge", f"compiled_prefix_cache_tokens {m.prefix_cache_tokens}",
        "# TYPE compiled_prefix_cache_hit_rate gauge",
        f"compiled_prefix_cache_hit_rate {m.prefix_cache_hit_rate:.6f}",
        "# TYPE compiled_requests_finished_total counter",
        f"compiled_requests_finished_total {m.requests_finished}",
        "# TYPE compiled_prompt_tokens_total counter", f"compiled_prompt_tokens_total {m.prompt_tokens}",
        "# TYPE compiled_generation_tokens_total counter",
        f"compiled_generation_tokens_total {m.generation_tokens}",
        "# TYPE compiled_generation_tokens_per_second gauge",
        f"compiled_generation_tokens_per_second {m.generation_tokens_per_second:.3f}",
        "# HELP compiled_engine_step_seconds wall time of the engine's steps",
        "# TYPE compiled_engine_step_seconds summary",
        f"compiled_engine_step_seconds_sum {m.step_seconds:.6f}",
        f"compiled_engine_step_seconds_count {m.steps}",
        "# HELP compiled_cuda_graphs_pending CUDA-graph buckets left to capture while the engine idles",
        "# TYPE compiled_cuda_graphs_pending gauge", f"compiled_cuda_graphs_pending {m.graphs_pending}",
    ]
    for kind, what in (("compiled", "compiled"), ("cached", "loaded from the cache")):
        if kind in m.kernels:
            name = f"compiled_triton_kernels_{kind}_total"
            lines += [f"# HELP {name} Triton kernels {what} while serving (each holds up the running requests)",
                      f"# TYPE {name} counter", f"{name} {m.kernels[kind]}"]
    for phase, seconds in m.phase_seconds.items():
        name = f"compiled_first_token_{phase}_seconds"
        lines += [f"# HELP {name} {FIRST_TOKEN_PHASES[phase]}", f"# TYPE {name} summary",
                  f"{name}_sum {seconds:.6f}", f"{name}_count {m.first_tokens}"]
    return "\n".join(lines + _structured_lines(m.structured)) + "\n"


def _structured_lines(s: StructuredStats) -> list[str]:
    """Constrained decoding: grammar compiles (cache hits, failures) and their time, and the host
    time of each step's masks (p50 and p99 over the latest samples)."""
    lines = []
    for name, value, help_text in (
            ("structured_requests_total", s.requests, "requests with a grammar"),
            ("grammar_compiles_total", s.compiles, "grammars compiled"),
            ("grammar_compile_cache_hits_total", s.compile_cache_hits, "requests whose grammar was cached"),
            ("grammar_compile_failures_total", s.compile_failures, "requests ended by a grammar that failed"),
            ("grammar_mask_steps_total", s.mask_steps, "steps that masked a row"),
            ("grammar_mask_rows_total", s.mask_rows, "rows masked, over those steps")):
        lines += [f"# HELP compiled_{name} {help_text}", f"# TYPE compiled_{name} counter",
                  f"compiled_{name} {value}"]
    for name, p50, p99, help_text in (
            ("grammar_compile_seconds", s.compile_seconds_p50, s.compile_seconds_p99, "a grammar's compile time"),
            ("grammar_mask_seconds", s.mask_seconds_p50, s.mask_seconds_p99, "host time of a step's masks")):
        lines += [f"# HELP compiled_{name} {help_text}", f"# TYPE compiled_{name} summary",
                  f'compiled_{name}{{quantile="0.5"}} {p50:.6f}', f'compiled_{name}{{quantile="0.99"}} {p99:.6f}']
    return lines
