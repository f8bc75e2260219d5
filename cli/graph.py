"""`compiled graph`: trace a model, run the passes, and show what each pass changed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from cli.engine_options import DEFAULTS, ENGINE_OPTIONS
from cli.errors import fail_cleanly


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n else "0"


def graph(
    model: Optional[str] = typer.Argument(None, help="HF model folder (only config.json is read); default: the demo MoE model."),
    passes: Optional[str] = typer.Option(None, help="Comma-separated pass list, 'none' for none; default: all."),
    dump: Optional[Path] = typer.Option(None, help="Write the graph's Python code before and after each pass here."),
    dtype: str = typer.Option("bfloat16", help="Parameter dtype, for the byte counts."),
    quantization: Optional[str] = typer.Option(None, "--quantization",
                                               help=ENGINE_OPTIONS["quantization"][1] + " The graph then ends "
                                               "with the fp8_weights pass and its scale operands."),
    lora: Optional[str] = typer.Option(None, "--lora", help="A PEFT adapter folder: run the graph with the "
                                       "lora_delta pass and show what the adapter targets."),
    cp: int = typer.Option(1, "--cp", help="Context-parallel processes: above 1, run the graph with the "
                           "cp_allgather pass and show the gathers it inserts."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel processes: above 1, run the graph of rank 0 with the "
                           "tp_shard pass and show its shards and all-reduces."),
    expert_parallel: bool = typer.Option(DEFAULTS.enable_expert_parallel,
                                         "--enable-expert-parallel/--no-enable-expert-parallel",
                                         help="With --tp: each rank holds 1/N of the experts whole."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    with fail_cleanly(debug):
        from compiled.graphs.config import ModelConfig
        from compiled.graphs.trace import meta_model, trace
        from compiled.passes.manager import passes_for, run_passes
        from compiled.passes.variant import GraphVariant
        from compiled.quant.at_load import with_quantization
        from compiled.runtime.config import resolve_dtype
        from compiled.runtime.settings import default_model

        path = model or default_model()
        cfg, _ = with_quantization(ModelConfig.from_pretrained(path), quantization)
        names = None if passes is None else ([] if passes == "none" else [p.strip() for p in passes.split(",") if p.strip()])
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
        steps: list[str] = []

        def on_pass(name: str, gm) -> None:
            if dump is not None:
                steps.append(name)
                (dump / f"{len(steps) - 1:02d}_{name}.py").write_text(gm.code)

        meta = meta_model(cfg, resolve_dtype(dtype, None))
        gm = trace(meta)
        if lora is not None:
            from compiled.lora.adapter import load_adapter
            adapter = load_adapter(os.path.basename(os.path.normpath(lora)), lora, cfg, DEFAULTS.max_lora_rank)
        if cp < 1:
            raise ValueError(f"--cp {cp}: expected an int >= 1")
        if tp < 1:
            raise ValueError(f"--tp {tp}: expected an int >= 1")
        variant = GraphVariant(lora=lora is not None, context_parallel=cp > 1, tp_size=tp,
                               expert_parallel=expert_parallel)
        names = passes_for(variant, names, DEFAULTS.max_loras_per_batch, DEFAULTS.max_lora_rank,
                           quantized=cfg.quantization is not None)
        result = run_passes(gm, meta.checkpoint_map(), names, on_pass=on_pass)
        console = Console()
        table = Table(title=f"passes over {os.path.basename(os.path.normpath(path))} "
                            f"({cfg.architecture}, {cfg.num_hidden_layers} layers)")
        for col in ("pass", "nodes", "rewrites", "params +/-", "bytes +/-", "ms"):
            table.add_column(col, justify="left" if col == "pass" else "right")
        for r in result.records:
            table.add_row(r.name, f"{r.nodes_before} -> {r.nodes_after}", str(r.rewrites),
                          f"+{len(r.params_created)} / -{len(r.params_removed)}",
                          f"+{_mb(r.bytes_created)} / -{_mb(r.bytes_removed)}", f"{1e3 * r.seconds:.0f}")
        console.print(table)
        if lora is not None:
            console.print(f"  [dim]{adapter!r}[/dim]", highlight=False)
        _show_parallel(console, gm, cfg, cp, tp, expert_parallel)
        pieces = result.weights.pieces
        fused = [t for t in pieces if len(pieces[t]) > 1 or any(p.narrow is not None for p in pieces[t])]
        layer0 = [t for t in fused if ".layers.0." in t] or fused[:3]
        layer0 += [t for t in ("model.embed_tokens.weight", "lm_head.weight") if tp > 1 and t in fused]
        if tp > 1 and expert_parallel:   # rank 0's experts
            layer0 += [t for t in fused if t.endswith(".mlp.w13")][:1]
        for target in layer0:
            console.print(f"  [dim]{result.weights.describe(target)}[/dim]", highlight=False)
        if dump is not None:
            (dump / "weights.txt").write_text("\n".join(result.weights.describe(t) for t in result.weights.pieces) + "\n")
            console.print(f"wrote {len(steps)} graphs and weights.txt to {dump}")


def _show_parallel(console: Console, gm, cfg, cp: int, tp: int, expert_parallel: bool) -> None:
    """The collectives a context- or tensor-parallel graph holds, and what a rank keeps."""
    if cp > 1:
        gathers = [n for n in gm.graph.nodes if n.op == "call_function" and "cp_allgather" in str(n.target)]
        shown = ", ".join(f"{n.name}({n.args[0].name})" for n in gathers[:3])
        console.print(f"  [dim]{len(gathers)} compiled::cp_allgather nodes over {cp} processes: {shown}, ..., "
                      f"{gathers[-1].name}({gathers[-1].args[0].name}) -> output[/dim]", highlight=False)
    if tp > 1:
        reduces = [n for n in gm.graph.nodes if n.op == "call_function" and "all_reduce" in str(n.target)]
        console.print(f"  [dim]{len(reduces)} compiled::all_reduce nodes over {tp} processes (rank 0's graph; "
                      "weights: its slices)[/dim]", highlight=False)
        head = gm.lm_head
        console.print(f"  [dim]vocab-parallel embedding and LM head: {head.weight.shape[0]} of "
                      f"{head.out_features} vocabulary rows a rank (padded), logits gathered by "
                      f"compiled::all_gather[/dim]", highlight=False)
        if expert_parallel and cfg.num_experts:
            local = cfg.num_experts // tp
            console.print(f"  [dim]expert-parallel: {local} of {cfg.num_experts} experts a rank, routed by "
                          f"compiled::topk_route(local_experts={local})[/dim]", highlight=False)
