"""The forward context: one object the ops read, installed per forward; a nested install keeps the
fields it does not set (a piecewise capture's mode around the runner's forward)."""

from __future__ import annotations

import pytest
import torch

from compiled.forward_context import PiecewiseMode, current_forward, forward_context


def test_outside_a_forward_every_field_is_none():
    ctx = current_forward()
    assert (ctx.attention, ctx.lora_slots, ctx.cp, ctx.piecewise) == (None, None, None, None)


def test_a_nested_install_keeps_the_fields_it_does_not_set_and_restores_on_exit():
    slots = torch.tensor([0, -1, 1])
    outer_mode = PiecewiseMode(16, capturing=True)
    with forward_context(piecewise=outer_mode):
        with forward_context(lora_slots=slots) as inner:
            assert inner is current_forward()
            assert inner.piecewise is outer_mode and inner.lora_slots is slots
        assert current_forward().lora_slots is None and current_forward().piecewise is outer_mode
    assert current_forward().piecewise is None


def test_the_slots_op_reads_the_installed_slots_and_fails_outside():
    from compiled.linear.lora_slots import lora_token_slots
    ids = torch.zeros(2, dtype=torch.int64)
    with forward_context(lora_slots=torch.tensor([3, -1, 2])):
        assert lora_token_slots(ids).tolist() == [3, -1]
    with pytest.raises(RuntimeError, match="lora_slots"):
        lora_token_slots(ids)


def test_the_gather_is_an_identity_outside_a_context_parallel_step():
    from compiled.parallel.ops import cp_allgather
    x = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(cp_allgather(x), x)


def test_attention_outside_a_forward_names_the_missing_context():
    from compiled.attention.ops import attention
    q = torch.zeros(1, 2, 4)
    with pytest.raises(RuntimeError, match="forward_context"):
        attention(q, q, q, 0, 1.0)
