"""What an `LLM(model, **kwargs)` runs with: the model folder (the shipped demo model by default),
its config and the resolved engine config; a context-parallel worker starts the same way."""

from __future__ import annotations

import os

import torch

from compiled.errors import ConfigError
from compiled.graphs.config import ModelConfig
from compiled.parallel.tensor import check_divisible
from compiled.runtime.backends import configure_backends
from compiled.runtime.config import EngineConfig


def default_model() -> str:
    from compiled.demo import MOE_MODEL
    return MOE_MODEL


def engine_settings(model: str | None, kwargs: dict) -> tuple[str, ModelConfig, EngineConfig]:
    """The model folder, its config and the resolved engine config of `LLM(model, **kwargs)`, with
    the op backends configured and torch seeded (a context-parallel worker starts the same way)."""
    requested = EngineConfig.from_kwargs(model=model, **kwargs)
    path = requested.model or default_model()
    if not os.path.isdir(path):
        raise ConfigError(f"{path}: model folder not found")
    model_config = ModelConfig.from_pretrained(path)
    config = requested.resolve(model_config.max_position_embeddings)
    if config.tp:   # heads and widths the ranks cannot share: refused before anything loads
        check_divisible(model_config, config.tensor_parallel_size, config.enable_expert_parallel)
    configure_backends(config)
    torch.manual_seed(config.seed)
    return path, model_config, config
