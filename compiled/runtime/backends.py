"""Applies the config's backend choices to the ops (an environment variable set for one wins)."""

from __future__ import annotations

from compiled.runtime.config import EngineConfig


def configure_backends(config: EngineConfig) -> None:
    """Each op family's backend as `config` says, unless its COMPILED_*_BACKEND is set. The
    choice is per process: the ops are registered once, for every engine."""
    from compiled.attention import ops as attention
    from compiled.linear import ops as linear
    from compiled.moe import fused_moe, routing
    for module, family in ((attention, "attention"), (linear, "linear"), (fused_moe, "moe"), (routing, "routing")):
        module.BACKEND.configure(config.backends[family])
