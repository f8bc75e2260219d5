"""`compiled run`: offline generation from the command line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from cli.engine_options import build_llm, engine_config, engine_option
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


def run(
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
    max_lora_rank: int = engine_option("max_lora_rank"),
    max_loras_per_batch: int = engine_option("max_loras_per_batch"),
    max_loaded_loras: Optional[int] = engine_option("max_loaded_loras"),
    merge_lora: bool = engine_option("merge_lora"),
    device: Optional[str] = engine_option("device"),
    dtype: Optional[str] = engine_option("dtype"),
    load_format: str = engine_option("load_format"),
    max_model_len: Optional[int] = engine_option("max_model_len"),
    enforce_eager: bool = engine_option("enforce_eager"),
    overlap_schedule: bool = engine_option("overlap_schedule"),
    artifact: Optional[str] = engine_option("artifact"),
    recompile_on_mismatch: bool = engine_option("recompile_on_mismatch"),
    context_parallel_size: int = engine_option("context_parallel_size"),
    cp_min_tokens: int = engine_option("cp_min_tokens"),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per output line."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    with fail_cleanly(debug):

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
        params = SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, seed=seed, stop=stop or None, ignore_eos=ignore_eos,
            logprobs=logprobs)
        start = time.perf_counter()
        config = engine_config(dict(model=model, device=device, dtype=dtype, load_format=load_format,
                                    max_model_len=max_model_len, enforce_eager=enforce_eager,
                                    overlap_schedule=overlap_schedule, artifact=artifact,
                                    recompile_on_mismatch=recompile_on_mismatch, max_lora_rank=max_lora_rank,
                                    max_loras_per_batch=max_loras_per_batch, max_loaded_loras=max_loaded_loras,
                                    merge_lora=merge_lora, lora_modules=lora_modules(lora, model) or None,
                                    context_parallel_size=context_parallel_size, cp_min_tokens=cp_min_tokens))
        llm = build_llm(config)
        loaded = time.perf_counter()
        outs = llm.chat(prompts, params, adapters) if chat else llm.generate(prompts, params, adapters)
        done = time.perf_counter()
        for p, out in zip(prompts, outs):
            if as_json:
                record = {"prompt": p, "text": out.text, "token_ids": out.token_ids,
                          "finish_reason": out.finish_reason}
                if out.logprobs is not None:
                    record["logprobs"] = [{str(k): v for k, v in d.items()} for d in out.logprobs]
                sys.stdout.write(json.dumps(record) + "\n")
            else:
                _print_output(p, out)
        llm.shutdown()
        if not as_json:
            n = sum(len(o.token_ids) for o in outs)
            err.print(f"[dim]{llm.model_path} on {llm.config.device} ({str(llm.config.dtype).replace('torch.', '')}):"
                      f" load {loaded - start:.1f}s{_compiled_note(llm)}, {n} tokens in {done - loaded:.2f}s[/dim]",
                      soft_wrap=True)


def _compiled_note(llm) -> str:
    """How many compiled pieces this start compiled itself (none when an artifact held them)."""
    report = llm.build_report
    if not report.unique_pieces:
        return ""
    return f" ({report.unique_pieces} compiled pieces, {report.compiled_now} compiled now)"


def _print_output(prompt, out) -> None:
    from rich.markup import escape
    console = Console()
    shown = prompt if isinstance(prompt, str) else str(prompt)
    console.print(f"[bold cyan]{escape(shown)}[/bold cyan][green]{escape(out.text)}[/green]"
                  f"  [dim]({len(out.token_ids)} tokens, {out.finish_reason})[/dim]")
