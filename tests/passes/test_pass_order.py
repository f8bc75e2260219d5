"""Passes as objects: each has a name, a docstring, the passes it must follow and a source hash;
the manager rejects a list that breaks an order rule, naming both passes, in one line."""

from __future__ import annotations

import pytest

from compiled.passes.manager import DEFAULT_PASSES, REGISTRY, PassOrderError, check_order, pass_hashes, resolve_passes


def test_every_pass_describes_itself():
    for name, graph_pass in REGISTRY.items():
        assert graph_pass.name == name
        assert graph_pass.doc.startswith(name + ":"), f"{name}: its docstring should start with its name"
        assert len(graph_pass.uuid) == 16 and all(first in REGISTRY for first in graph_pass.after)


def test_the_default_order_keeps_every_rule():
    check_order(DEFAULT_PASSES)
    assert [p.name for p in resolve_passes(None)] == list(DEFAULT_PASSES)


@pytest.mark.parametrize("names, later, earlier", [
    (["fuse_norm_linear", "skinny_linear"], "fuse_norm_linear", "skinny_linear"),
    (["fuse_w13", "skinny_linear", "fuse_silu_linear", "silu_and_mul"], "fuse_silu_linear", "silu_and_mul"),
    (["fuse_moe_norm", "fuse_w13"], "fuse_moe_norm", "fuse_w13"),
])
def test_a_broken_order_names_both_passes(names, later, earlier):
    with pytest.raises(PassOrderError) as e:
        resolve_passes(names)
    message = str(e.value)
    assert f"'{later}'" in message and f"'{earlier}'" in message and "\n" not in message


def test_a_rule_binds_only_when_both_passes_run():
    assert [p.name for p in resolve_passes(["fuse_norm_linear"])] == ["fuse_norm_linear"]


def test_a_pass_listed_twice_is_an_error():
    with pytest.raises(PassOrderError, match="'fuse_qkv' is listed twice"):
        resolve_passes(["fuse_qkv", "fuse_qkv"])


def test_hashes_follow_the_source(monkeypatch):
    from compiled.passes import base
    before = pass_hashes(["fuse_qkv"])
    base._source_hash.cache_clear()
    monkeypatch.setattr(base.inspect, "getsource", lambda module: "changed " + module.__name__)
    try:
        assert pass_hashes(["fuse_qkv"]) != before
    finally:
        monkeypatch.undo()
        base._source_hash.cache_clear()
    assert pass_hashes(["fuse_qkv"]) == before
