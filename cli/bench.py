"""`compiled bench`: latency, throughput, serving and start-up benchmarks (rich tables, JSON).

Each subcommand takes the MODEL argument (default: the shipped demo MoE model) and the common
options (engine settings, --json, --profile, --compare hf). The measuring lives in
cli/bench_core.py (our engine) and cli/bench_hf.py (HF transformers on the same workload); this
file holds the command surface and the tables."""

from __future__ import annotations

import inspect
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cli.bench_core import LORA_DISTS
from cli.engine_options import DEFAULTS, build_llm, engine_config, engine_parameter
from cli.errors import fail_cleanly

bench_app = typer.Typer(no_args_is_help=True, add_completion=False,
                        help="Benchmarks: latency, throughput, serving, startup (JSON with --json).")

COMPARE = ("hf",)

# ---- the options every subcommand takes ------------------------------------------------------

_MODEL = inspect.Parameter(
    "model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
    annotation=Annotated[Optional[str], typer.Argument(
        help="HF model folder (a folder with only config.json works with --load-format dummy); "
             "default: the shipped demo MoE model.", show_default=False, metavar="MODEL")])


def _opt(name: str, annotation, default, help: str, *decls: str) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[annotation, typer.Option(*decls, help=help)])


COMMON = [
    *(engine_parameter(name) for name in ("device", "dtype", "load_format", "quantization", "max_model_len", "max_num_seqs",
                                          "max_num_batched_tokens", "max_mixed_step_tokens", "kv_cache_tokens",
                                          "mem_fraction", "enforce_eager", "compile", "artifact", "overlap_schedule",
                                          "context_parallel_size", "cp_min_tokens", "enable_prefix_caching",
                                          "tensor_parallel_size", "enable_expert_parallel")),
    _opt("seed", int, DEFAULTS.seed, "Seed for weights (dummy), prompts and arrival times."),
    _opt("num_loras", int, 0, "Random adapters in the model's real shapes (no files); 0: no LoRA."),
    _opt("lora_rank", int, 16, "Rank of the random adapters."),
    _opt("lora_targets", str, "all", "Projections the adapters change: all (attention, MLP, experts), attn, mlp."),
    _opt("lora_dist", str, "uniform",
         "How requests pick adapters: uniform, zipf, one (all the first) or none (loaded, unused)."),
    engine_parameter("max_loras_per_batch"),
    engine_parameter("merge_lora"),
    _opt("json_path", Optional[Path], None, "Write machine-readable results here.", "--json"),
    _opt("profile", Optional[Path], None, "Profile a few steps: Chrome trace into this folder + top-15 ops table."),
    _opt("profile_steps", int, 5, "Steps to profile with --profile."),
    _opt("compare", Optional[str], None, "Also run this baseline on the same workload: hf (HF transformers)."),
    _opt("debug", bool, False, "Show tracebacks.", "--debug"),
]


def bench_command(fn: Callable[[SimpleNamespace], None]) -> Callable[..., None]:
    """Turns `fn(o)`, whose other parameters declare its own options, into a Typer command taking
    MODEL, those options and the common ones; `o` holds every value. Errors are one line."""
    own = list(inspect.signature(fn, eval_str=True).parameters.values())[1:]

    def command(**kwargs) -> None:
        o = SimpleNamespace(**kwargs)
        with fail_cleanly(o.debug):
            _check_common(o)
            fn(o)

    command.__signature__ = inspect.Signature([_MODEL, *own, *COMMON])
    command.__name__, command.__doc__ = fn.__name__, fn.__doc__
    return command


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _at_least(o: SimpleNamespace, name: str, low: int) -> None:
    value = getattr(o, name)
    _check(value is None or value >= low, f"--{name.replace('_', '-')} must be at least {low}, got {value}")


def _check_common(o: SimpleNamespace) -> None:
    _check(o.compare is None or o.compare in COMPARE,
           f"--compare {o.compare!r} is not supported (choose from: {', '.join(COMPARE)})")
    _check(o.lora_dist in LORA_DISTS, f"--lora-dist {o.lora_dist!r}: choose from {', '.join(LORA_DISTS)}")
    _check(o.lora_targets in ("all", "attn", "mlp"), f"--lora-targets {o.lora_targets!r}: choose from all, attn, mlp")
    for name, low in (("num_loras", 0), ("lora_rank", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1),
                      ("max_model_len", 2),
                      ("kv_cache_tokens", 1), ("profile_steps", 1)):
        _at_least(o, name, low)
    _check(0 < o.mem_fraction <= 1, f"--mem-fraction must be in (0, 1], got {o.mem_fraction}")


