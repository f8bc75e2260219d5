"""Trace the plain model into one torch.fx GraphModule, on the meta device.

The graph's inputs are `input_ids [T]` and `positions [T]`; T (the batch's token count) is its
only dynamic dimension. Linear, Embedding and RotaryEmbedding stay call_module leaves so passes
can see projections and materialisation can rebuild the RoPE table; custom ops are single nodes."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import fx, nn

import compiled.linear.activation  # noqa: F401  (registers compiled::silu_and_mul)
from compiled.graphs.config import ModelConfig
from compiled.graphs.layers import RotaryEmbedding
from compiled.graphs.qwen3 import Qwen3ForCausalLM

LEAF_MODULES = (nn.Linear, nn.Embedding, RotaryEmbedding)


class ModelTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, LEAF_MODULES) or super().is_leaf_module(m, qualname)

    def getattr(self, attr: str, attr_val, parameter_proxy_cache: dict):
        # fx's default searches every named parameter per access: quadratic with the 18k expert
        # weights of a 128-expert, 48-layer model. One id -> name table makes it linear.
        if isinstance(attr_val, nn.Parameter):
            if not hasattr(self, "_param_names"):
                self._param_names = {id(p): n for n, p in self.root.named_parameters()}
            name = self._param_names.get(id(attr_val))
            if name is not None:
                if name not in parameter_proxy_cache:
                    parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
                return parameter_proxy_cache[name]
        return super().getattr(attr, attr_val, parameter_proxy_cache)


def trace(model: Qwen3ForCausalLM) -> fx.GraphModule:
    """The model's forward (tokens -> final hidden states) as a GraphModule that shares the
    model's parameters; `lm_head` is attached beside the graph for `compute_logits`."""
    graph = ModelTracer().trace(model)
    gm = fx.GraphModule(model, graph, class_name="Qwen3Graph")
    gm.lm_head = model.lm_head
    gm.config = model.config
    return gm


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def meta_model(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> Qwen3ForCausalLM:
    """The plain model on `meta`, parameters already in their final dtype (no memory used)."""
    with torch.device("meta"), _default_dtype(dtype):
        return Qwen3ForCausalLM(cfg)


def trace_config(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> fx.GraphModule:
    return trace(meta_model(cfg, dtype))


def example_inputs(num_tokens: int, vocab_size: int, device: str | torch.device = "meta") -> tuple[torch.Tensor, ...]:
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    if str(device) != "meta":
        ids.random_(0, vocab_size)
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
    return ids, positions


def materialize(gm: nn.Module, device: torch.device) -> nn.Module:
    """Allocate every parameter of a meta graph on `device` (uninitialised), once, in place."""
    gm.to_empty(device=device)
    # to_empty re-creates parameters, which unties the LM head from the embedding.
    if gm.config.tie_word_embeddings:
        gm.lm_head.weight = gm.get_submodule("model.embed_tokens").weight
    for module in gm.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers()
    return gm.eval().requires_grad_(False)

