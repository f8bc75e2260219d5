"""The fused MoE with per-(token, expert) LoRA deltas: the body of `compiled::fused_moe` given its
expert-LoRA operands (`library.py`), its torch reference and Triton path.

The adapters' expert weights sit in a slot pool of S slots, ranks zero-padded to the pool's R;
each token names its slot (`slot [T]` int32, -1: no adapter):

    a13 [S, E, 2R, H]   gate's A rows 0..R, up's R..2R      b13 [S, E, 2I, R]   gate's B rows 0..I, up's I..2I
    a2  [S, E, R, I]    down's A                            b2  [S, E, H, R]    down's B
    scale [S, 3] fp32   gate, up, down

For each pair (t, e) of the routing, with s = slot[t] (no delta where s is -1):

    gate = w13[e, :I] @ x_t + scale[s, 0] * b13[s, e, :I] @ (a13[s, e, :R] @ x_t)
    up   = w13[e, I:] @ x_t + scale[s, 1] * b13[s, e, I:] @ (a13[s, e, R:] @ x_t)
    act  = silu(gate) * up
    out  = w2[e] @ act + scale[s, 2] * b2[s, e] @ (a2[s, e] @ act)

and the token's output is the top-k sum of the outs times their routing weights, as
`compiled::fused_moe` (which this equals, bit for bit in the reference, where every slot is -1).

The reference (`fused_moe_lora_ref`) is `fused_moe_ref`'s expert loop with the pairs of each
expert sorted by slot: each delta in fp32, added to the base projection's output in fp32 and
rounded to x's dtype. One host sync (the counts), like the base reference.

The Triton path (`fused_moe_lora_triton`, CUDA, or anywhere under the 'triton' backend) sorts the
pairs by expert with the base MoE's `moe_align_block_size`, runs the gate/up LoRA shrink
(`expert_lora_kernels`; at decode sizes a program a pair, on a side stream while the alignment runs,
since it needs only the routing), the base up GEMM with the gate/up deltas added before silu * up,
the down LoRA shrink over the intermediate (at decode sizes a program a row), the base down GEMM
with its delta (at decode sizes, where its tiles load through pointers, as its K loop's last steps:
`down_delta_in_k`; over FP8 experts at those sizes, a launch beside it on the side stream, each
token's deltas summed for the top-k sum to add: `down_expands`), and the top-k sum: two launches
more than the base's grouped path (three with that one), no host sync, scratch from the
`MoEWorkspace` (`reserve_workspace` before a CUDA graph capture). The GEMMs are the base kernels
compiled with LORA=True, so they take the tuned config whole (tiles, TMA, part-height tiles). Their
deltas (`fused_moe_kernels._pair_delta`, `triton_utils.slot_stacked_delta`) are one dot of K = R
where a tile's rows share one slot, else they stack the slots along K: the rows' shrink outputs as a
tile that is zero outside each row's own slot block, times every present slot's B rows, one dot per
`delta_k_step` of K; the shrink outputs times the scale rounded to the weights' 16-bit dtype
(DELTA_16BIT). Tiles taller than 16 rows add the deltas before their K loop (`delta_first`). Over
W8A8 experts at decode sizes the side stream goes on from the shrink to the gate and up expands
(`gate_up_expand`, fp32 `[T*k, 2I]`), and the up GEMM adds those deltas as they stand, loaded before
its K loop: a 16-row tile of several slots otherwise fetched their B rows after it. One token runs
the grouped tiles, not the base's GEMVs. The per-expert A and B of 8 rank-16 adapters are 276 MB a
Qwen3-30B-A3B layer, about a quarter of the experts' own bytes, so a batch that touches most (slot,
expert) pairs reads that much more. Backend: the MoE's (`fused_moe.BACKEND`,
`COMPILED_MOE_BACKEND`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton

from compiled.moe.fused_moe import (Blocks, ExpertScales, GemmDelta, MoEWorkspace, align_quantized, launch_gemm1,
                                    launch_gemm2, launch_sum, quantized_gemm1, w8a8_entry, w8a8_groups, zeroed)
from compiled.moe.tuned_configs import get_config, split_config, tuned_mode
from compiled.quant.dequant import FP8
from compiled.side_stream import Fork
from compiled.triton_utils import interpreting, launch_kwargs

OP = "compiled::fused_moe"
LORA_OPERANDS = ("lora_a13", "lora_b13", "lora_a2", "lora_b2", "lora_scale", "lora_slot")
DELTA_IN_16BIT = True  # the GEMMs' delta dots on 16-bit operands (the shrink outputs rounded), else fp32 / TF32
# Shared memory of an SM (H100, H200). The up GEMM's deltas run after its K loop; a decode-size
# tuned config whose pipeline fills an SM runs one program there, so each program's delta loads
# leave the SM idle. `lora_up_config` halves the LoRA up GEMM's K step so that two programs share
# an SM (bench/RESULTS.md: H200, 8 tokens 183.4 -> 173.3 µs a layer); fewer stages instead lost
# (one token, 5 -> 3 stages: 59.4 -> 64.6 µs). Steps below 128 were not tried.
SM_SHARED_BYTES = 227 * 1024
LORA_MIN_BLOCK_K = 128
# The tuned and default configs are sized for 16-bit tiles; an fp32 MoE with LoRA deltas runs its
# GEMMs with at most this many stages (the demo model's decode tiles asked 248 of 227 KB with 4).
FP32_MAX_STAGES = 2
# The shrink's K split (`shrink_split`): up to this many pairs (8 tokens of top-8), at least this
# much of K a split, at most this many splits. Up to 8 tokens the split gate/up shrink's few programs
# finish sooner; at 64 it lost (bench/RESULTS.md), and down (K = 768) stays whole.
SHRINK_SPLIT_MAX_PAIRS = 64
SHRINK_MIN_K_PER_SPLIT = 512
SHRINK_MAX_SPLIT = 8
# Up to this many pairs the gate/up shrink runs a program a pair beside the alignment
# (`moe_lora_pair_shrink_kernel`): H100, one layer's LoRA at 1 / 8 / 64 tokens +22.1 / +22.7 /
# +70.2 -> +16.2 / +14.8 / +61.7 µs (bench/RESULTS.md); the down shrink a program a row of the
# intermediate (64 tokens: 469.7-471.5 -> 467.1-469.2 µs). Its K is split until programs x splits
# reach PAIR_SHRINK_PROGRAMS, at least PAIR_MIN_K_PER_SPLIT of K a split, at most SHRINK_MAX_SPLIT.
PAIR_SHRINK_MAX_PAIRS = 512
PAIR_SHRINK_PROGRAMS = 512
PAIR_MIN_K_PER_SPLIT = 256
# K steps of the gate/up shrink (a program a pair, K = H) and of the down shrink (a program a row,
# K = I), on PAIR_SHRINK_WARPS warps: the best of an H200 sweep at 8 and 64 tokens of the 30B with
# 8 slots of rank 16 (bench/shrink_sweep.py; bench/RESULTS.md)
PAIR_SHRINK_BLOCK_K = 128
ROW_SHRINK_BLOCK_K = 256
PAIR_SHRINK_WARPS = 4
PAIR_SHRINK_STAGES = 3
EXPAND_BLOCK_N = 512   # the expands' columns a program (`moe_lora_expand_kernel`)
DELTA_IN_K_MIN_PAIRS = 384   # `down_delta_in_k`: 64 tokens of top-8 gained, 32 lost


# ----------------------------------------------------------------------------- reference

def _add_delta(base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    return (base.float() + delta).to(base.dtype)


def fused_moe_lora_ref(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor, a13: torch.Tensor, b13: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor,
                       scale: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """`[T, H]` in x's dtype. `fused_moe_ref`'s loop (transformers' eager experts: per expert,
    linear, silu * up, linear, times the routing weight in x's dtype, index_add in expert order),
    each expert's pairs sorted by slot so that each slot's rows get their delta as one product.
    Pairs of id -1 (another rank's expert) sort first and are skipped."""
    out = torch.zeros_like(x)
    T = x.shape[0]
    if T == 0:
        return out
    E, I = w13.shape[0], w2.shape[2]
    S, R = a13.shape[0], a2.shape[2]
    top_k = topk_ids.shape[1]
    token_slot = torch.where((slot >= 0) & (slot < S), slot.long(), -1)
    pair_slot = token_slot.repeat_interleave(top_k)
    flat_ids = topk_ids.reshape(-1).long()
    # expert-major (id -1 first), then no adapter, slot 0, 1, ...
    key = torch.where(flat_ids >= 0, flat_ids * (S + 1) + pair_slot + 1, -1)
    order = torch.argsort(key, stable=True)
    skipped, *counts = torch.bincount(key + 1, minlength=E * (S + 1) + 1).tolist()
    counts = [counts[e * (S + 1):(e + 1) * (S + 1)] for e in range(E)]
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order].to(x.dtype)
    start = skipped
    for e in range(E):
        n = sum(counts[e])
        if n == 0:
            continue
        tokens = token_of[start:start + n]
        h = x[tokens]
        gate, up = F.linear(h, w13[e]).split(I, dim=-1)
        segments, lo = [], counts[e][0]
        for s in range(S):
            if counts[e][s + 1]:
                segments.append((s, slice(lo, lo + counts[e][s + 1])))
            lo += counts[e][s + 1]
        for s, rows in segments:
            hs = h[rows].float()
            sa = hs @ a13[s, e].float().T                      # [n_s, 2R]
            gate[rows] = _add_delta(gate[rows], scale[s, 0] * sa[:, :R] @ b13[s, e, :I].float().T)
            up[rows] = _add_delta(up[rows], scale[s, 1] * sa[:, R:] @ b13[s, e, I:].float().T)
        act = F.silu(gate) * up
        y = F.linear(act, w2[e])
        for s, rows in segments:
            sd = act[rows].float() @ a2[s, e].float().T        # [n_s, R]
            y[rows] = _add_delta(y[rows], scale[s, 2] * sd @ b2[s, e].float().T)
        out.index_add_(0, tokens, y * weight_of[start:start + n, None])
        start += n
    return out


# ----------------------------------------------------------------------------- shape checks

def lora_operands(op: str, a13, b13, a2, b2, scale, slot, names: tuple[str, ...] = LORA_OPERANDS
                  ) -> tuple | None:
    """The expert-LoRA operands as (a13, b13, a2, b2, scale, slot), or None where none is given:
    all or none, else a one-line error naming (by `names`, the op's) those missing."""
    given = (a13, b13, a2, b2, scale, slot)
    if all(t is None for t in given):
        return None
    missing = [name for name, t in zip(names, given) if t is None]
    if missing:
        raise ValueError(f"{op}: expert LoRA needs all of {', '.join(names)}; missing {', '.join(missing)}")
    return given


def check_shapes(x, topk_weights, topk_ids, w13, w2, a13, b13, a2, b2, scale, slot) -> None:
    """One-line errors naming the op and the argument at fault."""
    if x.dim() != 2:
        raise ValueError(f"{OP}: x {tuple(x.shape)}, expected [T, H]")
    T, H = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"{OP}: topk_weights {tuple(topk_weights.shape)}, topk_ids {tuple(topk_ids.shape)}: "
                         f"expected both [{T}, k]")
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[2] != H or w2.shape[1] != H or w13.shape[0] != w2.shape[0] \
            or w13.shape[1] != 2 * w2.shape[2]:
        raise ValueError(f"{OP}: w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}: expected [E, 2I, {H}] and [E, {H}, I]")
    E, I = w13.shape[0], w2.shape[2]
    if a2.dim() != 4:
        raise ValueError(f"{OP}: a2 {tuple(a2.shape)}, expected [S, {E}, R, {I}]")
    S, R = a2.shape[0], a2.shape[2]
    for name, t, want in (("a13", a13, (S, E, 2 * R, H)), ("b13", b13, (S, E, 2 * I, R)), ("a2", a2, (S, E, R, I)),
                          ("b2", b2, (S, E, H, R))):
        if tuple(t.shape) != want:
            raise ValueError(f"{OP}: {name} {tuple(t.shape)}, expected {want} (S={S} slots, E={E}, rank R={R}, "
                             f"H={H}, I={I})")
    for name, t in (("w13", w13), ("w2", w2), ("a13", a13), ("b13", b13), ("a2", a2), ("b2", b2)):
        if t.dtype != x.dtype and not (name in ("w13", "w2") and t.dtype == FP8):   # FP8 experts: their scales' op checks
            raise ValueError(f"{OP}: {name} is {t.dtype}, x is {x.dtype}")
    if scale.shape != (S, 3) or scale.dtype != torch.float32:
        raise ValueError(f"{OP}: scale {tuple(scale.shape)} {scale.dtype}, expected ({S}, 3) torch.float32 "
                         f"(gate, up, down)")
    if slot.shape != (T,) or slot.dtype != torch.int32:
        raise ValueError(f"{OP}: slot {tuple(slot.shape)} {slot.dtype}, expected ({T},) torch.int32")