def _engine_args(o: SimpleNamespace):
    lora = dict(enable_lora=True, max_lora_rank=o.lora_rank) if o.num_loras else {}
    return engine_config(vars(o), **lora)


def _build(command: str, o: SimpleNamespace) -> "Run":
    """The engine for `command`, with `--num-loras` random adapters added."""
    from cli import bench_core as core
    run = Run(command, o, build_llm(_engine_args(o)))
    run.loras = core.add_random_loras(run.llm, o.num_loras, o.lora_rank, o.lora_targets, o.seed)
    return run


# ---- formatting -------------------------------------------------------------------------------

def _ms(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "-"
    return f"{x:,.3f}" if x < 10 else f"{x:,.1f}"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}" if x < 1000 else f"{x:,.0f}"


def _bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _p(summary: dict | None, key: str = "p50") -> float | None:
    return summary[key] if summary else None


def speedup(ours: float | None, theirs: float | None, higher_is_better: bool) -> float | None:
    """How many times better we are than the baseline (> 1: better)."""
    if not ours or not theirs:
        return None
    return ours / theirs if higher_is_better else theirs / ours


def _row(label: str, ours, theirs, fmt: Callable, higher_is_better: bool | None) -> tuple[str, ...]:
    """(metric, ours, baseline, speedup); speedup only where it means something."""
    s = None if higher_is_better is None else speedup(ours, theirs, higher_is_better)
    return (label, fmt(ours), "" if theirs is None else fmt(theirs), "" if s is None else f"{s:.2f}x")


def _metric_table(rows: list[tuple], compare: bool) -> Table:
    table = Table()
    table.add_column("metric")
    table.add_column("compiled", justify="right")
    if compare:
        table.add_column("HF", justify="right")
        table.add_column("speedup", justify="right")
    for row in rows:
        table.add_row(*(row if compare else row[:2]))
    return table


def _profile_table(prof: dict) -> Table:
    whole = prof.get("whole_batch_steps")
    steps = f"{prof['steps']} steps" + ("" if whole is None or whole == prof["steps"] else
                                        f" ({whole} of them decoding the whole batch: raise --output-len)")
    table = Table(title=f"top {len(prof['top'])} ops by {prof['sort_by']} over {steps}",
                  title_justify="left", caption=f"Chrome trace: {prof['trace']}", caption_justify="left")
    for col in ("op / kernel", "calls", "self ms", "%"):
        table.add_column(col, justify="left" if col == "op / kernel" else "right")
    for r in prof["top"]:
        table.add_row(r["name"][:70], str(r["calls"]), f"{r['self_ms']:,.3f}", f"{r['self_pct']:.1f}")
    return table


def _critical_path_table(prof: dict) -> Table:
    """The GPU kernels by their time on the stream's critical path (profiles on CUDA only)."""
    table = Table(title="kernels on the critical path (not overlapped by the one before, idle before it included)",
                  title_justify="left")
    for col in ("kernel", "calls", "ms", "idle before ms"):
        table.add_column(col, justify="left" if col == "kernel" else "right")
    for r in prof["exposed"]:
        table.add_row(r["name"][:70], str(r["calls"]), f"{r['exposed_ms']:,.3f}", f"{r['idle_before_ms']:,.3f}")
    return table


