"""`compiled run`: offline generation from the command line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from cli.engine_options import build_llm, engine_config, with_engine_options
from cli.errors import fail_cleanly
from compiled.runtime.sampling_params import SamplingParams

# `compiled run` generates greedily, 64 tokens a prompt, unless told otherwise; the other
# sampling defaults are SamplingParams' own.
SAMPLING = SamplingParams(max_new_tokens=64, temperature=0.0)
from cli.prompts import read_jsonl_prompts

err = Console(stderr=True)


def read_prompts_file(path: Path) -> list[tuple[str | list[int], dict]]:
    """(prompt, the line's fields) per line."""
    prompts = [(prompt, fields) for _, prompt, fields in read_jsonl_prompts(path)]
    if not prompts:
        # An empty file is a mistake (a wrong path, a failed export), not a request for the demo prompts.
        raise ValueError(f"{path}: no prompts in the file (expected one JSON string, list of token ids, "
                         "or object with 'prompt' or 'prompt_token_ids' per line)")
    return prompts


def lora_modules(specs: list[str], model: str | None) -> dict[str, str]:
    """`--lora` values as name -> folder: NAME=PATH, or a demo adapter's NAME with the demo model."""
    from compiled.demo import MOE_ADAPTERS
    modules = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            if model is not None or name not in MOE_ADAPTERS:
                raise ValueError(f"--lora {spec!r}: expected NAME=PATH (a name alone only for the demo model's "
                                 f"adapters: {', '.join(MOE_ADAPTERS)})")
            path = MOE_ADAPTERS[name]
        if not name or not path:
            raise ValueError(f"--lora {spec!r}: expected NAME=PATH")
        modules[name] = path
    return modules


@with_engine_options("max_lora_rank", "max_loras_per_batch", "max_loaded_loras", "merge_lora", "device", "dtype",
                     "load_format", "quantization", "max_model_len", "enforce_eager", "overlap_schedule", "artifact",
                     "recompile_on_mismatch", "context_parallel_size", "cp_min_tokens", "tensor_parallel_size",
                     "enable_expert_parallel")
def run(
    engine: dict,
    model: Optional[str] = typer.Argument(None, help="HF model folder; default: the shipped demo MoE model."),
    prompt: list[str] = typer.Option([], "--prompt", "-p", help="A prompt (repeatable)."),
    prompts_file: Optional[Path] = typer.Option(None, help="JSONL file of prompts."),
    max_new_tokens: int = typer.Option(SAMPLING.max_new_tokens, help="Tokens to generate per prompt."),
    temperature: float = typer.Option(SAMPLING.temperature, help="0 = greedy."),
    top_k: int = typer.Option(SAMPLING.top_k),
    top_p: float = typer.Option(SAMPLING.top_p),
    min_p: float = typer.Option(SAMPLING.min_p),
    repetition_penalty: float = typer.Option(SAMPLING.repetition_penalty),
    presence_penalty: float = typer.Option(SAMPLING.presence_penalty),
    frequency_penalty: float = typer.Option(SAMPLING.frequency_penalty),
    seed: Optional[int] = typer.Option(SAMPLING.seed, help="Per-request sampling seed."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    ignore_eos: bool = typer.Option(SAMPLING.ignore_eos),
    logprobs: Optional[int] = typer.Option(SAMPLING.logprobs,
                                           help="Return this many top logprobs per token (JSON output)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt in the model's chat template."),
    lora: list[str] = typer.Option([], "--lora", help="Load adapter NAME=PATH (a PEFT folder; repeatable); with "
                                   "the demo model, a shipped adapter by NAME alone (upper, first)."),
    adapter: Optional[str] = typer.Option(None, "--adapter", help="The adapter the --prompt prompts run with "
                                          "(a prompts-file line names its own with \"lora\")."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per output line."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    with fail_cleanly(debug):
        prompts, adapters = _prompts(model, prompt, prompts_file, adapter)
        params = SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, seed=seed, stop=stop or None, ignore_eos=ignore_eos,
            logprobs=logprobs)
        start = time.perf_counter()
        llm = build_llm(engine_config(dict(engine, model=model, lora_modules=lora_modules(lora, model) or None)))
        loaded = time.perf_counter()
        outs = llm.chat(prompts, params, adapters) if chat else llm.generate(prompts, params, adapters)
        done = time.perf_counter()
        for p, out in zip(prompts, outs):
            sys.stdout.write(_json_line(p, out) if as_json else _text_line(p, out))
        sys.stdout.flush()
        llm.shutdown()
        if not as_json:
            n = sum(len(o.token_ids) for o in outs)
            err.print(f"[dim]{llm.model_path} on {llm.config.device} ({str(llm.config.dtype).replace('torch.', '')}):"
                      f" load {loaded - start:.1f}s{_compiled_note(llm)}, {n} tokens in {done - loaded:.2f}s[/dim]",
                      soft_wrap=True)


def _prompts(model: str | None, prompt: list[str], prompts_file: Path | None, adapter: str | None
             ) -> tuple[list[str | list[int]], list[str | None]]:
    """The prompts to run and each one's adapter: --prompt's, then the file's; the demo model's
    example prompts when there are none."""
    prompts: list[str | list[int]] = list(prompt)
    adapters: list[str | None] = [adapter] * len(prompts)
    if prompts_file is not None:
        for text, fields in read_prompts_file(prompts_file):
            prompts.append(text)
            adapters.append(fields.get("lora"))
    if not prompts:
        if model is not None:
            raise ValueError("no prompts: pass --prompt TEXT or --prompts-file FILE.jsonl")
        from compiled.demo import EXAMPLE_PROMPTS
        prompts = list(EXAMPLE_PROMPTS[:4])
        adapters = [adapter] * len(prompts)
    return prompts, adapters


def _json_line(prompt, out) -> str:
    record = {"prompt": prompt, "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}
    if out.logprobs is not None:
        record["logprobs"] = [{str(k): v for k, v in d.items()} for d in out.logprobs]
    return json.dumps(record) + "\n"


def _compiled_note(llm) -> str:
    """How many compiled pieces this start compiled itself (none when an artifact held them)."""
    report = llm.build_report
    if not report.unique_pieces:
        return ""
    return f" ({report.unique_pieces} compiled pieces, {report.compiled_now} compiled now)"


def _text_line(prompt, out) -> str:
    """One line per prompt: the prompt, its generation (line breaks shown as \\n, so that a
    generation cannot split its line) and its token count. Colour only on a terminal; the line is
    never wrapped at the console's width (piped, it is data)."""
    shown = (prompt if isinstance(prompt, str) else str(prompt)).replace("\n", "\\n")
    text = out.text.replace("\n", "\\n")
    tail = f"  ({len(out.token_ids)} tokens, {out.finish_reason})"
    if not sys.stdout.isatty():
        return f"{shown}{text}{tail}\n"
    from rich.markup import escape
    console = Console(soft_wrap=True)
    with console.capture() as capture:
        console.print(f"[bold cyan]{escape(shown)}[/bold cyan][green]{escape(text)}[/green][dim]{tail}[/dim]")
    return capture.get()
