"""BackendChoice: the environment variable picks the start, `configure` yields to it, `set` does not."""

from __future__ import annotations

import pytest

from compiled.backend import BackendChoice
from compiled.envs import EnvError


def test_unset_is_auto_and_configure_sets_it(monkeypatch):
    monkeypatch.delenv("COMPILED_MOE_BACKEND", raising=False)
    choice = BackendChoice("COMPILED_MOE_BACKEND")
    assert choice.name == "auto"
    choice.configure("torch")
    assert choice.name == "torch"
    with pytest.raises(ValueError, match="COMPILED_MOE_BACKEND='cuda'"):
        choice.configure("cuda")
    assert choice.name == "torch"


def test_the_environment_wins_over_configure_but_not_set(monkeypatch):
    monkeypatch.setenv("COMPILED_ROUTING_BACKEND", "Triton")
    choice = BackendChoice("COMPILED_ROUTING_BACKEND")
    assert choice.name == "triton"
    choice.configure("torch")
    assert choice.name == "triton"
    choice.set("torch")
    assert choice.name == "torch"


def test_a_bad_environment_value_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("COMPILED_LINEAR_BACKEND", "cuda")
    choice = BackendChoice("COMPILED_LINEAR_BACKEND")   # importing an op never fails
    with pytest.raises(EnvError, match="COMPILED_LINEAR_BACKEND='cuda'"):
        choice.name
