"""The start-up pipeline: config -> trace -> passes -> materialise -> load weights -> compile.

Returns the module the runner calls (`module(input_ids, positions) -> hidden`, `module.lm_head`)
and how long each stage took."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from compiled.errors import ConfigError
from compiled.graphs.config import ModelConfig
from compiled.graphs.trace import materialize, meta_model, trace
from compiled.passes.base import GraphPass, PassRecord
from compiled.passes.lora_delta import lora_delta_pass
from compiled.passes.manager import DEFAULT_PASSES, run_passes, with_cp, with_lora
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


@dataclass
class Models:
    """What an engine runs: the model, and with LoRA on, the same weights through a graph that
    adds the adapters' deltas (run only by batches in which some request uses an adapter, so a
    batch without adapters costs what it costs without LoRA)."""
    base: nn.Module
    lora: nn.Module | None
    report: BuildReport
    # The LoRA graph's module before compilation: it owns the LoRA buffers by name (a compiled
    # model holds the same tensors, unnamed), which the adapter pool writes.
    lora_buffers: nn.Module | None = None
    # With context parallelism: the graph of a context-parallel step (`passes/cp_allgather.py`),
    # over the same weights (and LoRA buffers, whose deltas it adds).
    cp: nn.Module | None = None


def build_model(cfg: ModelConfig, path: str, config: EngineConfig) -> tuple[nn.Module, BuildReport]:
    """The model of the checkpoint at `path` as `config` (resolved) asks for it."""
    models = build_models(cfg, path, config)
    return models.base, models.report


def uses_graph(config: EngineConfig) -> bool:
    """Whether the model runs as the traced graph: LoRA's deltas exist only in the graph, so
    with LoRA on, `enforce_eager` runs the graph uncompiled rather than the plain module."""
    return config.use_graph and (config.lora or not config.enforce_eager)


def build_models(cfg: ModelConfig, path: str, config: EngineConfig) -> Models:
    """The models of the checkpoint at `path` as `config` (resolved) asks for them."""
    device, dtype = config.device, config.dtype
    use_graph = uses_graph(config)
    if config.lora and not use_graph:
        raise ConfigError("LoRA adapters run in the traced graph: use_graph=False cannot serve them")
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
    lora = lora_buffers = _variant_graph(module, cfg, config, with_lora(pass_names(config), lora_pass(config))) \
        if config.lora else None
    if lora is not None:
        lap("lora_graph")
    cp = _variant_graph(module, cfg, config, cp_passes(config), lora_buffers) if config.cp else None
    if cp is not None:
        lap("cp_graph")
    if use_graph and (config.use_compile or config.artifact):
        module = _compile(module, cfg, config, report)
        lap("compile")
        # Importing Inductor, the artifact load and the split are reported on their own;
        # "compile" keeps the rest (Inductor, when any piece was compiled), so the stages add up.
        report.seconds["compile"] -= sum(report.seconds.get(k, 0.0) for k in ("inductor_import", "artifact_load")) \
            + report.seconds["split"]
        if lora is not None:
            from compiled.compilation.inductor import compile_model
            lora, _, _ = compile_model(lora, config.device, None, config.splitting_ops)
            lap("compile_lora")
        if cp is not None:
            from compiled.compilation.inductor import compile_model
            from compiled.parallel.ops import CP_SPLITTING_OPS
            cp, _, _ = compile_model(cp, config.device, None, config.splitting_ops + CP_SPLITTING_OPS)
            lap("compile_cp")
    return Models(module, lora, report, lora_buffers, cp)


def lora_pass(config: EngineConfig) -> GraphPass:
    return lora_delta_pass(config.max_loras_per_batch, config.max_lora_rank)


def cp_passes(config: EngineConfig) -> list:
    """The passes of the context-parallel graph: the engine's (with the LoRA deltas when it serves
    adapters), then the gathers."""
    names = with_lora(pass_names(config), lora_pass(config)) if config.lora else pass_names(config)
    return with_cp(names)


def _variant_graph(base: fx.GraphModule, cfg: ModelConfig, config: EngineConfig, passes: list,
                   lora_source: nn.Module | None = None) -> fx.GraphModule:
    """The graph of `passes` over `base`'s weights (nothing is copied): traced and passed on
    `meta`, then every parameter and buffer taken from `base` by name; its LoRA buffers are
    `lora_source`'s, or allocated here (zeros) when there is none."""
    module = meta_model(cfg, config.dtype)
    gm = trace(module)
    run_passes(gm, module.checkpoint_map(), passes, check="none")
    shared = dict(base.named_parameters()) | dict(base.named_buffers())
    if lora_source is not None:
        shared |= {n: b for n, b in lora_source.named_buffers() if n.rpartition(".")[2].startswith("lora_")}
    for name, tensor in list(gm.named_parameters()) + list(gm.named_buffers()):
        owner_name, _, leaf = name.rpartition(".")
        owner = gm.get_submodule(owner_name)
        if leaf.startswith("lora_") and name not in shared:
            owner.register_buffer(leaf, torch.zeros(tensor.shape, dtype=tensor.dtype, device=config.device),
                                  persistent=False)
        elif isinstance(tensor, nn.Parameter):
            setattr(owner, leaf, shared[name])
        else:
            owner.register_buffer(leaf, shared[name], persistent=False)
    gm.lm_head = base.lm_head
    return gm.eval().requires_grad_(False)


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
