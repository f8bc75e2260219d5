"""Token bitmasks: int32 words, bit j of word w allowing token 32 * w + j, one row per logits row.

`apply_bitmask_` sets every disallowed logit of the given rows to -inf in place: on the GPU one
Triton launch (`apply_bitmask_triton`: a program per row and 4096 logits, writing only the
disallowed ones), on the CPU xgrammar's C++ kernel. Logits past the bitmask's width (a model
vocabulary larger than the one the mask was built for) are disallowed too. `apply_bitmask_ref`
is the torch reference both are tested against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl
import xgrammar as xgr

_NEG_INF = float("-inf")
BLOCK = 4096   # logits a program masks


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


@triton.jit
def _apply_bitmask_kernel(Logits, Bitmask, Rows, V, W, stride_logits, stride_bitmask, BLOCK: tl.constexpr):
    row = tl.load(Rows + tl.program_id(0)).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    word = offs // 32
    words = tl.load(Bitmask + row * stride_bitmask + word, mask=(offs < V) & (word < W), other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    tl.store(Logits + row * stride_logits + offs, float("-inf"), mask=(offs < V) & ~allowed)


def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """As `apply_bitmask_ref`; `rows`: int32 or int64 row indices on the logits' device."""
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1 or bitmask.dtype != torch.int32:
        raise ValueError(f"apply_bitmask: logits {tuple(logits.shape)} and an int32 bitmask {tuple(bitmask.shape)} "
                         f"({bitmask.dtype}) need a contiguous last dim")
    V, W = logits.shape[1], bitmask.shape[1]
    if len(rows) == 0:
        return
    _apply_bitmask_kernel[(len(rows), triton.cdiv(V, BLOCK))](logits, bitmask, rows, V, W, logits.stride(0),
                                                             bitmask.stride(0), BLOCK=BLOCK, num_warps=4)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """As `apply_bitmask_ref`. `bitmask` on the logits' device."""
    if not rows:
        return
    rows = list(rows)
    if logits.device.type == "cuda":
        index = torch.tensor(rows, dtype=torch.int32, pin_memory=True).to(logits.device, non_blocking=True)
        apply_bitmask_triton(logits, bitmask, index)
        return
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
