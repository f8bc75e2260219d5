"""The messages between the front end's process and the engine's: commands down one pipe, reports
up the other. Each is a dataclass (pickled across the pipe) that each side hands to its handler
through one table keyed by the message's type.

Down: `Add`, `Abort`, `Stop`, and the calls the front end awaits a `Reply` to (`LoadLora`,
`UnloadLora`, `GetMetrics`). Up: `Ready` or `StartFailed` once, then `Reports` and `Failures`
after steps, and `Reply`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from compiled.runtime.sampling_params import SamplingParams
from compiled.structured.stats import StructuredStats

if TYPE_CHECKING:
    from compiled.runtime.llm import LLM

# A request's time to its first token, in phases, and what each measures.
FIRST_TOKEN_PHASES = {
    "inbox": "seconds from a handler's post of a request to the engine's queue",
    "queue": "seconds from the engine's queue to the first step computing the request",
    "prefill": "seconds from that step's launch to the first token sent to the front end",
}


# ---- what both sides know of a request and of the model ----------------------------------------

@dataclass
class Submitted:
    """An engine request as the front end knows it (`id`: its key in both processes)."""
    id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: str | None


@dataclass
class Progress:
    """What a request has produced since its last report (in its first report also its prompt's
    logprobs, when it asked for them: one entry a prompt token, None for the first; and how many
    prompt tokens came from the prefix cache)."""
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    cached_tokens: int | None = None   # in its first report: prompt tokens found in the prefix cache

    def followed_by(self, later: Progress) -> Progress:
        """This report and the next one of the same request as one."""
        logprobs = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        cached = self.cached_tokens if self.cached_tokens is not None else later.cached_tokens
        return Progress(self.token_ids + later.token_ids, logprobs, later.finished, later.finish_reason,
                        later.stop_reason, self.prompt_logprobs or later.prompt_logprobs, cached)


@dataclass(frozen=True)
class ModelInfo:
    """What the front end knows of the served model, sent by the engine once it is built."""
    model_path: str
    max_context: int
    vocab_size: int
    tokenizer_path: str | None
    lora_enabled: bool
    loras: tuple[str, ...]

    @classmethod
    def of(cls, llm: LLM) -> ModelInfo:
        tokenizer = (llm.config.tokenizer or llm.model_path) if llm.tokenizer is not None else None
        return cls(llm.model_path, llm.engine.max_context, llm.model_config.vocab_size, tokenizer,
                   llm.engine.loras is not None, tuple(llm.loras))


@dataclass(frozen=True)
class Counts:
    """The engine's requests after a step: running, waiting, and added since it started."""
    running: int = 0
    waiting: int = 0
    added: int = 0


@dataclass
class MetricsSnapshot:
    """What `/metrics` shows of the engine: request counts, KV and prefix-cache use, totals."""
    running: int
    waiting: int
    kv_in_use: float                    # share of KV slots held by requests (cached prefixes excluded)
    prefix_cache_tokens: int
    prefix_cache_hit_rate: float
    requests_finished: int
    prompt_tokens: int
    generation_tokens: int
    generation_tokens_per_second: float
    steps: int
    step_seconds: float                 # engine.step wall time, summed
    first_tokens: int                   # requests whose first token was sent (phase_seconds sums over them)
    phase_seconds: dict[str, float]     # by FIRST_TOKEN_PHASES
    structured: StructuredStats = field(default_factory=StructuredStats)   # grammar compiles, masks
    graphs_pending: int = 0             # CUDA-graph buckets left to capture while the engine idles
    kernels: dict[str, int] = field(default_factory=dict)   # Triton kernels "compiled" / "cached" while serving


# ---- down: the front end to the engine ---------------------------------------------------------

@dataclass
class Add:
    """Queue `requests`; `posted`: when the handler took them (perf_counter: one clock for all
    processes on Linux)."""
    requests: list[Submitted]
    posted: float


@dataclass
class Abort:
    """Stop the request of key `key` (a no-op once it finished)."""
    key: int


@dataclass
class Stop:
    """Finish what was added, then end the loop."""


@dataclass
class Gone:
    """The front end went away: drop everything, end the loop (posted by the engine's own reader)."""


@dataclass(kw_only=True)
class Call:
    """A command the front end awaits a `Reply` to, matched by `call_id` (set by the client)."""
    call_id: int = 0


@dataclass
class LoadLora(Call):
    """Read adapter `name` from `path` and serve it."""
    name: str
    path: str


@dataclass
class UnloadLora(Call):
    name: str


@dataclass
class GetMetrics(Call):
    """Reply: a `MetricsSnapshot`."""


@dataclass
class LoraRead(Call):
    """Posted by the engine loop to itself: the adapter a `LoadLora` read beside the steps, or the
    error reading it."""
    adapter: object | None
    error: BaseException | None


# ---- up: the engine to the front end -----------------------------------------------------------

@dataclass
class Ready:
    info: ModelInfo


@dataclass
class StartFailed:
    error: BaseException


@dataclass
class Reports:
    """Each request's news since the last step (by key), and the engine's counts after it."""
    progress: dict[int, Progress]
    counts: Counts

    def __reduce__(self) -> tuple:
        # Sent after every step with a report of each running request: pickled as one row of
        # field values a report (rebuilt by `_reports`), several times faster than a dataclass's
        # own pickling (every report with its class and each field's name), which would add
        # a few hundred microseconds to a large batch's step.
        rows = [(key, *vars(p).values()) for key, p in self.progress.items()]
        return _reports, (rows, self.counts)


def _reports(rows: list[tuple], counts: Counts) -> Reports:
    return Reports({key: Progress(*fields) for key, *fields in rows}, counts)


@dataclass
class Failures:
    """Requests that failed (by key, with what failed them), and the engine's counts after."""
    errors: dict[int, str]
    counts: Counts


@dataclass
class Reply:
    """The answer to the call `call_id`: its value, or the error it raised."""
    call_id: int
    error: BaseException | None
    value: object = None