def _progress(what: str) -> Progress:
    return Progress(TextColumn(f"[bold]{what}[/bold]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)


# ---- one benchmark run ------------------------------------------------------------------------

class Run:
    """The state a subcommand carries: the engine, what it reports, and the JSON record."""

    def __init__(self, command: str, o: SimpleNamespace, llm) -> None:
        from cli.roofline import device_name
        self.command, self.o, self.llm = command, o, llm
        self.device = llm.config.device
        self.info = {
            "model": llm.model_path, "model_name": os.path.basename(os.path.normpath(llm.model_path)),
            "architecture": llm.model_config.architecture, "device_name": device_name(self.device),
            "dtype": str(llm.config.dtype).replace("torch.", ""), "kv_slots": llm.engine.kv.num_slots,
            "compile": bool(getattr(llm.config, "use_compile", False)),
            "cuda_graphs": bool(getattr(llm.config, "use_cuda_graphs", False)),
        }
        self.results: dict = {}
        self.compare: dict | None = None
        self.profile: dict | None = None
        self.loras: list[str] = []                 # the random adapters served (--num-loras)
        self.lora_requests: dict[str, int] = {}    # requests per adapter ("base": none)
        self.console = Console(highlight=False)

    def title(self, workload: str) -> str:
        i = self.info
        mode = ("inductor + CUDA graphs" if i["compile"] and i["cuda_graphs"] else
                "inductor" if i["compile"] else "CUDA graphs" if i["cuda_graphs"] else "eager")
        return (f"compiled bench {self.command}: {i['model_name']} ({i['architecture']}) on {i['device_name']}, "
                f"{i['dtype']}, {mode}; {workload}")

    def run_profile(self, items, skip_prefill: bool) -> None:
        if self.o.profile is not None:
            from cli.bench_core import profile_steps
            self.profile = profile_steps(self.llm, items, self.o.profile_steps, self.o.profile, self.command,
                                         skip_prefill)

    def release(self) -> tuple[str, object, object]:
        """Drop our engine before the baseline loads; (model path, dtype, tokenizer)."""
        from cli.bench_core import free_memory
        llm, self.llm = self.llm, None
        kept = llm.model_path, llm.config.dtype, llm.tokenizer
        llm.shutdown()
        del llm
        free_memory(self.device)
        return kept

    def finish(self, heading: str, *tables: Table) -> None:
        self.console.print(self.title(heading), style="bold")
        for table in tables:
            self.console.print(table)
        if self.profile:
            self.console.print(_profile_table(self.profile))
            if self.profile.get("exposed"):
                self.console.print(_critical_path_table(self.profile))
        if self.o.json_path is not None:
            from cli.bench_core import environment, write_json
            options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self.o).items()}
            write_json(self.o.json_path, {
                "command": self.command, "model": self.info["model"], "model_info": self.info,
                "env": environment(self.device), "options": options, "results": self.results,
                "compare": self.compare, "profile": self.profile, "lora_requests": self.lora_requests})
            Console(stderr=True).print(f"[dim]wrote {self.o.json_path}[/dim]")


# ---- latency ----------------------------------------------------------------------------------

@bench_app.command(help="Fixed batch: time to first token, per-step decode time (p50/p90/p99), "
                        "tokens/s, and the step time against the bandwidth floor.")
