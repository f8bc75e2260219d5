"""The adapters an engine serves: a CPU tier of loaded adapters and the GPU slots a batch reads.

The `lora_delta` pass gives every LoRA-targetable projection buffers of `S` slots (ranks zero-padded
to the pool's `R`); a slot holds one adapter for every projection at once. An adapter in the CPU
tier (`host.py`: one block, page-locked on a GPU) is copied into a slot (`loader.py`: in the
background) when a queued request needs it; slots of adapters that no running request uses are
reused, least recently used first. The CPU tier holds up to `max_loaded` adapters (None: no limit):
loading one more evicts the least recently used adapter that is neither pinned nor in a slot in
use."""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from compiled.graphs.config import ModelConfig
from compiled.lora.host import pack
from compiled.lora.loader import SlotLoader, SlotWrite, write_now
from compiled.lora.shard import shard_adapter
from compiled.lora.weights import Adapter, LoRAError
from compiled.parallel.tensor import COLUMN_PARALLEL, ShardPlan
from compiled.passes.lora_delta import dense_target

_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp$")


@dataclass
class DenseTarget:
    layer: int
    projs: tuple[str, ...]
    widths: list[int]      # output width of each projection (slice)
    a: torch.Tensor        # [S, N*R, in]
    b: torch.Tensor        # [S, out, R]
    scale: torch.Tensor    # [S, N]
    weight: torch.Tensor   # [out, in]: the projection's own (for `merged.py`)


@dataclass
class ExpertTarget:
    layer: int
    a13: torch.Tensor      # [S, E, 2R, H]: gate's A rows, then up's
    b13: torch.Tensor      # [S, E, 2I, R]: gate's B rows, then up's
    a2: torch.Tensor       # [S, E, R, I]
    b2: torch.Tensor       # [S, E, H, R]
    scale: torch.Tensor    # [S, 3]: gate, up, down


def find_targets(model: nn.Module, cfg: ModelConfig) -> tuple[list[DenseTarget], list[ExpertTarget]]:
    """The LoRA buffers the `lora_delta` pass registered on `model`'s modules."""
    dense, experts = [], []
    for name, module in model.named_modules():
        if hasattr(module, "lora_a") and (target := dense_target(name)) is not None:
            layer, projs = target
            widths = [cfg.projection_shape(p)[1] for p in projs]
            dense.append(DenseTarget(layer, projs, widths, module.lora_a, module.lora_b, module.lora_scale,
                                     module.weight))
        elif hasattr(module, "lora_a13") and (m := _EXPERTS.match(name)) is not None:
            experts.append(ExpertTarget(int(m.group(1)), module.lora_a13, module.lora_b13, module.lora_a2,
                                        module.lora_b2, module.lora_scale))
    return dense, experts


