"""The pass list of each graph variant is chosen in one place, `manager.passes_for`."""

from __future__ import annotations

import pytest

from compiled.passes.base import GraphPass
from compiled.passes.manager import DEFAULT_PASSES, passes_for, resolve_passes, with_cp, with_lora
from compiled.passes.lora_delta import lora_delta_pass
from compiled.passes.variant import BASE, LORA, GraphVariant


def _names(passes) -> list[str]:
    return [p.name if isinstance(p, GraphPass) else p for p in passes]


def test_base_runs_the_configured_list():
    assert passes_for(BASE, None) == list(DEFAULT_PASSES)
    assert passes_for(BASE, ["fuse_qkv"]) == ["fuse_qkv"]


def test_lora_and_context_parallel_variants_add_their_passes():
    lora = _names(passes_for(LORA, None, 2, 4))
    assert lora == _names(with_lora(None, lora_delta_pass(2, 4)))
    both = _names(passes_for(GraphVariant(lora=True, context_parallel=True), None, 2, 4))
    assert both == _names(with_cp(with_lora(None, lora_delta_pass(2, 4)))) and both[-1] == "cp_allgather"
    assert _names(passes_for(GraphVariant(context_parallel=True), None)) == [*DEFAULT_PASSES, "cp_allgather"]
    resolve_passes(passes_for(GraphVariant(lora=True, context_parallel=True), None, 2, 4))   # a valid order


def test_a_lora_variant_without_the_pool_sizes_is_an_error():
    with pytest.raises(ValueError, match="LoRA pool"):
        passes_for(LORA, None)


def test_variants_are_small_hashable_keys():
    assert GraphVariant() == BASE and hash(GraphVariant(lora=True)) == hash(LORA)
    assert str(BASE) == "base" and str(GraphVariant(lora=True, context_parallel=True)) == "lora+cp"