@bench_command
def latency(
    o: SimpleNamespace,
    batch_size: Annotated[int, typer.Option(help="Requests in the batch.")] = 8,
    input_len: Annotated[int, typer.Option(help="Prompt tokens per request (random ids).")] = 32,
    output_len: Annotated[int, typer.Option(help="Tokens generated per request (EOS ignored).")] = 128,
    num_iters: Annotated[int, typer.Option(
        help="Measured runs of the whole batch (time to first token: their median).")] = 10,
    num_iters_warmup: Annotated[int, typer.Option(help="Untimed runs of the whole batch first.")] = 5,
    bandwidth: Annotated[Optional[float], typer.Option(
        help="Device bandwidth in GB/s for the floor (default: measured once, cached in ~/.cache/compiled).")] = None,
    structured: Annotated[Optional[str], typer.Option(
        help="json: one JSON schema on every request; adds mask and grammar compile times.")] = None,
) -> None:
    from cli import bench_core as core
    from cli import bench_structured
    from compiled.runtime.config import resolve_device
    for name, low in (("batch_size", 1), ("input_len", 1), ("output_len", 1), ("num_iters", 1), ("num_iters_warmup", 0)):
        _at_least(o, name, low)
    _check(o.batch_size <= o.max_num_seqs, f"--batch-size {o.batch_size} exceeds --max-num-seqs {o.max_num_seqs}")
    _check(o.bandwidth is None or o.bandwidth > 0, f"--bandwidth must be positive, got {o.bandwidth}")
    bench_structured.check(o.structured)
    bw = core.bandwidth(resolve_device(o.device), o.bandwidth)   # before the model takes the memory
    run = _build("latency", o)
    context = run.llm.engine.max_context
    _check(o.input_len + o.output_len <= context, f"--input-len {o.input_len} + --output-len {o.output_len} exceed "
                                                  f"the context of {context} tokens (raise --max-model-len)")
    core.check_batch_fits(run.llm.engine, o.batch_size, o.input_len, o.output_len)
    spec = bench_structured.prepare(run.llm, o.structured, o.seed)
    with _progress("latency") as bar:
        task = bar.add_task("steps", total=o.num_iters * o.output_len)
        loras = core.assign_loras(o.batch_size, run.loras, o.lora_dist, o.seed)
        res, prompts = core.latency(run.llm, o.batch_size, o.input_len, o.output_len, o.num_iters,
                                    o.num_iters_warmup, o.seed, on_step=lambda: bar.advance(task), loras=loras,
                                    structured=spec)
        run.lora_requests = _lora_counts(loras)
    res["roofline"] = core.roofline(run.llm, o.batch_size, o.input_len, o.output_len,
                                    _p(res["decode_step_ms"]), bw)
    if run.llm.context_parallel > 1:
        res["context_parallel"] = core.ttft_beside_cp1(run.llm, prompts, o.num_iters)
    run.results = res
    run.run_profile([core.Item(p, o.output_len) for p in prompts], skip_prefill=o.output_len > 1)
    hf: dict = {}
    if o.compare == "hf":
        from cli import bench_hf
        path, dtype, _ = run.release()
        hf = bench_hf.latency(path, o.load_format, run.device, dtype, o.seed, prompts, o.output_len,
                              o.num_iters, o.num_iters_warmup)
        run.compare = {"hf": hf, "speedup": {
            "ttft": speedup(_p(res["ttft_ms"]), _p(hf["ttft_ms"]), False),
            "decode_step": speedup(_p(res["decode_step_ms"]), _p(hf["decode_step_ms"]), False),
            "output_tokens_per_s": speedup(res["output_tokens_per_s"], hf["output_tokens_per_s"], True)}}
    rf, ours_d, hf_d = res["roofline"], res["decode_step_ms"], hf.get("decode_step_ms")
    rows = [_row("time to first token (ms)", _p(res["ttft_ms"]), _p(hf.get("ttft_ms")), _ms, False),
            ("prefill steps / tokens per s", f"{res['prefill_steps']} / {_rate(res['prefill_tokens_per_s'])}", "", ""),
            _row("decode step median (ms)", _p(ours_d), _p(hf_d), _ms, False),
            _row("decode step p90 (ms)", _p(ours_d, "p90"), _p(hf_d, "p90"), _ms, False),
            _row("decode step p99 (ms)", _p(ours_d, "p99"), _p(hf_d, "p99"), _ms, False),
            _row("decode tokens/s", res["decode_tokens_per_s"], hf.get("decode_tokens_per_s"), _rate, True),
            _row("output tokens/s (incl. prefill)", res["output_tokens_per_s"], hf.get("output_tokens_per_s"), _rate, True),
            ("bytes per decode step", _bytes(rf["bytes_per_step"]), "", ""),
            ("  experts per MoE layer", f"{rf['experts_per_layer']:.1f}" if rf["experts_per_layer"] else "dense", "", ""),
            (f"bandwidth ({rf['bandwidth_source']})", f"{_bytes(rf['bandwidth_bytes_per_s'])}/s", "", ""),
            (f"floor at context {rf['context']} (ms)", _ms(rf["floor_ms"]), "", ""),
            ("% of roofline (floor / median)",
             "-" if rf["fraction_of_roofline"] is None else f"{100 * rf['fraction_of_roofline']:.1f}%", "", "")]
    if "context_parallel" in res:
        cp = res["context_parallel"]
        rows.append((f"time to first token, CP={cp['context_parallel_size']} / CP=1 (ms)",
                     f"{_ms(_p(cp['ttft_ms']))} / {_ms(_p(cp['ttft_cp1_ms']))}", "", ""))
    rows.append(("decode timed", f"after all {o.batch_size} prompts had their first token"
                 + (f" ({res['decoded_while_filling']} tokens decoded before that, untimed)"
                    if res["decoded_while_filling"] else ""), "", ""))
    if res["decode_steps_not_full"]:
        rows.append(("steps below the batch (not timed)", str(res["decode_steps_not_full"]), "", ""))
    if res["retractions"]:
        rows.append(("retractions (KV full)", str(res["retractions"]), "", ""))
    if spec is not None:
        res["structured"] = bench_structured.results(run.llm.engine)
        rows += _structured_rows(o.structured, res["structured"])
    run.finish(f"batch {o.batch_size}, input {o.input_len}, output {o.output_len}", _metric_table(rows, bool(hf)))