class LoRAPool:
    def __init__(self, model: nn.Module, cfg: ModelConfig, max_rank: int, max_loaded: int | None) -> None:
        self.dense, self.experts = find_targets(model, cfg)
        if not self.dense and not self.experts:
            raise LoRAError("the model has no LoRA buffers: build it with the lora_delta pass")
        first = self.dense[0].a if self.dense else self.experts[0].a13
        self.num_slots, self.max_rank, self.max_loaded = first.shape[0], max_rank, max_loaded
        self.dtype = first.dtype
        self.adapters: OrderedDict[str, Adapter] = OrderedDict()   # least recently used first
        self.pinned: set[str] = set()
        self.slot_of: dict[str, int] = {}
        self.in_slot: list[str | None] = [None] * self.num_slots
        self.slot_order: list[int] = list(range(self.num_slots))    # least recently used first
        self.loader = SlotLoader(first.device)
        self.plan: ShardPlan | None = None   # a tensor-parallel rank's (`shard_for`)

    def shard_for(self, plan: ShardPlan) -> None:
        """Serve rank `plan.rank`'s share of every adapter (before any is added): the slots hold
        the rank's slices of the sharded projections (`shard.py`)."""
        self.plan = plan
        for t in self.dense:
            t.widths = [plan.span(p)[1] if p in COLUMN_PARALLEL else w for p, w in zip(t.projs, t.widths)]

    # ---- the CPU tier ------------------------------------------------------------------------

    def add(self, adapter: Adapter, pinned: bool = False, busy: frozenset[str] = frozenset()) -> None:
        """Keep `adapter` in the CPU tier; `busy`: names that running or queued requests use."""
        if adapter.name in self.adapters:
            raise LoRAError(f"adapter {adapter.name!r} is already loaded (unload it first)")
        if adapter.rank > self.max_rank:
            raise LoRAError(f"adapter {adapter.name!r} ({adapter.path}): rank {adapter.rank} exceeds "
                            f"max_lora_rank={self.max_rank}")
        if self.max_loaded is not None and len(self.adapters) >= self.max_loaded:
            self._evict_one(busy)
        self.adapters[adapter.name] = self.prepare(adapter)
        if pinned:
            self.pinned.add(adapter.name)

    def prepare(self, adapter: Adapter) -> Adapter:
        """`adapter` as the CPU tier keeps it (`add` does this if it was not done before; it
        touches no pool state, so a thread beside the steps may do it): packed in the slots'
        dtype (a bf16 engine's tier then holds half the bytes of float32, 1.66 GB instead of 3.3
        for an expert adapter of Qwen3-30B-A3B at rank 16, and a load copies them without
        converting), page-locked on a GPU."""
        if self.plan is not None and adapter.shard is None:
            adapter = shard_adapter(adapter, self.plan)
        if self.plan is not None and adapter.shard != (self.plan.world, self.plan.rank):
            raise LoRAError(f"adapter {adapter.name!r} was cut for tensor-parallel rank {adapter.shard}, not "
                            f"{(self.plan.world, self.plan.rank)}")
        if adapter.host is None or next(iter(adapter.factors())).dtype != self.dtype:
            adapter = pack(adapter, self.dtype)
        if self.loader.background:
            adapter.host.lock()
        return adapter

    def _evict_one(self, busy: frozenset[str]) -> None:
        for name in self.adapters:
            if name not in self.pinned and name not in busy:
                self.remove(name)
                return
        raise LoRAError(f"cannot load another adapter: max_loaded_loras={self.max_loaded} are loaded and each "
                        "is pinned or in use")

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise LoRAError(f"adapter {name!r} is not loaded (loaded: {', '.join(self.adapters) or 'none'})")
        del self.adapters[name]
        self.pinned.discard(name)
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self.in_slot[slot] = None

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    # ---- the GPU slots -----------------------------------------------------------------------

    def acquire(self, name: str, in_use: set[str]) -> int | None:
        """The slot holding adapter `name`, starting its copy into one first if needed (`ready`
        says when it landed); None when every slot holds an adapter of `in_use` (the names that
        running requests use, and that must stay) or one still being copied in (for a request
        queued earlier: taking its slot would waste the copy, and the requests could take the
        slot from each other for ever)."""
        self.adapters.move_to_end(name)
        slot = self.slot_of.get(name)
        if slot is None:
            slot = next((s for s in self.slot_order
                         if self.in_slot[s] not in in_use and not self.loader.in_flight(s)), None)
            if slot is None:
                return None
            if self.in_slot[slot] is not None:
                del self.slot_of[self.in_slot[slot]]
            adapter = self.adapters[name]
            self.loader.load(slot, self._writes(slot, adapter), adapter.host)
            self.in_slot[slot], self.slot_of[name] = name, slot
        self.slot_order.remove(slot)
        self.slot_order.append(slot)
        return slot

    def ready(self, slot: int) -> bool:
        """Whether the adapter copied into `slot` has landed (a request may then run with it)."""
        return self.loader.ready(slot)

    def wait(self, slot: int) -> None:
        """Block until the adapter copied into `slot` has landed."""
        self.loader.wait(slot)

    def wait_for_loads(self) -> bool:
        """Block until every copy under way has landed; False when none was."""
        busy = [s for s in range(self.num_slots) if self.loader.in_flight(s)]
        for s in busy:
            self.loader.wait(s)
        return bool(busy)

    def place(self, name: str, slot: int) -> None:
        """Make `slot` hold adapter `name` (a context-parallel worker follows rank 0's slots)."""
        if self.in_slot[slot] == name:
            return
        old = self.slot_of.pop(name, None)
        if old is not None:
            self.in_slot[old] = None
        if self.in_slot[slot] is not None:
            del self.slot_of[self.in_slot[slot]]
        write_now(self._writes(slot, self.adapters[name]))
        self.in_slot[slot], self.slot_of[name] = name, slot

    def _writes(self, slot: int, adapter: Adapter) -> list[SlotWrite]:
        """Everything that puts `adapter` into `slot`: the slot's buffers zeroed (ranks below the
        pool's and projections it leaves alone stay zero), then its factors and scales."""
        out: list[SlotWrite] = []
        for t in self.dense:
            out += [SlotWrite(t.a[slot]), SlotWrite(t.b[slot]), SlotWrite(t.scale[slot])]
            R, row = t.a.shape[1] // len(t.projs), 0
            for i, (proj, width) in enumerate(zip(t.projs, t.widths)):
                w = adapter.dense.get((t.layer, proj))
                if w is not None:
                    r = w.a.shape[0]
                    out += [SlotWrite(t.a[slot, i * R:i * R + r], w.a), SlotWrite(t.b[slot, row:row + width, :r], w.b),
                            SlotWrite(t.scale[slot, i], value=w.scaling)]
                row += width
        for t in self.experts:
            out += [SlotWrite(x[slot]) for x in (t.a13, t.b13, t.a2, t.b2, t.scale)]
            R, I = t.a2.shape[2], t.a2.shape[3]
            for i, proj in enumerate(("gate_proj", "up_proj")):
                w = adapter.experts.get((t.layer, proj))
                if w is not None:
                    r = w.a.shape[1]
                    out += [SlotWrite(t.a13[slot, :, i * R:i * R + r], w.a),
                            SlotWrite(t.b13[slot, :, i * I:(i + 1) * I, :r], w.b),
                            SlotWrite(t.scale[slot, i], value=w.scaling)]
            w = adapter.experts.get((t.layer, "down_proj"))
            if w is not None:
                r = w.a.shape[1]
                out += [SlotWrite(t.a2[slot, :, :r], w.a), SlotWrite(t.b2[slot, :, :, :r], w.b),
                        SlotWrite(t.scale[slot, 2], value=w.scaling)]
        return out
