"""One adapter folded into the base weights while it is the only one a batch uses (`merge_lora`).

A batch whose every request uses the same adapter then runs the base model's graphs at the base
model's speed: each LoRA-targetable dense weight becomes `W + scaling * B @ A` (computed in fp32
from an unmerged copy of W and rounded once to W's dtype: the outputs differ from the unmerged
deltas' by that rounding, as a model merged by PEFT's `merge_and_unload` does). A batch with any other adapter,
or a request without one, first gets W back from the copy. Both are enqueued on the current stream,
between steps; the copies take the dense weights' bytes once more, allocated with the engine
before the KV cache is sized.

Merging costs about a pass over those weights, so an adapter is merged only after it has been the
only one for `MERGE_AFTER_STEPS` steps in a row: batches that alternate keep the deltas. An
adapter with expert weights is never merged (the experts are too large to keep a copy of); one
that leaves the experts alone is, its expert deltas being zero."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from compiled.graphs.config import ModelConfig
from compiled.lora.pool import DenseTarget, find_targets
from compiled.lora.weights import Adapter

MERGE_AFTER_STEPS = 8


@dataclass
class _Merged:
    slot: int
    adapter: Adapter   # the object the pool holds: one loaded again under the same name is another


class MergedLoRA:
    def __init__(self, model: nn.Module, cfg: ModelConfig) -> None:
        """`model`: the graph whose dense projections carry the `lora_delta` buffers."""
        self.targets: list[DenseTarget] = find_targets(model, cfg)[0]
        with torch.no_grad():
            self.copies = [t.weight.clone() for t in self.targets]
        self.adapters: Mapping[str, Adapter] = {}   # the pool's loaded adapters (the engine sets it)
        self.merged: _Merged | None = None
        self.merges = 0
        self._candidate: _Merged | None = None
        self._streak = 0

    def prepare(self, requests, uses_lora: bool) -> bool:
        """Before a step of `requests` (each with `lora` and `lora_slot`): merge or unmerge as the
        batch needs; whether the step must run the LoRA graphs (False: the base ones)."""
        single = self._single(requests)
        if single is not None and self._is(self.merged, single):
            return False
        if self.merged is not None:
            self.unmerge()
        if single is None:
            self._candidate, self._streak = None, 0
            return uses_lora
        if not self._is(self._candidate, single):
            self._candidate, self._streak = single, 0
        self._streak += 1
        if self._streak < MERGE_AFTER_STEPS:
            return True
        self.merge(single)
        return False

    def _single(self, requests) -> _Merged | None:
        """The adapter every request uses, where it can be merged; else None."""
        first = requests[0]
        if first.lora is None or first.lora_slot < 0:
            return None
        if any(r.lora != first.lora or r.lora_slot != first.lora_slot for r in requests):
            return None
        adapter = self.adapters.get(first.lora)
        if adapter is None or adapter.experts:
            return None
        return _Merged(first.lora_slot, adapter)

    @staticmethod
    def _is(a: _Merged | None, b: _Merged) -> bool:
        return a is not None and a.slot == b.slot and a.adapter is b.adapter

    @torch.no_grad()
    def merge(self, what: _Merged) -> None:
        """Every target's weight <- its copy + the adapter's delta (the adapter in slot `what.slot`)."""
        try:
            for t, copy in zip(self.targets, self.copies):
                # summed in the delta's new fp32 tensor: in an fp32 engine copy.float() is the copy itself
                t.weight.copy_(delta(t, what.slot).add_(copy))
        except BaseException:
            self.unmerge()
            raise
        self.merged = what
        self.merges += 1

    @torch.no_grad()
    def unmerge(self) -> None:
        for t, copy in zip(self.targets, self.copies):
            t.weight.copy_(copy)
        self.merged = None


def delta(t: DenseTarget, slot: int) -> torch.Tensor:
    """`[out, in]` fp32: each slice's `scale * B @ A` of the adapter in `slot`, stacked."""
    R = t.a.shape[1] // len(t.widths)
    parts, row = [], 0
    for i, width in enumerate(t.widths):
        b = t.b[slot, row:row + width].float()
        a = t.a[slot, i * R:(i + 1) * R].float()
        parts.append((b * t.scale[slot, i].float()) @ a)
        row += width
    return torch.cat(parts)
