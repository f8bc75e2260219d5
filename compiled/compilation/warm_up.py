"""Warm-up forwards: run for their side effects only (Triton compiles, autotuning, workspace
allocation before a CUDA-graph capture), each compiled function once per input shapes."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

# While set (see warm_up_once): outputs of the first call per (function, input shapes). Not a
# field of the forward context (`compiled/forward_context.py`): no op reads it, the capture code
# sets it around a warm-up pass rather than the runner around a forward, and every compiled piece
# checks it on each call, where a module global is the cheapest read.
_warm_outputs: dict | None = None


@contextlib.contextmanager
def warm_up_once() -> Iterator[None]:
    """A forward run only for its side effects (Triton compiles, autotuning, workspace
    allocation before a capture; the piecewise capture itself): identical layers share code and
    shapes, so each compiled function, and attention, runs once per input shape and later
    layers return those outputs."""
    global _warm_outputs
    previous, _warm_outputs = _warm_outputs, {}
    try:
        yield
    finally:
        _warm_outputs = previous


def once_per_shape(kind: object, run: Callable, args: tuple, activations: list[bool] | None = None):
    """`run(*args)`; during warm_up_once, the outputs of the first call of this `kind` with these
    shapes of the activations (every tensor argument when `activations` is None)."""
    if _warm_outputs is None:
        return run(*args)
    shapes = tuple(tuple(a.shape) for i, a in enumerate(args)
                   if isinstance(a, torch.Tensor) and (activations is None or activations[i]))
    key = (kind, shapes)
    if key not in _warm_outputs:
        _warm_outputs[key] = run(*args)
    return _warm_outputs[key]