# ----------------------------------------------------------------------------- Triton path

def _dot_flags(dtype: torch.dtype) -> dict:
    """As the base MoE's: fp32 stays fp32; the interpreter upcasts 16-bit dot operands. The
    deltas' dots (fp32 shrink outputs against 16-bit B, upcast) run in TF32 on the GPU."""
    interp = interpreting()
    fp32 = dtype == torch.float32 or interp
    return dict(PRECISION="ieee" if fp32 else "tf32", DOT_FP32=interp and dtype != torch.float32,
                DELTA_PRECISION="ieee" if fp32 else "tf32", DELTA_16BIT=DELTA_IN_16BIT and not fp32)


def lora_up_config(up: dict, itemsize: int) -> dict:
    """The tuned up-GEMM config `up` for the LoRA kernel: with decode-size tiles (16 rows), K steps
    halved down to LORA_MIN_BLOCK_K until the pipeline takes at most half an SM's shared memory
    (a stage: the rows' x tile and the gate and up weight tiles)."""
    cfg = dict(up)
    if cfg["BLOCK_SIZE_M"] > 16:
        return cfg
    stage = (cfg["BLOCK_SIZE_M"] + 2 * cfg["BLOCK_SIZE_N"]) * itemsize
    while cfg["BLOCK_SIZE_K"] > LORA_MIN_BLOCK_K and stage * cfg["BLOCK_SIZE_K"] * cfg["num_stages"] > \
            SM_SHARED_BYTES // 2:
        cfg["BLOCK_SIZE_K"] //= 2
    return cfg


