"""The normalised adapter: every supported PEFT layout becomes dense `LoRAWeight`s and per-expert
`ExpertLoRAWeight`s, float32 (the pool keeps them in its slots' dtype), with the delta of a
projection `scaling * b @ a`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from compiled.errors import CompiledError

DENSE_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


class LoRAError(CompiledError, ValueError):
    """A LoRA adapter cannot be served: missing or malformed files, unsupported settings or targets,
    or tensors that do not fit the base model. The one-line message names the adapter and culprit."""


@dataclass(frozen=True, eq=False)
class LoRAWeight:
    """LoRA of one Linear: `W += scaling * b @ a`."""
    a: torch.Tensor     # [r, in] float32
    b: torch.Tensor     # [out, r] float32
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def delta(self) -> torch.Tensor:
        """`scaling * b @ a`, [out, in]."""
        return self.scaling * (self.b @ self.a)


def stored_rows(t: torch.Tensor) -> torch.Tensor:
    """The values `t` holds: its first row where it is a broadcast view along dim 0 (a factor
    shared by every expert), else `t` itself."""
    return t[:1] if t.dim() > 0 and t.shape[0] > 1 and t.stride(0) == 0 else t


@dataclass(frozen=True, eq=False)
class ExpertLoRAWeight:
    """LoRA of one projection of every expert of an MoE layer: `W[e] += scaling * b[e] @ a[e]`.
    `a` or `b` may be a broadcast view (stride 0 along the expert axis) when the adapter shares that
    factor across experts; `shares_a` / `shares_b` tell."""
    a: torch.Tensor     # [E, r, in] float32
    b: torch.Tensor     # [E, out, r] float32
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[1]

    @property
    def num_experts(self) -> int:
        return self.a.shape[0]

    @property
    def shares_a(self) -> bool:
        return stored_rows(self.a) is not self.a

    @property
    def shares_b(self) -> bool:
        return stored_rows(self.b) is not self.b

    def delta(self) -> torch.Tensor:
        """`scaling * b[e] @ a[e]` for every expert, [E, out, in]."""
        return self.scaling * torch.bmm(self.b, self.a)


@dataclass(eq=False)
class Adapter:
    """One loaded adapter. `dense` holds the attention projections (every layer) and the MLP
    projections of dense layers, keyed (layer, proj) with proj in q_proj k_proj v_proj o_proj
    gate_proj up_proj down_proj; `experts` holds the expert projections of MoE layers, keyed
    (layer, proj) with proj in gate_proj up_proj down_proj (gate and up always separate).
    `rank` is the largest rank of them all. The pool serves it packed (`host.pack`): in the
    slots' dtype, in one block of host memory."""
    name: str
    path: str
    rank: int
    dense: dict[tuple[int, str], LoRAWeight] = field(default_factory=dict)
    experts: dict[tuple[int, str], ExpertLoRAWeight] = field(default_factory=dict)
    host: Any = None   # the `host.HostBlock` its factors live in, once packed for serving
    shard: tuple[int, int] | None = None   # (world, rank): cut to a tensor-parallel rank's share (`shard.py`)

    def factors(self):
        """Every factor, A then B of each projection: dense ones, then the experts'."""
        for w in list(self.dense.values()) + list(self.experts.values()):
            yield w.a
            yield w.b

    @property
    def projections(self) -> frozenset[str]:
        """The projection names this adapter changes somewhere, dense or expert."""
        return frozenset(p for _, p in self.dense) | frozenset(p for _, p in self.experts)

    def __repr__(self) -> str:
        return (f"Adapter({self.name!r}, rank={self.rank}, dense={len(self.dense)}, "
                f"experts={len(self.experts)}, projections={sorted(self.projections)})")
