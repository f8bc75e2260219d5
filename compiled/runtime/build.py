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
from compiled.linear import fp8_cublas
from compiled.passes.base import PassRecord
from compiled.passes.manager import DEFAULT_PASSES, passes_for, run_passes
from compiled.passes.variant import BASE, LORA, GraphVariant
from compiled.quant.at_load import with_quantization
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
    """What an engine runs: one graph per variant (`passes/variant.py`), all over the same weights.
    BASE always; with LoRA on, LORA, which adds the adapters' deltas (run only by batches in which
    some request uses an adapter, so a batch without adapters costs what it costs without LoRA);
    with context parallelism, the graph of a context-parallel step (`passes/cp_allgather.py`),
    which adds the deltas too when LoRA is on."""
    graphs: dict[GraphVariant, nn.Module]
    report: BuildReport
    # The LoRA graph's module before compilation: it owns the LoRA buffers by name (a compiled
    # model holds the same tensors, unnamed), which the adapter pool writes.
    lora_buffers: nn.Module | None = None

    @property
    def base(self) -> nn.Module:
        return self.graphs[BASE]

    @property
    def runner_graphs(self) -> dict[GraphVariant, nn.Module]:
        """The graphs the model runner runs (and captures): all but the context-parallel one."""
        return {v: m for v, m in self.graphs.items() if not v.context_parallel}

    @property
    def cp(self) -> nn.Module | None:
        """The context-parallel step's graph, with context parallelism."""
        return next((m for v, m in self.graphs.items() if v.context_parallel), None)


def build_model(cfg: ModelConfig, path: str, config: EngineConfig) -> tuple[nn.Module, BuildReport]:
    """The model of the checkpoint at `path` as `config` (resolved) asks for it."""
    models = build_models(cfg, path, config)
    return models.base, models.report


def uses_graph(config: EngineConfig) -> bool:
    """Whether the model runs as the traced graph: LoRA's deltas and tensor parallelism's shards
    exist only in the graph, so with either, `enforce_eager` runs the graph uncompiled rather
    than the plain module."""
    return config.use_graph and (config.lora or config.tp or not config.enforce_eager)


def graph_variants(config: EngineConfig) -> list[GraphVariant]:
    """The graphs an engine of `config` runs besides BASE, the LoRA one first (the others share
    its LoRA buffers)."""
    variants = [LORA] if config.lora else []
    if config.cp:
        variants.append(GraphVariant(lora=config.lora, context_parallel=True))
    return variants


def variant_passes(variant: GraphVariant, config: EngineConfig, tp_rank: int = 0, quantized: bool = False) -> list:
    """The passes of `variant`'s graph for `config` (`passes.manager.passes_for`) on tensor-parallel
    rank `tp_rank`; `quantized`: the checkpoint has FP8 weights. The runner keys a process's graphs
    by their variant without the world size and rank (every graph of a process has the same),
    which are applied here."""
    return passes_for(variant.at(config.tensor_parallel_size, tp_rank, config.enable_expert_parallel),
                      pass_names(config),
                      config.max_loras_per_batch, config.max_lora_rank, quantized)


def _stage(variant: GraphVariant) -> str:
    return "cp" if variant.context_parallel else str(variant)


def build_models(cfg: ModelConfig, path: str, config: EngineConfig, tp_rank: int = 0) -> Models:
    """The models of the checkpoint at `path` as `config` (resolved) asks for them, on
    tensor-parallel rank `tp_rank` (its shards of the weights only)."""
    device, dtype = config.device, config.dtype
    use_graph = uses_graph(config)
    if config.lora and not use_graph:
        raise ConfigError("LoRA adapters run in the traced graph: use_graph=False cannot serve them")
    if config.tp and not use_graph:
        raise ConfigError("tensor parallelism shards the traced graph: use_graph=False cannot run it")
    report = BuildReport()
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        report.seconds[stage] = now - clock
        clock = now

    cfg, quantize_weights = with_quantization(cfg, config.quantization)
    if config.merge_lora and cfg.quantization is not None:
        raise ConfigError("merge_lora=True: FP8 weights cannot hold a merged adapter (its deltas are added unmerged)")
    module: nn.Module = meta_model(cfg, dtype)
    weights = module.checkpoint_map()
    quantized = cfg.quantization is not None
    if quantized:
        fp8_cublas.prefer_static_schedules()
    if use_graph:
        module = trace(module)
        lap("trace")
        # A start from an artifact skips the meta run: the export checked this same graph.
        result = run_passes(module, weights, variant_passes(BASE, config, tp_rank, quantized),
                            check="none" if config.artifact else "end")
        weights, report.records = result.weights, result.records
        lap("passes")
    materialize(module, device)
    if config.load_format == "dummy":
        fill_dummy(module, config.seed)
    else:
        load_checkpoint(module, weights, path, tied_head=cfg.tie_word_embeddings, quant=cfg.quantization,
                        quantize_weights=quantize_weights)
    lap("load")
    models = Models({BASE: module}, report)
    for variant in graph_variants(config):
        passes = variant_passes(variant, config, tp_rank, quantized)
        models.graphs[variant] = _variant_graph(module, cfg, config, passes,
                                                models.lora_buffers)
        if variant == LORA:
            models.lora_buffers = models.graphs[variant]
        lap(f"{_stage(variant)}_graph")
    if use_graph and (config.use_compile or config.artifact):
        _compile_all(models, cfg, config, lap)
    return models


def _compile_all(models: Models, cfg: ModelConfig, config: EngineConfig, lap) -> None:
    """Compile every graph of `models` in place: BASE from the artifact when there is one."""
    from compiled.compilation.inductor import compile_model
    from compiled.parallel.ops import CP_SPLITTING_OPS
    report = models.report
    models.graphs[BASE] = _compile(models.base, cfg, config, report)
    lap("compile")
    # Importing Inductor, the artifact load and the split are reported on their own;
    # "compile" keeps the rest (Inductor, when any piece was compiled), so the stages add up.
    report.seconds["compile"] -= sum(report.seconds.get(k, 0.0) for k in ("inductor_import", "artifact_load")) \
        + report.seconds["split"]
    for variant, graph in list(models.graphs.items()):
        if variant != BASE:
            splitting = config.splitting_ops + (CP_SPLITTING_OPS if variant.context_parallel else ())
            models.graphs[variant], _, _ = compile_model(graph, config.device, None, splitting)
            lap(f"compile_{_stage(variant)}")


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
    """What an artifact for this model and config must have been compiled for: `cfg` as the model
    is built from it (quantized while loading where `config.quantization` asks)."""
    from compiled.compilation.artifact import manifest_for
    cfg = with_quantization(cfg, config.quantization)[0]
    manifest = manifest_for(cfg, pass_names(config), config.splitting_ops, config.dtype, config.device)
    if config.tp:   # the manifest records the world size (`compilation.artifact.CHECKED`)
        manifest["tensor_parallel_size"] = config.tensor_parallel_size
        if config.enable_expert_parallel:
            manifest["enable_expert_parallel"] = True
    return manifest
