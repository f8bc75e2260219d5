"""The start-up pipeline: config -> trace -> passes -> materialise -> load weights -> compile.

Returns the module the runner calls (`module(input_ids, positions) -> hidden`, `module.lm_head`)
and how long each stage took."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from torch import nn

from compiled.graphs.config import ModelConfig
from compiled.graphs.trace import materialize, meta_model, trace
from compiled.passes.base import PassRecord
from compiled.passes.manager import DEFAULT_PASSES, run_passes
from compiled.runtime.config import EngineConfig
from compiled.runtime.loader import fill_dummy, load_checkpoint

log = logging.getLogger(__name__)


@dataclass
class BuildReport:
    seconds: dict[str, float] = field(default_factory=dict)   # stage -> seconds
    records: list[PassRecord] = field(default_factory=list)
    compiled: dict = field(default_factory=dict)              # piece key -> compiled artifact
    pieces: int = 0
    unique_pieces: int = 0
    compiled_now: int = 0                                      # pieces Inductor compiled in this start


def pass_names(config: EngineConfig) -> list[str]:
    """The graph passes `config` runs, in order."""
    return list(DEFAULT_PASSES if config.passes is None else config.passes)


def build_model(cfg: ModelConfig, path: str, config: EngineConfig) -> tuple[nn.Module, BuildReport]:
    """The model of the checkpoint at `path` as `config` (resolved) asks for it."""
    device, dtype = config.device, config.dtype
    use_graph = config.use_graph and not config.enforce_eager
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
        # A start from an artifact skips the meta run: the export checked this same graph.
        result = run_passes(module, weights, pass_names(config), check="none" if config.artifact else "end")
        weights, report.records = result.weights, result.records
        lap("passes")
    materialize(module, device)
    if config.load_format == "dummy":
        fill_dummy(module, config.seed)
    else:
        load_checkpoint(module, weights, path, tied_head=cfg.tie_word_embeddings)
    lap("load")
    if use_graph and (config.use_compile or config.artifact):
        module = _compile(module, cfg, config, report)
        lap("compile")
        # Importing Inductor, the artifact load and the split are reported on their own;
        # "compile" keeps the rest (Inductor, when any piece was compiled), so the stages add up.
        report.seconds["compile"] -= sum(report.seconds.get(k, 0.0) for k in ("inductor_import", "artifact_load")) \
            + report.seconds["split"]
    return module, report


def _compile(module: nn.Module, cfg: ModelConfig, config: EngineConfig, report: BuildReport) -> nn.Module:
    from compiled.compilation.artifact import ArtifactError, load_artifact
    from compiled.compilation.inductor import compile_model
    artifacts = None
    if config.artifact:
        start = time.perf_counter()
        # Most of a warm start: the modules a compiled artifact needs to load (reported alone).
        from torch._inductor import CompiledArtifact  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
        report.seconds["inductor_import"] = time.perf_counter() - start
        start = time.perf_counter()
        try:
            artifacts = load_artifact(config.artifact, artifact_manifest(cfg, config))
        except ArtifactError as e:
            if not config.recompile_on_mismatch:
                raise
            log.warning("%s; compiling instead", e)
        report.seconds["artifact_load"] = time.perf_counter() - start
    compiled, report.compiled, crep = compile_model(module, config.device, artifacts, config.splitting_ops)
    report.seconds["split"] = crep.seconds["split"]
    report.pieces, report.unique_pieces, report.compiled_now = crep.pieces, crep.unique, crep.compiled
    if artifacts is not None and crep.compiled:
        raise ArtifactError(f"{config.artifact}: artifact lacks {crep.compiled} of {crep.unique} compiled pieces")
    return compiled


def artifact_manifest(cfg: ModelConfig, config: EngineConfig) -> dict:
    """What an artifact for this model and config must have been compiled for."""
    from compiled.compilation.artifact import manifest_for
    return manifest_for(cfg, pass_names(config), config.splitting_ops, config.dtype, config.device)
