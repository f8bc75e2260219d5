"""Token bitmasks: int32 words, bit j of word w allowing token 32 * w + j, one row per logits row.

`apply_bitmask_` sets every disallowed logit of the given rows to -inf in place, with xgrammar's
kernel (CUDA on the GPU, C++ on the CPU); logits past the bitmask's width (a model vocabulary
larger than the one the mask was built for) are disallowed too. `apply_bitmask_ref` is the torch
reference it is tested against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import xgrammar as xgr

_NEG_INF = float("-inf")


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_ref(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 words -> [R, vocab_size] bool: whether each token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return allowed[:, :vocab_size]


def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """The reference: `logits[r]` keeps only the tokens `bitmask[r]` allows, for each r in `rows`."""
    if not rows:
        return
    index = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)
    allowed = allowed_ref(bitmask.index_select(0, index.to(bitmask.device)).to(logits.device), logits.shape[1])
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~allowed, _NEG_INF))


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """As `apply_bitmask_ref`, with xgrammar's kernel. `bitmask` on the logits' device."""
    if not rows:
        return
    rows = list(rows)
    covered = min(logits.shape[1], bitmask.shape[1] * 32)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=covered, indices=rows)
    if covered < logits.shape[1]:
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        logits[index, covered:] = _NEG_INF


@dataclass
class GrammarMask:
    """One step's masks: `bitmask[r]` (on the logits' device) applies to logits row r, r in `rows`."""
    bitmask: torch.Tensor
    rows: list[int]

    def apply(self, logits: torch.Tensor) -> None:
        apply_bitmask_(logits, self.bitmask, self.rows)

    def patch_argmax(self, logits: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
        """`argmax` (of the logits before masking) with the masked rows' argmax taken afresh."""
        index = torch.tensor(self.rows, dtype=torch.int64).to(logits.device, non_blocking=True)
        return argmax.index_copy(0, index, logits.index_select(0, index).argmax(dim=-1))