def _structured_rows(kind: str, st: dict) -> list[tuple]:
    return [("structured outputs", f"{kind} schema on every request", "", ""),
            ("  mask fill per step p50 / p99 (ms)", f"{_ms(st['mask_ms']['p50'])} / {_ms(st['mask_ms']['p99'])}", "", ""),
            ("  grammar compile p50 / max (ms)",
             f"{_ms(st['compile_ms']['p50'])} / {_ms(st['compile_ms']['max'])} ({st['compiles']} compiled)", "", "")]


# ---- throughput and serving: a workload of many requests --------------------------------------

NumPrompts = Annotated[Optional[int], typer.Option(help="Requests (default: 100, or every line of --dataset).")]
InputLen = Annotated[int, typer.Option(help="Prompt tokens (random ids); with --input-len-max the minimum.")]
InputLenMax = Annotated[Optional[int], typer.Option(help="Draw prompt lengths uniformly from [--input-len, this].")]
OutputLen = Annotated[int, typer.Option(help="Output tokens (EOS ignored); with --output-len-max the minimum.")]
OutputLenMax = Annotated[Optional[int], typer.Option(help="Draw output lengths uniformly from [--output-len, this].")]
Dataset = Annotated[Optional[Path], typer.Option(
    help="JSONL of requests: a string, a list of token ids, or {\"prompt\" | \"prompt_token_ids\", \"output_len\"}.")]
Warmup = Annotated[bool, typer.Option(help="Run a few short requests first (untimed).")]
SharedPrefixLen = Annotated[int, typer.Option(
    help="Random prompts start with the same this many tokens (a common system prompt).")]


def _check_workload(o: SimpleNamespace) -> None:
    for name, low in (("num_prompts", 1), ("input_len", 1), ("output_len", 1), ("shared_prefix_len", 0)):
        _at_least(o, name, low)
    _check(o.input_len_max is None or o.input_len_max >= o.input_len,
           f"--input-len-max {o.input_len_max} is below --input-len {o.input_len}")
    _check(o.output_len_max is None or o.output_len_max >= o.output_len,
           f"--output-len-max {o.output_len_max} is below --output-len {o.output_len}")
    _check(o.dataset is None or o.dataset.is_file(), f"--dataset {o.dataset}: file not found")


def _lora_counts(loras: list[str | None]) -> dict[str, int]:
    """Requests per adapter ("base": none), for the JSON."""
    counts: dict[str, int] = {}
    for name in loras:
        counts[name or "base"] = counts.get(name or "base", 0) + 1
    return counts


def _workload(run: Run) -> tuple[list, str]:
    """The requests (validated, so a bad one fails before anything is timed) and a description."""
    from cli import bench_core as core
    o = run.o
    if o.dataset is not None:
        items = core.read_dataset(o.dataset, o.output_len, o.output_len_max, o.seed, o.num_prompts)
        what = f"dataset {o.dataset.name}"
    else:
        items = core.random_workload(o.num_prompts or 100, o.input_len, o.input_len_max, o.output_len,
                                     o.output_len_max, run.llm.model_config.vocab_size, o.seed,
                                     o.shared_prefix_len)
        what = (f"input {o.input_len}" + (f"-{o.input_len_max}" if o.input_len_max else "")
                + f", output {o.output_len}" + (f"-{o.output_len_max}" if o.output_len_max else ""))
    loras = core.assign_loras(len(items), run.loras, o.lora_dist, o.seed)
    for item, lora in zip(items, loras):
        item.lora = lora
    run.lora_requests = _lora_counts(loras)
    core.make_requests(run.llm.engine, items)
    if o.warmup:
        core.warm_up(run.llm, items)
    return items, f"{len(items)} requests, {what}"


def _kv_cell(res: dict) -> str:
    return f"{res['peak_kv_slots']:,} / {res['kv_slots']:,} slots ({100 * res['peak_kv_fraction']:.1f}%)"