def reserve_workspace(ws: MoEWorkspace, max_tokens: int, E: int, H: int, I: int, top_k: int, R: int,
                      dtype: torch.dtype, device: torch.device, block_m: int = 128) -> MoEWorkspace:
    """`MoEWorkspace.reserve` plus the LoRA shrink outputs, for up to max_tokens (before capture)."""
    from compiled.moe.fused_moe import intermediate_rows
    ws.reserve(max_tokens, E, H, I, top_k, dtype, device, block_m)
    rows = max(intermediate_rows(max_tokens * top_k, E, bm) for bm in (16, block_m))
    ws.get("lora_s13", rows * 2 * R, torch.float32, device)
    ws.get("lora_d13", min(max_tokens * top_k, PAIR_SHRINK_MAX_PAIRS) * 2 * I, torch.float32, device)
    ws.get("lora_d2", min(max_tokens, PAIR_SHRINK_MAX_PAIRS) * H, torch.float32, device)
    ws.get("lora_s2", rows * R, torch.float32, device)
    ws.get("lora_s2_scaled", rows * R, dtype, device)
    split_rows = max(intermediate_rows(min(max_tokens * top_k, SHRINK_SPLIT_MAX_PAIRS), E, bm) for bm in (16, block_m))
    ws.get("lora_split", SHRINK_MAX_SPLIT * split_rows * 2 * R, torch.float32, device)
    ws.get("lora_pair_split", PAIR_SHRINK_PROGRAMS * 2 * R, torch.float32, device)
    return ws


