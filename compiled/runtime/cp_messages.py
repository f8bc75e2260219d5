"""What rank 0 of a context- or tensor-parallel group tells its workers, one dataclass a message
(broadcast as pickled objects on the group's control channel): the KV cache's size once, then steps
to run and adapters to add or remove, until `Stop`. A worker hands each to its handler through one table
keyed by the message's type (`cp_worker.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class StepChunk:
    """What every rank needs of one chunk of a context-parallel step."""
    row: int                 # the request's row of the request->token table
    start: int               # position of its first token
    token_ids: list[int]
    slots: np.ndarray        # the tokens' KV slots
    lora_slot: int
    split: bool

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass
class KVSlots:
    """The KV cache's size on rank 0, which every worker's cache takes (sent once, first)."""
    num_slots: int


@dataclass
class StepMessage:
    """Run a context-parallel step."""
    chunks: list[StepChunk]
    adapters: dict[int, str]   # slot -> the adapter it must hold, for the slots the step uses
    # Each context-parallel rank a tensor-parallel group (`parallel/mesh.py`): the request-table rows
    # the scheduler pointed at cached K/V, and the rows of the step's hidden states whose logits
    # rank 0 computes after it (sampled rows, then prompt logprobs' (start, stop) rows), which rank
    # 0's tensor-parallel group computes together (their vocabulary shards are gathered).
    table_writes: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    logit_rows: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class AddLora:
    adapter: object            # a `compiled.lora.Adapter`
    pinned: bool


@dataclass
class RemoveLora:
    name: str


@dataclass
class Stop:
    """Leave the group: rank 0 is shutting down."""


@dataclass
class TPChunk:
    """What a tensor-parallel worker needs of one chunk of a step to stage it as rank 0 does."""
    row: int
    start: int
    token_ids: list[int]     # pending tokens (overlap scheduling) read 0, as on rank 0
    slots: np.ndarray
    lora_slot: int


@dataclass
class TPStep:
    """Run one step's forward: every rank of a tensor-parallel group runs each step."""
    chunks: list[TPChunk]
    sample_rows: list[int]
    feed: bool                                    # the input ids follow on the data group (overlap scheduling)
    table_writes: list[tuple[int, int, np.ndarray]]   # request-table rows the scheduler pointed at cached K/V
    adapters: dict[int, str]   # slot -> the adapter it must hold, for the slots the step uses
    # rows of the step's hidden states whose logits rank 0 computes after it (prompt logprobs), in
    # order: every rank computes its vocabulary shard's of each, for the gather
    logit_rows: list[tuple[int, int]] = field(default_factory=list)
