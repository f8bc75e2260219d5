"""Applies the config's backend choices to the ops (an environment variable set for one wins)."""

from __future__ import annotations

import importlib

from compiled.runtime.config import EngineConfig

# Op family (`EngineConfig.BACKEND_FAMILIES`) -> the module whose `BACKEND` switches it.
FAMILY_MODULES = {"attention": "compiled.attention.ops", "linear": "compiled.linear.ops",
                  "moe": "compiled.moe.fused_moe", "routing": "compiled.moe.routing", "lora": "compiled.linear.lora"}


def configure_backends(config: EngineConfig) -> None:
    """Each op family's backend as `config` says, unless its COMPILED_*_BACKEND is set. The
    choice is per process: the ops are registered once, for every engine."""
    for family, name in config.backends.items():
        importlib.import_module(FAMILY_MODULES[family]).BACKEND.configure(name)