def down_delta_in_k(pairs: int, block_m: int, down: dict, slots_pad: int, block_r: int) -> bool:
    """Whether the down GEMM runs its LoRA delta as the K loop's last steps (`DELTA_IN_K`): from
    DELTA_IN_K_MIN_PAIRS to PAIR_SHRINK_MAX_PAIRS pairs in tiles of 16 rows, where its tuned tiles
    load through pointers, not TMA, the slots fit one 32-bit mask and a K step holds whole slots
    (block_r of K each). There the loop's pipeline fetches the slots' B while the base steps run,
    where after the loop each program waited for them (H100, one layer at 64 tokens: 464.1-464.6
    against 468.1-469.7 µs; at 1 and 32 tokens, fewer programs to wait, it lost 0.8 and 1.6 µs;
    bench/RESULTS.md)."""
    return DELTA_IN_K_MIN_PAIRS <= pairs <= PAIR_SHRINK_MAX_PAIRS and block_m <= 16 and not down.get("TMA") \
        and slots_pad <= 32 and down["BLOCK_SIZE_K"] % block_r == 0


def down_expands(pairs: int, fp8: bool) -> bool:
    """Whether the down delta runs in a launch of its own on the side stream, beside the down GEMM
    (`down_expand`), for the top-k sum to add: over FP8 experts, whose down GEMM adds it after
    its K loop, at the sizes where a 16-bit one adds it in its K loop (`down_delta_in_k`). After
    the loop each program's tile of several slots waited for their B rows (bench/RESULTS.md)."""
    return fp8 and DELTA_IN_K_MIN_PAIRS <= pairs <= PAIR_SHRINK_MAX_PAIRS


def delta_k_step(block_m: int) -> int:
    """The GEMMs' delta dots stack slots x rank along K, this many a dot: 128 for decode tiles
    (16 rows), 64 for taller ones, whose two fp32 accumulators leave fewer registers."""
    return 128 if block_m <= 16 else 64


def delta_first(block_m: int) -> bool:
    """Tiles taller than 16 rows start their accumulators with the deltas, before the K loop."""
    return block_m > 16


def shrink_tiles(block_m: int, K: int) -> tuple[int, int]:
    """The shrink kernel's (K step, pipeline stages) for blocks of block_m rows over K."""
    if block_m > 32:
        return 64, 4
    return min(256, max(16, triton.next_power_of_2(K))), 3


