"""The start-up pipeline: config -> trace -> passes -> materialise -> load weights -> compile.

Returns the module the runner calls (`module(input_ids, positions) -> hidden`, `module.lm_head`)
and how long each stage took."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from compiled.errors import CheckpointError
from compiled.graphs.config import ModelConfig
from compiled.graphs.trace import materialize, meta_model, trace
from compiled.passes.base import PassRecord
from compiled.passes.manager import DEFAULT_PASSES, run_passes
from compiled.runtime.loader import LOAD_FORMATS, fill_dummy, load_checkpoint

log = logging.getLogger(__name__)


@dataclass
class BuildOptions:
    load_format: str = "auto"
    passes: list[str] | tuple[str, ...] | None = None   # None: DEFAULT_PASSES
    use_graph: bool = True          # False: the plain eager module (no trace, no passes, no compile)
    compile: bool = False           # lower the pieces with Inductor
    artifact: str | None = None     # load compiled pieces from this folder instead of compiling
    recompile_on_mismatch: bool = False  # a mismatched artifact is logged and recompiled, not an error
    seed: int = 0

    @property
    def pass_names(self) -> list[str]:
        return list(DEFAULT_PASSES if self.passes is None else self.passes)


@dataclass
class BuildReport:
    seconds: dict[str, float] = field(default_factory=dict)   # stage -> seconds
    records: list[PassRecord] = field(default_factory=list)
    compiled: dict = field(default_factory=dict)              # piece key -> compiled artifact
    pieces: int = 0
    unique_pieces: int = 0
    compiled_now: int = 0                                      # pieces Inductor compiled in this start


def build_model(cfg: ModelConfig, path: str, device: torch.device, dtype: torch.dtype,
                opts: BuildOptions | None = None) -> tuple[nn.Module, BuildReport]:
    opts = opts or BuildOptions()
    if opts.load_format not in LOAD_FORMATS:
        raise CheckpointError(f"unknown load_format {opts.load_format!r} (expected one of {', '.join(LOAD_FORMATS)})")
    report = BuildReport()
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        report.seconds[stage] = now - clock
        clock = now

    module: nn.Module = meta_model(cfg, dtype)
    weights = module.checkpoint_map()
    if opts.use_graph:
        module = trace(module)
        lap("trace")
        # A start from an artifact skips the meta run: the export checked this same graph.
        result = run_passes(module, weights, opts.pass_names, check="none" if opts.artifact else "end")
        weights, report.records = result.weights, result.records
        lap("passes")
    materialize(module, device)
    if opts.load_format == "dummy":
        fill_dummy(module, opts.seed)
    else:
        load_checkpoint(module, weights, path, tied_head=cfg.tie_word_embeddings)
    lap("load")
    if opts.use_graph and (opts.compile or opts.artifact):
        module = _compile(module, cfg, device, dtype, opts, report)
        lap("compile")
        # Importing Inductor, the artifact load and the split are reported on their own;
        # "compile" keeps the rest (Inductor, when any piece was compiled), so the stages add up.
        report.seconds["compile"] -= sum(report.seconds.get(k, 0.0) for k in ("inductor_import", "artifact_load")) \
            + report.seconds["split"]
    return module, report


def _compile(module: nn.Module, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
             opts: BuildOptions, report: BuildReport) -> nn.Module:
    from compiled.runtime.artifact import ArtifactError, load_artifact, manifest_for
    from compiled.runtime.compiler import compile_model
    artifacts = None
    if opts.artifact:
        start = time.perf_counter()
        # Most of a warm start: the modules a compiled artifact needs to load (reported alone).
        from torch._inductor import CompiledArtifact  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
        report.seconds["inductor_import"] = time.perf_counter() - start
        start = time.perf_counter()
        try:
            artifacts = load_artifact(opts.artifact, manifest_for(cfg, opts.pass_names, dtype, device))
        except ArtifactError as e:
            if not opts.recompile_on_mismatch:
                raise
            log.warning("%s; compiling instead", e)
        report.seconds["artifact_load"] = time.perf_counter() - start
    compiled, report.compiled, crep = compile_model(module, device, artifacts)
    report.seconds["split"] = crep.seconds["split"]
    report.pieces, report.unique_pieces, report.compiled_now = crep.pieces, crep.unique, crep.compiled
    if artifacts is not None and crep.compiled:
        raise ArtifactError(f"{opts.artifact}: artifact lacks {crep.compiled} of {crep.unique} compiled pieces")
    return compiled
