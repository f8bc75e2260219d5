"""The split-K workspace registry: one workspace per kernel and device, allocated once, and one
rule inside a CUDA graph capture (a kernel whose workspace is not there yet raises, by name)."""

from __future__ import annotations

import pytest
import torch

from compiled.linear import lora_kernels, skinny_kernels, workspace


@pytest.fixture
def fresh(monkeypatch):
    """An empty registry, restored afterwards."""
    monkeypatch.setattr(workspace, "_ALLOCATED", {})


def test_allocated_once_per_kernel_and_device(fresh):
    cpu = torch.device("cpu")
    calls = []

    def allocate(device):
        calls.append(device)
        return torch.zeros(4, device=device)

    first = workspace.split_workspace("k", cpu, allocate)
    assert workspace.split_workspace("k", cpu, allocate) is first and calls == [cpu]
    assert workspace.allocated("k", cpu) is first and workspace.allocated("other", cpu) is None
    workspace.split_workspace("other", cpu, allocate)
    assert len(calls) == 2


@pytest.mark.parametrize("module, kernel", [(skinny_kernels, skinny_kernels.SKINNY_KERNEL),
                                            (lora_kernels, lora_kernels.SHRINK_KERNEL)])
def test_first_use_inside_a_capture_raises_naming_the_kernel(fresh, monkeypatch, module, kernel):
    cpu = torch.device("cpu")
    monkeypatch.setattr(workspace, "is_capturing", lambda device: True)
    with pytest.raises(workspace.WorkspaceError, match=kernel):
        module.split_workspace(cpu)
    assert workspace.allocated(kernel, cpu) is None


@pytest.mark.parametrize("module, kernel", [(skinny_kernels, skinny_kernels.SKINNY_KERNEL),
                                            (lora_kernels, lora_kernels.SHRINK_KERNEL)])
def test_allocated_before_a_capture_is_reused_inside_it(fresh, monkeypatch, module, kernel):
    cpu = torch.device("cpu")
    ws = module.split_workspace(cpu)
    assert not ws.semaphores.any() and workspace.allocated(kernel, cpu) is ws
    monkeypatch.setattr(workspace, "is_capturing", lambda device: True)
    assert module.split_workspace(cpu) is ws
