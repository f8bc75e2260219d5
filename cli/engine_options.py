"""The engine's settings as command-line options: flags and help here, defaults from `DEFAULTS`
(the engine config), so no command writes a default of its own."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Annotated, Optional

import typer

from compiled.runtime.config import DEFAULT_BATCHED_TOKENS, DEFAULTS, EngineConfig

# field -> (annotation, help, typer's declarations). Defaults come from DEFAULTS.
ENGINE_OPTIONS: dict[str, tuple[object, str, tuple[str, ...]]] = {
    "device": (Optional[str], "cpu or cuda (default: cuda when available).", ()),
    "dtype": (Optional[str], "float32, bfloat16 or float16 (default: bfloat16 on cuda, float32 on cpu).", ()),
    "load_format": (str, "auto (safetensors) or dummy (random weights in the real shapes).", ()),
    "quantization": (Optional[str], "fp8: quantize an unquantized checkpoint to block FP8 while loading (FP8 "
                     "checkpoints load as FP8 without it).", ()),
    "seed": (int, "Seed of the dummy weights and of the engine.", ()),
    "max_model_len": (Optional[int], "Context length (default: the model's).", ()),
    "max_num_seqs": (int, "Most requests in one step.", ()),
    "max_num_batched_tokens": (Optional[int], "Token budget of one step (longer prefills are chunked; default: "
                               f"{DEFAULT_BATCHED_TOKENS}, or --cp-min-tokens if larger with --cp).", ()),
    "max_mixed_step_tokens": (Optional[int], "Most tokens in a step that also decodes (default: the largest "
                              "piecewise graph); keeps inter-token latency flat.", ()),
    "kv_cache_tokens": (Optional[int], "KV cache size in tokens (default: from memory).", ()),
    "mem_fraction": (float, "Share of GPU memory for weights + KV + activations.", ()),
    "enforce_eager": (bool, "No Inductor, no CUDA graphs: the eager graph module.", ("--enforce-eager",)),
    "compile": (Optional[bool], "Lower the graph with Inductor (default: on CUDA only).", ("--compile/--no-compile",)),
    "artifact": (Optional[str], "Load compiled pieces from this `compiled export` folder.", ()),
    "recompile_on_mismatch": (bool, "Recompile instead of failing on a mismatched artifact.",
                              ("--recompile-on-mismatch",)),
    "max_lora_rank": (int, "Largest adapter rank the LoRA slots hold.", ()),
    "max_loras_per_batch": (int, "Adapters one step may use (GPU slots).", ()),
    "max_loaded_loras": (Optional[int], "Adapters kept in the CPU tier (default: no limit).", ()),
    "merge_lora": (bool, "Fold an adapter into the weights while it is the only one running (base speed; "
                   "costs a copy of the dense weights).", ("--merge-lora/--no-merge-lora",)),
    "context_parallel_size": (int, "Processes (one GPU each) a long prefill is split over; 1: off.", ("--cp",)),
    "tensor_parallel_size": (int, "Processes (one GPU each) every layer is sharded over; 1: off.", ("--tp",)),
    "enable_expert_parallel": (bool, "With --tp: each process holds 1/N of the experts whole instead of 1/N of "
                               "every expert's width.", ("--enable-expert-parallel/--no-enable-expert-parallel",)),
    "cp_min_tokens": (int, "Shortest prefill chunk that is split over the --cp processes.", ()),
    "enable_prefix_caching": (bool, "Start requests from their longest cached prefix (radix prefix cache).",
                              ("--prefix-cache/--no-prefix-cache",)),
    "overlap_schedule": (bool, "Launch each decode step before the previous one's tokens are read back.",
                         ("--overlap-schedule/--no-overlap-schedule",)),
}


def engine_option(name: str, help: str | None = None):
    """A typer.Option for the engine config field `name`, its default taken from DEFAULTS."""
    _, default_help, decls = ENGINE_OPTIONS[name]
    return typer.Option(getattr(DEFAULTS, name), *decls, help=help or default_help)


def engine_parameter(name: str, help: str | None = None) -> inspect.Parameter:
    """The same option as a keyword-only parameter (for commands whose signature is built)."""
    annotation, default_help, decls = ENGINE_OPTIONS[name]
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=getattr(DEFAULTS, name),
                             annotation=Annotated[annotation, typer.Option(*decls, help=help or default_help)])


def with_engine_options(*names: str):
    """A command decorator: `fn(engine: dict, **own)` gets the engine options `names` (declared
    here, defaults from DEFAULTS) in `engine`, and its own parameters as it declares them."""
    def wrap(fn):
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "engine"]

        def command(**kwargs):
            return fn(engine={n: kwargs.pop(n) for n in names}, **kwargs)

        command.__signature__ = inspect.Signature(own + [engine_parameter(n) for n in names])
        command.__name__, command.__doc__ = fn.__name__, fn.__doc__
        return command
    return wrap


def engine_config(values: dict, **overrides) -> EngineConfig:
    """The engine config of a command's option values (names that are not fields are ignored)."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    chosen = {k: (str(v) if k == "artifact" and v is not None else v) for k, v in values.items() if k in fields}
    return EngineConfig.from_kwargs(owner="compiled", **dict(chosen, **overrides))


def build_llm(config: EngineConfig):
    """An LLM with every setting of `config`."""
    from compiled import LLM
    return LLM(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
