"""`compiled serve`: the OpenAI-compatible HTTP server (`compiled/server/`) on uvicorn."""

from __future__ import annotations

import functools
import os
from typing import Optional

import typer

from cli.engine_options import build_llm, engine_config, with_engine_options
from cli.errors import fail_cleanly
from cli.run import lora_modules


@with_engine_options("device", "dtype", "load_format", "quantization", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                    "max_mixed_step_tokens", "kv_cache_tokens", "enforce_eager", "artifact", "max_lora_rank",
                    "max_loras_per_batch", "max_loaded_loras", "merge_lora", "context_parallel_size",
                    "tensor_parallel_size", "enable_expert_parallel")
def serve(
    engine: dict,
    model: Optional[str] = typer.Argument(None, help="HF model folder; default: the demo MoE model."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    served_model_name: Optional[str] = typer.Option(None, help="The base model's id in the API (default: its "
                                                    "folder name)."),
    max_queued_requests: Optional[int] = typer.Option(None, help="Requests that may wait; more answer 503 "
                                                      "(default: no limit)."),
    lora: list[str] = typer.Option([], "--lora", help="NAME=PATH of a PEFT adapter, served as model NAME "
                                   "(repeatable; the demo model's adapters by name alone)."),
    enable_lora: bool = typer.Option(False, "--enable-lora", help="Serve adapters loaded later over HTTP."),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Recompute every prompt instead of "
                                         "starting from the longest cached prefix."),
    api_key: Optional[str] = typer.Option(None, help="Answer only /v1 requests carrying `Authorization: Bearer "
                                          "KEY` (default: COMPILED_API_KEY; unset: no key)."),
    tool_call_parser: str = typer.Option("hermes", help="How tool calls are read from a chat's output when the "
                                         "request gives tools: hermes (Qwen3's <tool_call> blocks; also named "
                                         "qwen3)."),
    reasoning_parser: Optional[str] = typer.Option(None, help="qwen3: a chat output's <think>...</think> becomes "
                                                   "the message's reasoning_content, and a request's grammar "
                                                   "applies after it (default: none)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    with fail_cleanly(debug):
        import compiled.envs as envs
        from compiled.server.app import Server, create_app
        from compiled.server.chat_output import ChatOptions
        from compiled.server.engine_process import EngineClient
        from compiled.server.listen import listen
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests {max_queued_requests}: expected an int >= 1")
        chat = ChatOptions(tool_call_parser, reasoning_parser)   # checked before the engine starts
        modules = lora_modules(lora, model) or None
        config = engine_config(dict(engine, model=model, lora_modules=modules,
                                    enable_lora=True if enable_lora or modules else None,
                                    enable_prefix_caching=not no_prefix_cache))
        key = api_key or envs.read("COMPILED_API_KEY")
        engine = EngineClient(functools.partial(build_llm, config))
        info = engine.start()
        try:
            name = served_model_name or os.path.basename(os.path.normpath(info.model_path))
            listen(create_app(Server(engine, info, name, max_queued_requests, chat), key), host, port)
        finally:
            engine.stop()