def _count(x) -> str:
    return "-" if x is None else f"{x:,}"


def _seconds(x) -> str:
    return "-" if x is None else f"{x:.3f}" if x < 10 else f"{x:,.2f}"


@bench_app.command(help="N requests at once: requests/s, output and total tokens/s, peak KV usage.")
@bench_command
def throughput(
    o: SimpleNamespace,
    num_prompts: NumPrompts = None,
    input_len: InputLen = 128,
    input_len_max: InputLenMax = None,
    output_len: OutputLen = 128,
    output_len_max: OutputLenMax = None,
    dataset: Dataset = None,
    warmup: Warmup = True,
    shared_prefix_len: SharedPrefixLen = 0,
) -> None:
    from cli import bench_core as core
    _check_workload(o)
    run = _build("throughput", o)
    items, workload = _workload(run)
    with _progress("throughput") as bar:
        task = bar.add_task("requests", total=len(items))
        res = run.results = core.throughput(run.llm, items, on_finish=lambda n: bar.advance(task, n))
    run.run_profile(items[:o.max_num_seqs], skip_prefill=False)
    hf: dict = {}
    if o.compare == "hf":
        from cli import bench_hf
        path, dtype, tokenizer = run.release()
        hf = bench_hf.throughput(path, o.load_format, run.device, dtype, o.seed, items, o.max_num_seqs, tokenizer)
        run.compare = {"hf": hf, "speedup": {k: speedup(res[k], hf[k], True)
                                             for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")}}
    rows = [_row("requests", res["num_requests"], hf.get("num_requests"), _count, None),
            _row("input tokens", res["input_tokens"], hf.get("input_tokens"), _count, None),
            _row("output tokens", res["output_tokens"], hf.get("output_tokens"), _count, None),
            _row("elapsed (s)", res["elapsed_s"], hf.get("elapsed_s"), _seconds, False),
            _row("requests/s", res["requests_per_s"], hf.get("requests_per_s"), _rate, True),
            _row("output tokens/s", res["output_tokens_per_s"], hf.get("output_tokens_per_s"), _rate, True),
            _row("total tokens/s", res["total_tokens_per_s"], hf.get("total_tokens_per_s"), _rate, True),
            ("engine steps", f"{res['steps']:,}", "", ""),
            ("peak KV", _kv_cell(res), "", "")]
    if res["retractions"]:
        rows.append(("retractions (KV full)", str(res["retractions"]), "", ""))
    run.finish(workload, _metric_table(rows, bool(hf)))


@bench_app.command(help="Poisson arrivals fed to the engine step by step: TTFT, TPOT, ITL and "
                        "end-to-end latency percentiles, request throughput.")
@bench_command
def serving(
    o: SimpleNamespace,
    request_rate: Annotated[float, typer.Option(help="Requests per second (Poisson); inf = all at once.")] = math.inf,
    max_concurrency: Annotated[Optional[int], typer.Option(help="At most this many requests in flight.")] = None,
    num_prompts: NumPrompts = None,
    input_len: InputLen = 128,
    input_len_max: InputLenMax = None,
    output_len: OutputLen = 128,
    output_len_max: OutputLenMax = None,
    dataset: Dataset = None,
    warmup: Warmup = True,
    shared_prefix_len: SharedPrefixLen = 0,
    url: Annotated[Optional[str], typer.Option(
        help="Send the workload to this OpenAI-compatible server (ours or another engine) instead of an "
             "engine in this process; MODEL then only gives the vocabulary of the random prompts.")] = None,
    client_processes: Annotated[int, typer.Option(
        help="With --url: client processes sharing the requests (round-robin) and one concurrency limit, "
             "so that one process reading many streams does not delay the sends.")] = 1,
    api_key: Annotated[Optional[str], typer.Option(
        help="With --url: sent as `Authorization: Bearer KEY` (a server started with --api-key).")] = None,
    structured: Annotated[Optional[str], typer.Option(
        help="json: one JSON schema on every request (in-process or over --url); adds mask and grammar "
             "compile times.")] = None,
) -> None:
    from cli import bench_core as core
    from cli import bench_structured
    _check(o.compare is None, "--compare hf is available for latency, throughput and startup, not serving")
    _check(o.request_rate > 0, f"--request-rate must be positive (or inf), got {o.request_rate}")
    _at_least(o, "max_concurrency", 1)
    _at_least(o, "client_processes", 1)
    _check(o.client_processes == 1 or o.url is not None, "--client-processes needs --url (an engine in this "
           "process has no HTTP clients)")
    _check(o.api_key is None or o.url is not None, "--api-key needs --url (it is what a server asks of its clients)")
    bench_structured.check(o.structured)
    _check_workload(o)
    if o.url is not None:
        return _serving_http(o)
    run = _build("serving", o)
    items, workload = _workload(run)
    _with_structured(items, bench_structured.prepare(run.llm, o.structured, o.seed))
    from compiled.compilation.triton_cache import counting_compiles
    on_gpu = run.llm.config.device.type == "cuda"
    with _progress("serving") as bar, counting_compiles(on_gpu) as kernels:
        task = bar.add_task("requests", total=len(items))
        res = run.results = core.serving(run.llm, items, o.request_rate, o.max_concurrency, o.seed,
                                         on_finish=lambda n: bar.advance(task, n))
    if kernels is not None:   # a kernel compiled while serving held up every running request
        res["triton_kernels"] = dict(kernels)
    if o.structured is not None:   # what the constraint cost: grammar compiles, each step's masks
        res["structured"] = bench_structured.results(run.llm.engine)
    run.run_profile(items[:o.max_num_seqs], skip_prefill=False)
    rate = "inf" if math.isinf(o.request_rate) else f"{o.request_rate:g}/s"
    run.finish(f"{workload} at {rate}", *_serving_table(res, rate, _kv_cell(res), o.structured))


def _with_structured(items: list, spec: dict | None) -> None:
    """Every request under `--structured`'s constraint (after the warm-up, which runs without)."""
    for item in items:
        item.structured = spec


def _serving_table(res: dict, rate: str, kv: str | None, structured: str | None = None) -> tuple[Table, Table]:
    rows = [("request rate / max concurrency", f"{rate} / {res['max_concurrency'] or '-'}"),
            ("input / output tokens", f"{res['input_tokens']:,} / {res['output_tokens']:,}"),
            ("duration (s)", f"{res['duration_s']:.2f}"),
            ("requests/s", _rate(res["requests_per_s"])), ("output tokens/s", _rate(res["output_tokens_per_s"])),
            ("total tokens/s", _rate(res["total_tokens_per_s"]))] + ([("peak KV", kv)] if kv else [])
    if "triton_kernels" in res:
        kernels = res["triton_kernels"]
        rows.append(("Triton kernels compiled / loaded while serving", f"{kernels['compiled']} / {kernels['cached']}"))
    if "structured" in res:
        rows += [row[:2] for row in _structured_rows(structured, res["structured"])]
    percentiles = Table(title="latency percentiles (ms)", title_justify="left")
    for col in ("metric", "mean", "p50", "p90", "p99"):
        percentiles.add_column(col, justify="left" if col == "metric" else "right")
    for label, key in (("time to first token", "ttft_ms"), ("time per output token", "tpot_ms"),
                       ("inter-token latency", "itl_ms"), ("end-to-end", "e2e_ms")):
        percentiles.add_row(label, *(_ms(_p(res[key], k)) for k in ("mean", "p50", "p90", "p99")))
    return _metric_table(rows, False), percentiles


def _serving_http(o: SimpleNamespace) -> None:
    """The serving workload sent to `--url` (no engine here): random prompts over MODEL's vocabulary."""
    from cli import bench_core as core
    from cli.bench_http import served_adapters, serving_http
    from cli.bench_structured import SCHEMA
    from compiled.graphs.config import ModelConfig
    from compiled.runtime.settings import default_model
    if o.dataset is not None:
        items = core.read_dataset(o.dataset, o.output_len, o.output_len_max, o.seed, o.num_prompts)
    else:
        vocab = ModelConfig.from_pretrained(o.model or default_model()).vocab_size
        items = core.random_workload(o.num_prompts or 100, o.input_len, o.input_len_max, o.output_len,
                                     o.output_len_max, vocab, o.seed, o.shared_prefix_len)
    adapters = served_adapters(o.url, o.api_key)[:o.num_loras]
    _check(len(adapters) == o.num_loras, f"--num-loras {o.num_loras}: the server serves {len(adapters)} adapters")
    for item, lora in zip(items, core.assign_loras(len(items), adapters, o.lora_dist, o.seed)):
        item.lora = lora
    _with_structured(items, {"json": SCHEMA} if o.structured else None)
    with _progress("serving") as bar:
        task = bar.add_task("requests", total=len(items))
        res = serving_http(o.url, items, o.request_rate, o.max_concurrency, o.seed,
                           on_finish=lambda n: bar.advance(task, n), processes=o.client_processes,
                           api_key=o.api_key, warmup=o.warmup)
    rate = "inf" if math.isinf(o.request_rate) else f"{o.request_rate:g}/s"
    console = Console()
    console.print(f"compiled bench serving: {res['model']} at {res['url']}; {len(items)} requests at {rate}",
                  style="bold")
    for table in _serving_table(res, rate, None):
        console.print(table)
    if o.json_path is not None:
        from cli.bench_core import write_json
        write_json(o.json_path, {"command": "serving", "url": o.url, "results": res})
        console.print(f"wrote {o.json_path}")


# ---- startup ----------------------------------------------------------------------------------

@bench_app.command(help="Start-up breakdown: tokenizer, every stage the engine reports (trace, passes, "
                        "load, ...), then the first token of one request.")
@bench_command
def startup(
    o: SimpleNamespace,
    input_len: Annotated[int, typer.Option(help="Prompt tokens of the first request (random ids).")] = 32,
    fresh_caches: Annotated[bool, typer.Option(
        "--fresh-caches", help="Start with empty Triton and Inductor caches, as a fresh machine does.")] = False,
) -> None:
    from cli import bench_core as core
    _at_least(o, "input_len", 1)
    if o.fresh_caches:
        import tempfile
        import compiled.envs as envs
        for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
            envs.set_for_children(name, tempfile.mkdtemp(prefix=f"compiled-{name.lower()}-"))
    llm, res = core.startup(_engine_args(o), o.input_len)
    res["fresh_caches"] = o.fresh_caches
    run = Run("startup", o, llm)
    del llm
    run.results = res
    prompt = core.random_ids(1, o.input_len, run.llm.model_config.vocab_size, o.seed)[0]
    run.run_profile([core.Item(prompt, o.profile_steps)], skip_prefill=False)
    hf: dict = {}
    if o.compare == "hf":
        from cli import bench_hf
        path, dtype, _ = run.release()
        hf = bench_hf.startup(path, o.load_format, run.device, dtype, o.seed, prompt)
        run.compare = {"hf": hf, "speedup": {k: speedup(res[k], hf[k], False)
                                             for k in ("llm_init_s", "ttft_cold_s", "ttft_warm_s", "total_s")}}
    table = Table()
    for col in ("stage", "seconds", "%") + (("HF (s)", "speedup") if hf else ()):
        table.add_column(col, justify="left" if col == "stage" else "right")
    total = res["total_s"]

    def add(label: str, key: str | None, seconds: float, style: str | None = None) -> None:
        cells = [label, f"{seconds:.3f}", f"{100 * seconds / total:.1f}" if total else "-"]
        if hf:
            theirs = hf.get(key) if key else None
            s = speedup(seconds, theirs, False)
            cells += ["" if theirs is None else f"{theirs:.3f}", "" if s is None else f"{s:.2f}x"]
        table.add_row(*cells, style=style)

    for stage, seconds in res["stages_s"].items():
        add(f"  {stage}", None, seconds)
    add("LLM(...)", "llm_init_s", res["llm_init_s"], "bold")
    add("first token (cold)", "ttft_cold_s", res["ttft_cold_s"])
    add("start to first token", "total_s", total, "bold")
    add("first token (warm, not in total)", "ttft_warm_s", res["ttft_warm_s"], "dim")
    caption = f"first request of {o.input_len} tokens"
    if res.get("triton_kernels"):
        kernels = res["triton_kernels"]
        caption += f"; Triton kernels in LLM(...): {kernels['compiled']} compiled, {kernels['cached']} from cache"
    if res.get("decode_buckets"):
        buckets = res["decode_buckets"]
        caption += f"; decode graphs captured: {buckets['captured']} of {buckets['total']} buckets (the rest on first use)"
    run.finish(caption, table)