def shrink_split(pairs: int, K: int, block_k: int) -> int:
    """The shrink's K splits for `pairs` (token, expert) pairs over K: at decode sizes (at most
    SHRINK_SPLIT_MAX_PAIRS) as many as keep SHRINK_MIN_K_PER_SPLIT of K each, whole K steps."""
    if pairs > SHRINK_SPLIT_MAX_PAIRS:
        return 1
    return max(1, min(SHRINK_MAX_SPLIT, K // max(SHRINK_MIN_K_PER_SPLIT, block_k)))


def pair_shrink_split(pairs: int, K: int, block_k: int) -> int:
    """The pair shrink's K splits for `pairs` pairs over K (whole K steps of block_k)."""
    return max(1, min(SHRINK_MAX_SPLIT, K // max(PAIR_MIN_K_PER_SPLIT, block_k), PAIR_SHRINK_PROGRAMS // pairs))


def delta_consts(dtype: torch.dtype, S: int, R: int, block_m: int) -> dict:
    """The grouped kernels' delta constants for S slots of rank R and tiles of block_m rows."""
    flags = _dot_flags(dtype)
    block_r = max(16, triton.next_power_of_2(R))
    slots_pad = triton.next_power_of_2(max(S, 1))
    return dict(SLOTS_PAD=slots_pad, BLOCK_R=block_r, KC=min(delta_k_step(block_m), slots_pad * block_r),
                DELTA_PRECISION=flags["DELTA_PRECISION"], DELTA_16BIT=flags["DELTA_16BIT"],
                DELTA_FIRST=delta_first(block_m))


def _split_scratch(split: int, out: torch.Tensor, groups: int, split_numel: int, ws: MoEWorkspace,
                   semaphores: str, partials: str) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(splits, semaphores, partials) of a shrink writing `out` whose K is cut in `split`:
    `groups` zeroed semaphores and fp32 partials of split x split_numel from the buffers so named;
    unsplit, with `out` standing in for both, where split is 1 or the semaphores would have to
    grow inside a CUDA graph capture."""
    sems = zeroed(out.device, semaphores, groups, torch.int32) if split > 1 else None
    if sems is None:
        return 1, out, out
    return split, sems, ws.get(partials, split * split_numel, torch.float32, out.device)


class ShrinkTiles(NamedTuple):
    """A `pair_shrink` launch: K steps (cut to K's power of two), warps, pipeline stages and K
    splits (0: `pair_shrink_split`'s)."""
    block_k: int
    num_warps: int = PAIR_SHRINK_WARPS
    num_stages: int = PAIR_SHRINK_STAGES
    split: int = 0


def pair_shrink(x: torch.Tensor, a: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, slot: torch.Tensor,
                ws: MoEWorkspace, pdl: dict, blocks: Blocks | None = None, block_m: int = 16,
                scale: torch.Tensor | None = None, tiles: ShrinkTiles | None = None, by_pair: bool = False) -> None:
    """out <- a shrink a program a row (`moe_lora_pair_shrink_kernel`): without `blocks`, the gate/up
    shrink of x `[T, H]`, out `[T*k, 2R]` in pair order; with them, the down shrink of the
    intermediate x `[rows, I]`, out `[rows, R]` in block order (blocks of block_m rows; `by_pair`:
    `[T*k, R]` in pair order), with `scale` times the slots' down scales (in out's dtype). `tiles`
    overrides the launch's (bench/shrink_sweep.py)."""
    from compiled.moe import expert_lora_kernels as LK
    pairs, (S, _, NR, K) = ids.numel(), a.shape
    programs = pairs if blocks is None else x.shape[0]
    if tiles is None:
        tiles = ShrinkTiles(PAIR_SHRINK_BLOCK_K if blocks is None else ROW_SHRINK_BLOCK_K)
    bk = min(tiles.block_k, triton.next_power_of_2(K))
    split, sems, partials = _split_scratch(tiles.split or pair_shrink_split(programs, K, bk), out, programs,
                                           programs * NR, ws, "lora_pair_semaphores", "lora_pair_split")
    # each program's row: by pair, its expert from the routing; by position, from the alignment
    # (the last two arguments are read only BY_POSITION)
    rows, experts, num_post = (ids, ids, ids) if blocks is None else \
        (blocks.sorted_ids, blocks.expert_ids, blocks.num_post)
    LK.moe_lora_pair_shrink_kernel[(programs, split)](
        x, a, out, rows, slot, pairs, S, NR, K, x.stride(0), a.stride(0), a.stride(1), a.stride(2),
        out.stride(0), partials, sems, triton.cdiv(triton.cdiv(K, split), bk) * bk, experts, num_post,
        out if scale is None else scale, TOP_K=ids.shape[1], BLOCK_N=max(16, triton.next_power_of_2(NR)),
        BLOCK_K=bk, SPLIT_K=split, BY_POSITION=blocks is not None, BLOCK_M=block_m,
        SCALE_COL=-1 if scale is None else 2, STORE_BY_PAIR=by_pair, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **pdl)


@dataclass
class _Launches:
    """What the shrink launches of one `fused_moe_lora_triton` call share."""
    slot: torch.Tensor
    ids: torch.Tensor     # the routing's expert ids `[T, k]`
    ws: MoEWorkspace
    pdl: dict
    block_m: int
    slots: int            # S
    blocks: Blocks | None = None

    def block_shrink(self, src: torch.Tensor, a: torch.Tensor, dst: torch.Tensor, K: int, gather: bool) -> None:
        """dst <- the shrink of src's rows by a, a program a (block, slot) (`moe_lora_shrink_kernel`)."""
        from compiled.moe import expert_lora_kernels as LK
        blocks, bm, S, numel = self.blocks, self.block_m, self.slots, self.ids.numel()
        n_blocks = blocks.expert_ids.numel()
        rows = n_blocks * bm
        flags = _dot_flags(src.dtype)
        bk, stages = shrink_tiles(bm, K)
        NR = a.shape[2]
        split, sems, partials = _split_scratch(shrink_split(numel, K, bk), dst, n_blocks * S, rows * NR, self.ws,
                                               "lora_shrink_semaphores", "lora_split")
        k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
        LK.moe_lora_shrink_kernel[(n_blocks, S * split)](
            src, a, dst, self.slot, blocks.sorted_ids, blocks.expert_ids, blocks.num_post, numel, S, NR, K,
            src.stride(0), a.stride(0), a.stride(1), a.stride(2), dst.stride(0), partials, sems, rows, k_per_split,
            TOP_K=self.ids.shape[1], GATHER=gather, PRECISION=flags["PRECISION"], DOT_FP32=flags["DOT_FP32"],
            BLOCK_M=bm, BLOCK_N=max(16, triton.next_power_of_2(NR)), BLOCK_K=bk, EVEN_K=K % bk == 0, SPLIT_K=split,
            num_warps=4, num_stages=stages, **self.pdl)

    def gate_up_beside(self, x: torch.Tensor, a13: torch.Tensor, b13: torch.Tensor, scale: torch.Tensor,
                       expands: bool) -> tuple[Fork, torch.Tensor, torch.Tensor | None]:
        """The gate/up shrink a program a pair on the side stream, beside the alignment (it needs
        only the routing), and where `expands` the gate and up deltas made whole there too
        (`gate_up_expand`): (the fork to join, the shrink outputs, the deltas or None)."""
        numel, R, I = self.ids.numel(), a13.shape[2] // 2, b13.shape[2] // 2
        s13 = self.ws.get("lora_s13", numel * 2 * R, torch.float32, x.device).view(numel, 2 * R)
        d13 = None
        fork = Fork(x.device)
        with fork.side():
            pair_shrink(x, a13, s13, self.ids, self.slot, self.ws, self.pdl)
            if expands:
                d13 = self.ws.get("lora_d13", numel * 2 * I, torch.float32, x.device).view(numel, 2 * I)
                gate_up_expand(d13, s13, b13, scale, self.slot, self.ids, self.pdl)
        return fork, s13, d13

    def down_delta(self, inter: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor, scale: torch.Tensor,
                   consts: dict, down: dict, may_run_in_k: bool = True, expands: bool = False) -> GemmDelta:
        """The down GEMM's delta: the shrink of the intermediate `[rows, I]` by a2, then b2 in the GEMM
        (in its K loop where `down_delta_in_k` says so and `may_run_in_k`: not over FP8 tiles).
        `expands` (`down_expands`): the shrink outputs in pair order, for `down_expand`."""
        numel, R, rows = self.ids.numel(), a2.shape[2], inter.shape[0]
        in_k = may_run_in_k and down_delta_in_k(numel, self.block_m, down, consts["SLOTS_PAD"], consts["BLOCK_R"])
        if in_k:   # scaled, in x's dtype: the down GEMM's last K steps read them as its own operands
            s2 = self.ws.get("lora_s2_scaled", rows * R, inter.dtype, inter.device).view(rows, R)
        else:
            s2 = self.ws.get("lora_s2", rows * R, torch.float32, inter.device).view(rows, R)
        if numel <= PAIR_SHRINK_MAX_PAIRS:
            pair_shrink(inter, a2, s2, self.ids, self.slot, self.ws, self.pdl, self.blocks, self.block_m,
                        scale if in_k else None, by_pair=expands)
        else:
            self.block_shrink(inter, a2, s2, inter.shape[1], False)
        return GemmDelta(s2, b2, scale, self.slot, consts, in_k=in_k)

    def down_expand(self, d2: torch.Tensor, delta: GemmDelta, weights: torch.Tensor) -> None:
        """d2 `[T, H]` fp32 <- each token's down deltas times their routing weights, summed
        (`moe_lora_expand_kernel`, BY_TOKEN), from `delta`'s fp32 shrink outputs in pair order."""
        b = delta.b
        _expand(d2, delta.s, b, delta.scale, weights, self.slot, self.ids.reshape(-1), b.shape[2],
                self.ids.shape[1], self.pdl, by_token=True)


def gate_up_expand(d13: torch.Tensor, s13: torch.Tensor, b13: torch.Tensor, scale: torch.Tensor, slot: torch.Tensor,
                   ids: torch.Tensor, pdl: dict) -> None:
    """d13 `[T*k, 2I]` fp32 <- each pair's gate and up deltas from its shrink outputs s13 (pair
    order), zeros where it has none (`moe_lora_expand_kernel`), for the up GEMM to add."""
    _expand(d13, s13, b13, scale, d13, slot, ids.reshape(-1), b13.shape[2] // 2, ids.shape[1], pdl)


def _expand(out: torch.Tensor, sh: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, weights: torch.Tensor,
            slot: torch.Tensor, ids: torch.Tensor, half: int, top_k: int, pdl: dict, by_token: bool = False) -> None:
    """`moe_lora_expand_kernel` over b `[S, E, N, R]`, sh and ids `[T*k]` in pair order: by pair
    (the gate and up deltas, split at `half`, a row of out each), else `by_token` (the down delta,
    each token's pairs summed times their weights, a row of out each); EXPAND_BLOCK_N columns a
    program, each program's inside one half."""
    from compiled.moe import expert_lora_kernels as LK
    N = b.shape[2]
    col_blocks = triton.cdiv(half, EXPAND_BLOCK_N) + triton.cdiv(N - half, EXPAND_BLOCK_N)
    LK.moe_lora_expand_kernel[(ids.numel() // top_k if by_token else ids.numel(), col_blocks)](
        out, sh, b, scale, weights, slot, ids, b.shape[0], b.shape[3], N, half, out.stride(0), sh.stride(0),
        b.stride(0), b.stride(1), b.stride(2), TOP_K=top_k, BLOCK_R=max(16, triton.next_power_of_2(b.shape[3])),
        BLOCK_N=EXPAND_BLOCK_N, BY_TOKEN=by_token, SCALE_COL=2 if by_token else 0, num_warps=4, **pdl)


def expand_ref(sh: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, weights: torch.Tensor, slot: torch.Tensor,
               ids: torch.Tensor, top_k: int, half: int, by_token: bool) -> torch.Tensor:
    """`moe_lora_expand_kernel` (as `_expand` launches it) in torch, a loop over the pairs: pair p
    is of expert ids[p] (no delta where < 0) and its token's slot (none outside [0, S)); its
    delta, column n taking the half h = (n >= half): scale[s, c + h] * b[s, e, n] @
    sh[p, h*R:(h+1)*R] in fp32, c = 2 by token, else 0. Returns the deltas by pair `[T*k, N]`
    (zeros where none), or by_token each token's deltas times their weights, summed `[T, N]`."""
    S, R, N = b.shape[0], b.shape[3], b.shape[2]
    deltas = torch.zeros(ids.numel(), N)
    for p, e in enumerate(ids.tolist()):
        s = int(slot[p // top_k])
        if 0 <= s < S and e >= 0:
            w = float(weights[p]) if by_token else 1.0
            for h in range(1 + (half < N)):
                cols, col = slice(h * half, N if h else half), (2 if by_token else 0) + h
                deltas[p, cols] = w * float(scale[s, col]) * (b[s, e, cols].float() @ sh[p, h * R:(h + 1) * R].float())
    return deltas.view(-1, top_k, N).sum(1) if by_token else deltas


def _blocks_tall(up: dict, down: dict) -> dict:
    """The down config with tiles of the alignment's block height: the deltas' shrink outputs and
    constants are laid out for those blocks."""
    return dict(down, BLOCK_SIZE_M=up["BLOCK_SIZE_M"])


def _lora_configs(T: int, E: int, I: int, x: torch.Tensor, config: dict | None, scales: ExpertScales | None,
                  w13: torch.Tensor, w2: torch.Tensor) -> tuple[dict, dict, tuple[int, int] | None]:
    """(up, down) GEMM configs and, where they run W8A8, the activations' group widths
    (`fused_moe.w8a8_groups`): `config`'s, else the base MoE's tuned entry (FP8 experts: their
    file first), its up GEMM fitted to the deltas. An FP8 entry that says W8A8 runs so in 16-row
    tiles (the deltas after the K loop); taller tiles take the activations' file's entry and run
    W8A16, whose dots are 16-bit like it."""
    def runs_w8a8(entry: dict) -> bool:
        return scales is not None and w8a8_entry(T, tuned_mode(entry)) and entry["BLOCK_SIZE_M"] <= 16

    if config is not None:
        up, down = split_config(config)
        down = _blocks_tall(up, down)
        return up, down, w8a8_groups(scales, w13, w2, T, up, down, runs_w8a8(config))
    entry = get_config(T, E, I, x.dtype, x.device, scales is not None)
    w8a8 = runs_w8a8(entry)
    if scales is not None and not w8a8 and w8a8_entry(T, tuned_mode(entry)):
        entry = get_config(T, E, I, x.dtype, x.device)
    up, down = split_config(entry)
    down = _blocks_tall(up, down)
    up = lora_up_config(up, 1 if w8a8 else x.element_size())
    if x.element_size() > 2:   # 4-byte tiles: the stages plus the delta operands overflow shared memory
        up, down = (dict(c, num_stages=min(c["num_stages"], FP32_MAX_STAGES)) for c in (up, down))
    return up, down, w8a8_groups(scales, w13, w2, T, up, down, w8a8)


class ExpertOutputs(NamedTuple):
    """`fused_moe_lora_triton`'s unsummed result: the weighted expert outputs `[T*k, H]` and, where
    the down deltas ran beside the down GEMM (`down_expands`), each token's sum of them, fp32
    `[T, H]`, for the top-k sum to add (else None)."""
    y: torch.Tensor
    delta: torch.Tensor | None


def fused_moe_lora_triton(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                          w2: torch.Tensor, a13: torch.Tensor, b13: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor,
                          scale: torch.Tensor, slot: torch.Tensor, config: dict | None = None,
                          workspace: MoEWorkspace | None = None, sum_slots: bool = True,
                          scales: ExpertScales | None = None) -> torch.Tensor | ExpertOutputs:
    """The op's Triton path (shapes as `check_shapes`); `config` as `fused_moe_triton`'s (its
    tiles, TMA and part-height options and "down" overrides; None: the tuned entry, its up GEMM
    through `lora_up_config`): the base grouped GEMMs with the deltas in their epilogues, after
    the shrinks. `sum_slots=False` (top-k > 1): the weighted expert outputs `[T*k, H]` unsummed,
    as `fused_moe_triton`'s, with the deltas the sum adds (`ExpertOutputs`), for the norm's
    kernel. `scales`: the experts are FP8; where `_lora_configs` says W8A8, the base GEMMs read x
    and the intermediate quantized (the shrinks their 16-bit rows) and the deltas go in after the
    K loops."""
    T, H = x.shape
    E, I = w13.shape[0], w2.shape[2]
    S, R = a2.shape[0], a2.shape[2]
    top_k = topk_ids.shape[1]
    if not sum_slots and top_k == 1:
        raise ValueError("fused_moe_lora_triton: sum_slots=False needs top-k > 1")
    out = torch.empty_like(x) if sum_slots else None
    if T == 0:
        return out if sum_slots else ExpertOutputs(x.new_empty((0, H)), None)
    x, w13, w2, a13, b13, a2, b2 = (t.contiguous() for t in (x, w13, w2, a13, b13, a2, b2))
    weights, ids, scale = topk_weights.contiguous().reshape(-1), topk_ids.contiguous(), scale.contiguous()
    up, down, groups = _lora_configs(T, E, I, x, config, scales, w13, w2)
    bm = up["BLOCK_SIZE_M"]
    call = _Launches(slot, ids, workspace or MoEWorkspace(), launch_kwargs(x.device), bm, S)
    ws, numel, pdl = call.ws, ids.numel(), call.pdl
    has_delta = bool(S and R)
    fork = None
    if has_delta and numel <= PAIR_SHRINK_MAX_PAIRS:
        # the deltas made whole over W8A8 only: its 16-row tiles of several slots waited after the K
        # loop for the slots' B rows; over 16-bit experts this lost at 8 tokens (bench/RESULTS.md)
        fork, s13, d13 = call.gate_up_beside(x, a13, b13, scale, groups is not None)
    blocks, xquant = align_quantized(ws, x, ids, E, bm, groups)
    call.blocks = blocks
    rows = blocks.expert_ids.numel() * bm
    inter = ws.get("inter", rows * I, x.dtype, x.device).view(rows, I)
    if top_k == 1:   # the down GEMM writes the placed pairs' rows only: another rank's stay zero
        y = out.zero_()
    else:
        y = ws.get("y", numel * H, x.dtype, x.device).view(numel, H)
    consts = delta_consts(x.dtype, S, R, bm)
    delta13 = None
    if fork is not None:
        fork.join()
        delta13 = GemmDelta(s13 if d13 is None else d13, b13, scale, slot, consts, by_pair=True,
                            expanded=d13 is not None)
    elif has_delta:
        s13 = ws.get("lora_s13", rows * 2 * R, torch.float32, x.device).view(rows, 2 * R)
        call.block_shrink(x, a13, s13, H, True)
        delta13 = GemmDelta(s13, b13, scale, slot, consts)
    # W8A8: the shrinks read x and the intermediate in 16 bits, the base GEMMs quantized
    if groups is None:
        launch_gemm1(x, w13, inter, blocks, top_k, up, delta13, scales)
    else:
        iq, is_ = quantized_gemm1(ws, xquant, w13, inter, groups, blocks, top_k, up, scales, delta13)
    expand = has_delta and down_expands(numel, scales is not None)
    delta2 = call.down_delta(inter, a2, b2, scale, consts, down, scales is None, expand) if has_delta else None
    d2 = None
    if expand:   # beside the down GEMM; the top-k sum adds it
        d2 = ws.get("lora_d2", T * H, torch.float32, x.device).view(T, H)
        fork = Fork(x.device)
        with fork.side():
            call.down_expand(d2, delta2, weights)
    in_gemm = None if expand else delta2
    if groups is None:
        launch_gemm2(inter, w2, y, weights, blocks, down, top_k, in_gemm, scales)
    else:
        launch_gemm2(iq, w2, y, weights, blocks, down, top_k, in_gemm, scales, a_scale=is_)
    if expand:
        fork.join()
    if not sum_slots:
        return ExpertOutputs(y, d2)
    if top_k > 1 or d2 is not None:   # top-k 1: y is out, summed in place
        launch_sum(y, ids, out, pdl, d2)
    return out
