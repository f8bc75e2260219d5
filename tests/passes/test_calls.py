"""passes/calls.py: op calls built and read by the op schema's argument names, so that an operand
added to an op shifts no other."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

import compiled.linear.library  # noqa: F401  (registers the linear family)
from compiled.passes.calls import build_call, call_args, getitem_index, getitem_source, operands, update_call


def _graph():
    graph = fx.Graph()
    return graph, [graph.placeholder(n) for n in ("x", "w", "a", "b", "scale", "slot", "nw", "inp", "w_in")]


def test_a_call_without_optional_operands_reads_as_before_they_existed():
    graph, (x, w, *_) = _graph()
    call = build_call(graph, torch.ops.compiled.linear, weight=w, x=x)
    assert call.target is torch.ops.compiled.linear.default and call.args == (x, w) and call.kwargs == {}
    assert call_args(call) == dict(x=x, weight=w, lora_a=None, lora_b=None, lora_scale=None, lora_slot=None,
                                   lora_slices=None, weight_scale=None, weight_block=None)


def test_optional_operands_go_in_order_then_by_name_after_a_gap():
    graph, (x, w, a, b, scale, slot, nw, inp, w_in) = _graph()
    lora = build_call(graph, torch.ops.compiled.linear, x=x, weight=w, lora_a=a, lora_b=b, lora_scale=scale,
                      lora_slot=slot, lora_slices=[4, 2])
    assert lora.args == (x, w, a, b, scale, slot, [4, 2]) and lora.kwargs == {}
    norm = build_call(graph, torch.ops.compiled.add_rms_norm_linear, x=x, delta=inp, norm_weight=nw, eps=1e-6,
                      weight=w, keep_normed=True, lora_slot=slot, delta_weight=w_in, delta_lora_a=a, delta_lora_b=b,
                      delta_lora_scale=scale)
    assert norm.args == (x, inp, nw, 1e-6, w, True)
    assert norm.kwargs == dict(lora_slot=slot, delta_weight=w_in, delta_lora_a=a, delta_lora_b=b,
                               delta_lora_scale=scale)
    args = call_args(norm)
    assert args["delta"] is inp and args["lora_a"] is None and args["delta_lora_scale"] is scale


def test_update_call_sets_arguments_by_name_in_place():
    graph, (x, w, a, b, scale, slot, *_) = _graph()
    call = build_call(graph, torch.ops.compiled.linear, x=x, weight=w)
    update_call(call, lora_a=a, lora_b=b, lora_scale=scale, lora_slot=slot, lora_slices=[6])
    assert call.args == (x, w, a, b, scale, slot, [6])
    update_call(call, lora_a=None, lora_b=None, lora_scale=None, lora_slot=None, lora_slices=None)
    assert call.args == (x, w) and call.kwargs == {}


def test_wrong_names_and_missing_arguments_are_errors():
    graph, (x, w, *_) = _graph()
    with pytest.raises(TypeError, match="has no argument 'bias'"):
        build_call(graph, torch.ops.compiled.linear, x=x, weight=w, bias=x)
    with pytest.raises(TypeError, match="needs its argument 'weight'"):
        build_call(graph, torch.ops.compiled.linear, x=x)
    add = graph.call_function(torch.add, (x, w))
    with pytest.raises(TypeError, match="not a custom-op call"):
        call_args(add)
    assert operands(add) == (x, w)
    with pytest.raises(TypeError, match="read it with call_args"):
        operands(build_call(graph, torch.ops.compiled.linear, x=x, weight=w))


def test_getitem_reads_its_source_and_index():
    graph, (x, *_) = _graph()
    item = graph.call_function(operator.getitem, (x, 2))
    assert getitem_source(item) is x and getitem_index(item) == 2
    with pytest.raises(TypeError, match="not a getitem"):
        getitem_index(x)
