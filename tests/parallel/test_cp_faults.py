"""A context-parallel rank that dies or hangs mid-prefill: rank 0 raises a one-line error within
the group's timeout, every worker process is gone, and the LLM goes on without the group."""

from __future__ import annotations

import os
import signal
import time

import pytest

from compiled import LLM, SamplingParams
from compiled.parallel.group import CPError
from compiled.runtime.context_parallel import ContextParallelRunner

ENGINE = dict(max_num_batched_tokens=32, cp_min_tokens=8, kv_cache_tokens=2048, max_model_len=512)
PROMPT = [(5 * i) % 200 + 1 for i in range(300)]     # ten 32-token chunks, each split
PARAMS = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_a_failed_rank_stops_the_group(monkeypatch, fault):
    llm = LLM(None, context_parallel_size=2, cp_timeout=5.0, **ENGINE)
    worker = llm.engine.runner.cp.group.processes[0]
    run = ContextParallelRunner.run

    def fail_after_first(self, chunks):
        out = run(self, chunks)
        if self.steps == 2:   # mid-prefill: the prompt's second chunk done, eight to go
            os.kill(worker.pid, signal.SIGKILL if fault == "dies" else signal.SIGSTOP)
            if fault == "dies":
                worker.join(10)
        return out

    monkeypatch.setattr(ContextParallelRunner, "run", fail_after_first)
    start = time.monotonic()
    try:
        with pytest.raises(CPError) as e:
            llm.generate([PROMPT], PARAMS)
        assert time.monotonic() - start < 60
        assert "\n" not in str(e.value) and "context-parallel group of 2" in str(e.value)
        if fault == "dies":
            assert "rank 1 exited" in str(e.value)
        assert worker.exitcode is not None            # killed by the shutdown, if it was only stopped
        assert llm.context_parallel == 1
        assert llm.engine.kv.num_used == 0 and not llm.engine.has_work   # the failed call left nothing
        monkeypatch.setattr(ContextParallelRunner, "run", run)
        alone = llm.generate([PROMPT], PARAMS)[0]     # on rank 0 alone now
        assert len(alone.token_ids) == 3
    finally:
        llm.shutdown()
        if worker.exitcode is None:
            worker.kill()


def test_bad_context_parallel_settings_are_one_line_errors():
    from compiled.errors import ConfigError
    for kwargs, match in ((dict(context_parallel_size=0), "context_parallel_size=0: expected an int >= 1"),
                          (dict(cp_min_tokens=0), "cp_min_tokens=0: expected an int >= 1"),
                          (dict(cp_timeout=-1), "cp_timeout=-1: expected seconds > 0")):
        with pytest.raises(ConfigError, match=match):
            LLM(None, **kwargs)


def test_context_parallelism_that_never_splits_is_a_one_line_error():
    from compiled.errors import ConfigError
    with pytest.raises(ConfigError, match="context_parallel_size=2 would never split a prefill: "
                                          "max_num_batched_tokens=4096 is below cp_min_tokens=12288"):
        LLM(None, context_parallel_size=2, max_num_batched_tokens=4096)


def test_context_parallelism_with_default_settings_takes_a_budget_it_can_split():
    """Left unchosen, the step's token budget is what CP needs to split a chunk (cp_min_tokens when
    that is larger than the usual default); a chosen one is kept, and without CP the default holds."""
    from compiled.runtime.config import DEFAULT_BATCHED_TOKENS, EngineConfig
    cp = EngineConfig.from_kwargs(context_parallel_size=2).resolve(40960)
    assert cp.max_num_batched_tokens == cp.cp_min_tokens > DEFAULT_BATCHED_TOKENS
    assert EngineConfig.from_kwargs(context_parallel_size=2, cp_min_tokens=64).resolve(40960) \
        .max_num_batched_tokens == DEFAULT_BATCHED_TOKENS
    assert EngineConfig.from_kwargs(context_parallel_size=2, max_num_batched_tokens=20000).resolve(40960) \
        .max_num_batched_tokens == 20000
    assert EngineConfig.from_kwargs().resolve(40960).max_num_batched_tokens == DEFAULT_BATCHED_TOKENS


