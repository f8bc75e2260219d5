"""What constrained decoding cost: grammar compile times and the host time of each step's masks,
kept over a bounded window for percentiles, as a snapshot a server reports in /metrics."""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

WINDOW = 4096   # latest samples the percentiles are taken over


@dataclass(frozen=True)
class StructuredStats:
    """A snapshot (seconds; zero before the first sample)."""
    requests: int = 0                 # constrained requests added
    compiles: int = 0                 # grammars compiled (cache misses that succeeded)
    compile_cache_hits: int = 0       # requests whose grammar was compiled already or being compiled
    compile_failures: int = 0         # requests ended because their grammar did not compile
    compile_seconds_p50: float = 0.0
    compile_seconds_p99: float = 0.0
    compile_seconds_max: float = 0.0
    mask_steps: int = 0               # steps that masked at least one row
    mask_rows: int = 0                # rows masked, over all those steps
    mask_seconds_p50: float = 0.0     # host time to fill a step's masks (all its rows)
    mask_seconds_p99: float = 0.0


def percentile(samples, q: float) -> float:
    """The q-th percentile (0..100) of `samples`, nearest rank; 0.0 when there are none."""
    ordered = sorted(samples)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


class StatsRecorder:
    """Counts and timings, written by the engine's thread and the compile threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._compile: deque[float] = deque(maxlen=WINDOW)
        self._mask: deque[float] = deque(maxlen=WINDOW)
        self.requests = self.compiles = self.hits = self.failures = self.mask_steps = self.mask_rows = 0

    def compiled(self, seconds: float) -> None:
        with self._lock:
            self.compiles += 1
            self._compile.append(seconds)

    def masked(self, rows: int, seconds: float) -> None:
        self.mask_steps += 1
        self.mask_rows += rows
        self._mask.append(seconds)

    def snapshot(self) -> StructuredStats:
        with self._lock:
            compile_times, mask_times = list(self._compile), list(self._mask)
            return StructuredStats(
                requests=self.requests, compiles=self.compiles, compile_cache_hits=self.hits,
                compile_failures=self.failures, compile_seconds_p50=percentile(compile_times, 50),
                compile_seconds_p99=percentile(compile_times, 99), compile_seconds_max=max(compile_times, default=0.0),
                mask_steps=self.mask_steps, mask_rows=self.mask_rows, mask_seconds_p50=percentile(mask_times, 50),
                mask_seconds_p99=percentile(mask_times, 99))
