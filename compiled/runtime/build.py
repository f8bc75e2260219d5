"""The start-up pipeline: config -> trace -> passes -> materialise -> load weights.

Returns the module the runner calls (`module(input_ids, positions) -> hidden`, `module.lm_head`)
and how long each stage took."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from compiled.errors import CheckpointError
from compiled.graphs.config import ModelConfig
from compiled.graphs.trace import materialize, meta_model, trace
from compiled.passes.base import PassRecord
from compiled.passes.manager import run_passes
from compiled.runtime.loader import LOAD_FORMATS, fill_dummy, load_checkpoint


@dataclass
class BuildReport:
    seconds: dict[str, float] = field(default_factory=dict)   # stage -> seconds
    records: list[PassRecord] = field(default_factory=list)


def build_model(cfg: ModelConfig, path: str, device: torch.device, dtype: torch.dtype,
                load_format: str = "auto", passes: list[str] | tuple[str, ...] | None = None,
                use_graph: bool = True, seed: int = 0) -> tuple[nn.Module, BuildReport]:
    """`use_graph=False` keeps the plain eager module (no trace, no passes)."""
    if load_format not in LOAD_FORMATS:
        raise CheckpointError(f"unknown load_format {load_format!r} (expected one of {', '.join(LOAD_FORMATS)})")
    report = BuildReport()
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        report.seconds[stage] = now - clock
        clock = now

    module: nn.Module = meta_model(cfg, dtype)
    weights = module.checkpoint_map()
    if use_graph:
        module = trace(module)
        lap("trace")
        result = run_passes(module, weights, passes, check_each=False)
        weights, report.records = result.weights, result.records
        lap("passes")
    materialize(module, device)
    if load_format == "dummy":
        fill_dummy(module, seed)
    else:
        load_checkpoint(module, weights, path, tied_head=cfg.tie_word_embeddings)
    lap("load")
    return module, report