def test_cli_commands_with_cp_and_their_defaults_resolve():
    """`--cp 2` on run, serve and bench with every other option at its default starts (the config
    each command builds resolves), as `LLM(context_parallel_size=2)` does."""
    import inspect
    from cli import bench, run, serve
    from cli.engine_options import engine_config
    commands = {"run": run.run, "serve": serve.serve}
    commands.update({f"bench {c.callback.__name__}": c.callback for c in bench.bench_app.registered_commands})
    for name, fn in commands.items():
        values = {k: getattr(p.default, "default", p.default) for k, p in inspect.signature(fn).parameters.items()
                  if k != "seed"}   # run's --seed is the requests' sampling seed
        config = engine_config(dict(values, context_parallel_size=2, load_format="auto")).resolve(40960)
        assert config.max_num_batched_tokens >= config.cp_min_tokens, name


@pytest.mark.gpu
def test_more_ranks_than_gpus_is_a_one_line_error():
    import torch
    from compiled.errors import ConfigError
    n = torch.cuda.device_count() + 1
    with pytest.raises(ConfigError, match=f"context_parallel_size={n}: only {n - 1} GPU"):
        LLM(None, device="cuda", context_parallel_size=n)


def test_ctrl_c_stops_every_rank(tmp_path):
    import subprocess
    import sys
    code = ("import os, signal\nfrom compiled import LLM\n"
            "llm = LLM(None, context_parallel_size=2, cp_min_tokens=64, kv_cache_tokens=2048, max_model_len=256)\n"
            "print('WORKER', llm.engine.runner.cp.group.processes[0].pid, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGINT)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr
    pid = int(next(line for line in proc.stdout.splitlines() if line.startswith("WORKER")).split()[1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:   # a zombie has exited: only its parent has not reaped it
        return f.read().split()[2] != "Z"


class _Worker:
    """What rank 0's start-up wait asks of a spawned worker process."""

    def __init__(self, alive: bool, exitcode: int | None = None):
        self.alive, self.exitcode, self.terminated = alive, exitcode, False

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self) -> None:
        self.terminated, self.alive = True, False


def _rendezvous_at_a_free_port(monkeypatch) -> None:
    from compiled.parallel import group
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(group._free_port()))


def test_rank_0_waits_for_a_worker_slower_to_start_than_the_group_timeout(monkeypatch):
    """The group's timeout bounds a rank's answer, not its start: a worker that joins 2 s late
    (past a 1 s group timeout) still finds rank 0 waiting."""
    import threading
    from compiled.parallel import group
    _rendezvous_at_a_free_port(monkeypatch)
    monkeypatch.setattr(group, "START_TIMEOUT_S", 30.0)
    late = threading.Timer(2.0, group._started_store, args=(1, 2, [], "context-parallel"))
    late.start()
    t0 = time.monotonic()
    store = group._started_store(0, 2, [_Worker(alive=True)], "context-parallel")
    late.join()
    assert 2.0 <= time.monotonic() - t0 < 30.0 and store.check(["started/1"])


def test_a_worker_that_exits_before_joining_is_a_one_line_error_at_once(monkeypatch):
    """The first worker dead before joining fails the start at once, and the others are stopped."""
    from compiled.parallel import group
    _rendezvous_at_a_free_port(monkeypatch)
    t0 = time.monotonic()
    workers = [_Worker(alive=True), _Worker(alive=False, exitcode=3), _Worker(alive=True)]
    with pytest.raises(CPError, match="^tensor-parallel rank 2 exited with code 3 before joining the group$"):
        group._started_store(0, 4, workers, "tensor-parallel")
    assert time.monotonic() - t0 < 5.0   # not START_TIMEOUT_S
    assert [w.terminated for w in workers] == [True, False, True]


def test_a_worker_that_never_starts_fails_after_the_start_timeout(monkeypatch):
    from compiled.parallel import group
    _rendezvous_at_a_free_port(monkeypatch)
    monkeypatch.setattr(group, "START_TIMEOUT_S", 0.5)
    worker = _Worker(alive=True)
    with pytest.raises(CPError, match="^context-parallel group: not every rank started within 0.5 s$"):
        group._started_store(0, 2, [worker], "context-parallel")
    assert worker.terminated
