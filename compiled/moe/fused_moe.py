"""Fused MoE over stacked expert weights: the body of `compiled::fused_moe` without expert LoRA, its
torch reference and Triton path (`library.py` registers the op).

Weights are stacked by the graph pass: `w13 [E, 2I, H]` (gate rows first, then up) and
`w2 [E, H, I]`. The op takes the routing (`compiled::topk_route`'s fp32 weights and int64 ids) and
returns `[T, H]` in x's dtype. On CUDA it runs the Triton kernels of `fused_moe_kernels.py`: sort the
(token, slot) pairs by expert and pad each expert's segment to BLOCK_M, grouped GEMM over `w13` with
`silu(gate) * up` in its epilogue, grouped GEMM over `w2` with the routing weight in its epilogue,
sum over the top-k. No host syncs and fixed-size buffers, so it can be captured in a CUDA graph.
One token runs as two GEMVs instead (`gemv_kernels.py`: no 16-row tensor-core tile for one live
row). FP8 experts (`ExpertScales`) are scaled in the kernels' K loops (W8A16); where the tuned
entry says W8A8 (or, where it says neither, from W8A8_MIN_TOKENS on) and the K tiles fit the scale
blocks, the grouped GEMMs run W8A8 instead: x and then the intermediate's rows in use quantized per
token and scale block (`quant.act_quant`; x by spare programs of the alignment's launch, the
intermediate by the up GEMM's epilogue where its N tiles hold whole blocks), fp8 x fp8 dots.
Expert-LoRA calls (`expert_lora.py`) run W8A8 in 16-row tiles where the base would, their deltas in
the epilogues, else W8A16.

Kernel configs come from `tuned_configs.py` (the tuned files, FP8 experts' own, the defaults).
`BACKEND` ('auto': Triton on CUDA, the reference elsewhere; from `COMPILED_MOE_BACKEND`, read at
import, or the engine config) set to 'torch' or 'triton' forces a path."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton

from compiled.backend import BackendChoice
from compiled.functional import add_rms_norm_ref
from compiled.moe.experts import expert_loop
from compiled.moe.routing import Routed, expert_pad, route_args, route_into
from compiled.moe.tuned_configs import SWAP_KEY, get_config, get_gemv_tiles, split_config, tuned_mode
from compiled.quant.act_quant import QuantizedRows, quant_grid, quantize_per_token_group, row_quantizable
from compiled.quant.dequant import FP8_BLOCKS, FP8_W8A8, FP8_W8A8_TILE, fit_block_k, kernel_scale, resolve_block
from compiled.triton_utils import (FP8_DOT_MIN_K, fp8_convert_asm, fp8_dot_fits, gemv_chunk, interpreting,
                                   launch_kwargs, preload_fits, row_warps, tma_descriptor)

# Where a tuned entry does not name its mode: FP8 experts at this many tokens or more run the
# grouped GEMMs W8A8 (activations quantized to FP8 per token and scale block, fp8 x fp8 dots on
# the tensor cores); fewer stay W8A16, where the quantization passes cost more than the dots save.
# `bench/tune_moe.py` times both modes and writes the faster into each entry.
W8A8_MIN_TOKENS = 256


# ----------------------------------------------------------------------------- reference

def fused_moe_ref(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x `[T, H]`, topk `[T, k]`, w13 `[E, 2I, H]`, w2 `[E, H, I]` -> `[T, H]` in x's dtype.

    HF's expert loop (transformers' Qwen3MoeExperts, eager): per expert, `linear(h, w13[e])` split
    into gate/up, `silu(gate) * up`, `linear(., w2[e])`, times the weight cast to x's dtype, added
    into the output in x's dtype in expert order. One host sync (the per-expert counts)."""
    I = w2.shape[2]

    def expert(e: int, h: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(h, w13[e]).split(I, dim=-1)
        return F.linear(F.silu(gate) * up, w2[e])
    return expert_loop(x, topk_weights, topk_ids, w13.shape[0], expert)


# ----------------------------------------------------------------------------- Triton path

def max_padded_size(numel: int, E: int, block_m: int) -> int:
    """Upper bound of the padded pair count: every expert that gets a pair pads < BLOCK_M rows."""
    return numel + min(E, numel) * (block_m - 1)


def intermediate_rows(numel: int, E: int, block_m: int) -> int:
    """Rows of gemm1's output: BLOCK_M for every block."""
    return triton.cdiv(max_padded_size(numel, E, block_m), block_m) * block_m


# Up to this many pairs every program of the place kernel counts all of them itself (no count
# kernel, no atomics): a few steps of one-hot sums, less than a launch of its own.
COUNT_ALL_MAX_PAIRS = 128


def _align_chunk(numel: int) -> int:
    """Pairs per program of the alignment kernels: 32 a program (more beyond 256 programs). Short
    programs won: `moe_bench.py --sweep-align` on the H200, 64 tokens x top-8: 7.5 µs with 32
    pairs a program against 13.4 with 128."""
    if numel <= COUNT_ALL_MAX_PAIRS:
        return max(16, min(32, triton.next_power_of_2(numel)))
    return max(32, triton.next_power_of_2(triton.cdiv(numel, 256)))


@dataclass
class MoEWorkspace:
    """Optional preallocated scratch for `fused_moe_triton` (reused across calls on one stream).

    Buffers grow on demand; pass `max_tokens` to size them once up front (before capture)."""
    buffers: dict = field(default_factory=dict)

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[name] = buf
        return buf[:numel]

    def reserve(self, max_tokens: int, E: int, H: int, I: int, top_k: int, dtype: torch.dtype,
                device: torch.device, block_m: int = 128) -> "MoEWorkspace":
        numel = max_tokens * top_k
        self.get("sorted", max_padded_size(numel, E, block_m) + block_m, torch.int32, device)
        self.get("experts", triton.cdiv(max_padded_size(numel, E, 16), 16), torch.int32, device)
        e_pad = expert_pad(E)
        self.get("totals", e_pad, torch.int32, device)
        self.get("bases", triton.cdiv(numel, _align_chunk(numel)) * e_pad, torch.int32, device)
        self.get("post", 1, torch.int32, device)
        self.get("inter", intermediate_rows(numel, E, block_m) * I, dtype, device)
        self.get("y", numel * H, dtype, device)
        return self


@dataclass(frozen=True)
class AlignLaunch:
    """Launch shape of the alignment kernels: pairs per program (one program: no count kernel),
    pairs per step inside it, blocks per step of the block loop, warps."""
    chunk: int
    sub: int
    bb: int
    warps: int = 4


def align_launch(numel: int, E: int, block_m: int) -> AlignLaunch:
    chunk = _align_chunk(numel)
    return AlignLaunch(chunk=chunk, sub=min(chunk, 32), bb=min(64, 4096 // max(block_m, expert_pad(E))))


class Blocks(NamedTuple):
    """The (token, slot) pairs sorted by expert into BLOCK_M blocks (`moe_align_block_size`)."""
    sorted_ids: torch.Tensor   # int32 [P]: pair indices (token * k + slot); padding rows hold T*k
    expert_ids: torch.Tensor   # int32 [P / BLOCK_M]: each block's expert, -1 past num_post
    num_post: torch.Tensor     # int32 [1]: the padded pair count
    block_m: int               # BLOCK_M: the blocks' height (a down GEMM's tile may be a divisor of it)


def moe_align_block_size(topk_ids: torch.Tensor, E: int, block_m: int, workspace: MoEWorkspace | None = None,
                         launch: AlignLaunch | None = None,
                         quantize: tuple[torch.Tensor, QuantizedRows] | None = None,
                         route: Routed | None = None) -> Blocks:
    """Sort (token, slot) pairs by expert, padding each expert's segment to a multiple of block_m.

    The buffers are sized by the fixed bound P = `max_padded_size`. Inside an expert's segment,
    pairs of one chunk keep their order and chunks come in arrival order (atomics); nothing
    downstream depends on that order. No host sync. `launch` overrides `align_launch` (benchmark
    sweeps). `quantize` (x `[T, K]`, where to): the place kernel's launch also quantizes x (W8A8's
    up GEMM operand), in programs of its own. `route`: topk_ids (and its weights) are to be
    routed from its logits first: by the count kernel where `routes_in_align`, else by the
    routing kernel before it."""
    from compiled.moe import fused_moe_kernels as K

    ws = workspace or MoEWorkspace()
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    numel = ids.numel()
    max_pad = max_padded_size(numel, E, block_m)
    max_blocks = triton.cdiv(max_pad, block_m)
    sorted_ids = ws.get("sorted", max_blocks * block_m, torch.int32, dev)
    expert_ids = ws.get("experts", max_blocks, torch.int32, dev)
    num_post = ws.get("post", 1, torch.int32, dev)
    e_pad = expert_pad(E)
    lc = launch or align_launch(numel, E, block_m)
    n_chunks = triton.cdiv(numel, lc.chunk)
    count_all = triton.cdiv(numel, lc.sub) * lc.sub if numel <= COUNT_ALL_MAX_PAIRS or n_chunks == 1 else 0
    if route is not None and not routes_in_align(route, lc, count_all):
        route_into(*route)
        route = None
    r_args, r_consts = _route_launch(route, ids)
    totals = done = bases = num_post  # unused when the place kernel counts
    reset = False
    if not count_all:
        bases = ws.get("bases", n_chunks * e_pad, torch.int32, dev)
        # totals kept at zero between calls by the place kernel (see RESET); a memset otherwise
        totals, done = zeroed(dev, "align_totals", e_pad, torch.int32), zeroed(dev, "align_done", 1, torch.int32)
        reset = totals is not None and done is not None
        if not reset:
            totals = ws.get("totals", e_pad, torch.int32, dev)
            totals.zero_()
        K.align_count_kernel[(n_chunks,)](ids, totals, bases, numel, *r_args, CHUNK=lc.chunk, SUB=lc.sub, E_PAD=e_pad,
                                          **r_consts, num_warps=lc.warps, **launch_kwargs(dev))
    q, q_programs = _quant_launch(quantize, ids)
    K.align_place_kernel[(n_chunks + q_programs,)](
        ids, totals, bases, done if reset else num_post, sorted_ids, expert_ids, num_post, numel, max_blocks, n_chunks,
        *q["args"], BLOCK_M=block_m, CHUNK=lc.chunk, SUB=lc.sub, E_PAD=e_pad, BB=lc.bb, COUNT_ALL=count_all,
        RESET=reset, **q["consts"], num_warps=lc.warps, **launch_kwargs(dev))
    return Blocks(sorted_ids, expert_ids, num_post, block_m)


# The routing inside the alignment's count kernel: R_ROWS tokens a step (the routing kernel's rows
# up to 128 experts; each step's k rounds of max and argmin are a serial chain, kept short).
ROUTE_ROWS = 4


def routes_in_align(route: Routed, lc: AlignLaunch, count_all: int) -> bool:
    """Whether the alignment routes `route` itself: where its count kernel runs (above
    COUNT_ALL_MAX_PAIRS pairs) and each program's chunk holds whole tokens. Where the place
    kernel counts all pairs instead, each of its programs would route every token, a serial
    chain of k reductions a token that measured slower than the routing kernel's own launch, as
    did routing inside the one-token up GEMV (bench/RESULTS.md)."""
    return not count_all and lc.chunk % route.router.top_k == 0


def _route_launch(route: Routed | None, like: torch.Tensor) -> tuple[tuple, dict]:
    """The alignment kernels' routing arguments (RL, RW, T, E, stride, first, count) and constexprs;
    without `route`, placeholders (`like`) never read."""
    if route is None:
        return ((like, like, 0, 0, 0, 0, 0),
                dict(ROUTE=False, TOP_K=1, K_PAD=2, RENORM=False, LOCAL=False, R_ROWS=ROUTE_ROWS))
    args, consts = route_args(route.router)
    consts.pop("E_PAD")   # passed as the alignment's own, the same `expert_pad`
    return (route.router.logits, route.weights, *args), dict(ROUTE=True, R_ROWS=ROUTE_ROWS, **consts)


def _quant_launch(quantize: tuple[torch.Tensor, QuantizedRows] | None, like: torch.Tensor) -> tuple[dict, int]:
    """The place kernel's x-quantization arguments (`act_quant.quant_grid`'s tiles) and the
    programs they add; without `quantize`, none, and placeholders (`like`) it never reads."""
    if quantize is None:
        return dict(args=(like, like, like, 0, 0, 0, 0, 0, 0, 1, 1),
                    consts=dict(QUANT=False, Q_ROWS=1, Q_GROUPS=1, Q_BLOCK_G=16)), 0
    x, (xq, xs, group) = quantize
    if x.stride(1) != 1 or xq.stride(1) != 1:
        raise ValueError("moe_align_block_size: the x to quantize and its fp8 buffer need unit last strides")
    T, K = x.shape
    qg = quant_grid(T, K, group)
    args = (x, xq, xs, T, K, x.stride(0), xq.stride(0), xs.stride(0), xs.stride(1), group, qg.group_programs)
    consts = dict(QUANT=True, Q_ROWS=qg.rows, Q_GROUPS=qg.groups, Q_BLOCK_G=qg.block_g)
    return dict(args=args, consts=consts), qg.row_programs * qg.group_programs


def weight_desc(w: torch.Tensor, block_n: int, block_k: int):
    """A TMA descriptor over the stacked weight `w [E, R, K]` seen as `[E * R, K]`, block
    `[block_n, block_k]`, or None where TMA cannot take it (see `tma_descriptor`)."""
    return tma_descriptor(w.view(-1, w.shape[-1]), [block_n, block_k]) if w.is_contiguous() else None


@dataclass(frozen=True)
class GemmDelta:
    """A grouped GEMM's per-pair LoRA delta (`expert_lora.py`): the shrink outputs `s` (rows in
    block order, or with `by_pair` (the up GEMM only) in pair order), the slots' B `[S, E, out, R]`
    and scales `[S, 3]`, each token's slot `[T]`, and the kernels' delta constants (SLOTS_PAD,
    BLOCK_R, KC, DELTA_PRECISION, DELTA_16BIT). `in_k` (the down GEMM only): the delta as the K
    loop's last steps, `s` already scaled and in the GEMM operands' dtype. `expanded` (with
    `by_pair`): `s` holds the deltas themselves, `[T*k, out]` fp32, which the GEMM adds as they are."""
    s: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor
    slot: torch.Tensor
    consts: dict
    by_pair: bool = False
    in_k: bool = False
    expanded: bool = False

    def pair_rows(self) -> int:
        """The up GEMM's PAIR_ROWS: 0 shrink outputs by position, 1 by pair, 2 deltas by pair."""
        return 2 if self.expanded else int(self.by_pair)


@dataclass(frozen=True)
class ExpertScales:
    """FP8 experts (w13 and w2 float8_e4m3fn): their block scales `[E, rows / bo, cols / bi]` at
    `block` [bo, bi] (a side of 0: the whole dim), read by the kernels' K loops."""
    w13: torch.Tensor
    w2: torch.Tensor
    block: tuple[int, int] | list[int]


def fp8_kwargs(scales: ExpertScales | None, name: str, w: torch.Tensor, block_k: int, gemv: bool = False,
               w8a8: bool = False, block_n: int = 0) -> dict:
    """A kernel's scale arguments for the stacked weight `w` (`name`: w13 or w2) read in K tiles
    of `block_k`: its block scale's pointer, strides, block sides and FP8 mode
    (`quant.dequant.scale_tiling`; the grouped GEMMs' tiles take one block at most, the GEMVs'
    `gemv` several, KB; `w8a8`: FP8_W8A8, whose tiles must each lie inside one block, or
    FP8_W8A8_TILE where every `block_n`-wide N tile, w13's up half's too, lies inside one); without
    `scales`, placeholders the kernels compiled with FP8=0 never read."""
    if scales is None:
        return dict(S=w, stride_se=0, stride_sn=0, BO=1, BI=1, FP8=0, **({"KB": 1} if gemv else {}))
    ks = kernel_scale(getattr(scales, name), scales.block, w.shape[1], w.shape[2], block_k, many=gemv)
    mode = ks.mode
    if w8a8:
        if (ks.mode, ks.kb) != (FP8_BLOCKS, 1) or block_k < FP8_DOT_MIN_K:
            raise ValueError(f"fused_moe: W8A8 needs K tiles of {FP8_DOT_MIN_K} or more inside the scale blocks "
                             f"of {name}; got BLOCK_K {block_k} for the block width {ks.bi}")
        n = w.shape[1] // 2 if name == "w13" else 0   # the up rows start at n
        mode = FP8_W8A8_TILE if block_n and ks.bo % block_n == 0 and n % ks.bo == 0 else FP8_W8A8
    return dict(S=ks.scale, stride_se=ks.scale.stride(0), stride_sn=ks.scale.stride(1), BO=ks.bo, BI=ks.bi,
                FP8=mode, **({"KB": ks.kb} if gemv else {}))


def _act_kwargs(a_scale: torch.Tensor | None, like: torch.Tensor) -> dict:
    """The grouped kernels' activation scales (W8A8: `[rows, groups]` fp32), or a placeholder."""
    if a_scale is None:
        return dict(AS=like, stride_as=0)
    return dict(AS=a_scale, stride_as=a_scale.stride(0))


def w8a8_entry(T: int, tuned: bool | None) -> bool:
    """Whether the tuned entry for T tokens (its mode `tuned`, `tuned_configs.tuned_mode`) is one
    the base FP8 experts run W8A8 with: it says so, or it says nothing and T >= W8A8_MIN_TOKENS."""
    return T >= W8A8_MIN_TOKENS if tuned is None else tuned


def w8a8_groups(scales: ExpertScales | None, w13: torch.Tensor, w2: torch.Tensor, T: int, up: dict,
                down: dict, tuned: bool | None = None) -> tuple[int, int] | None:
    """The activations' group widths (w13's and w2's scale block widths) where the grouped GEMMs
    run W8A8: FP8 experts, the tuned entry's mode (`tuned`, `tuned_configs.tuned_mode`) or where
    it says none T >= W8A8_MIN_TOKENS, and K tiles (`fp8_block_k`) of FP8_DOT_MIN_K or more that
    each lie inside one scale block of both weights; else None (W8A16)."""
    if scales is None or not w8a8_entry(T, tuned):
        return None
    groups = []
    for w, cfg in ((w13, up), (w2, down)):
        bi = resolve_block(scales.block, w.shape[1], w.shape[2])[1]
        bk = fit_block_k(bi, cfg["BLOCK_SIZE_K"])
        if not fp8_dot_fits(bk, bi):
            return None
        groups.append(bi)
    return groups[0], groups[1]


def fp8_block_k(scales: ExpertScales | None, w: torch.Tensor, block_k: int) -> int:
    """A grouped GEMM's K tile over the FP8 weight `w` (`quant.dequant.fit_block_k`)."""
    if scales is None:
        return block_k
    return fit_block_k(resolve_block(scales.block, w.shape[1], w.shape[2])[1], block_k)


def _delta_args(delta: GemmDelta | None, like: torch.Tensor) -> tuple[tuple, dict]:
    """The grouped kernels' LoRA arguments and constants; without a delta, placeholders the
    kernel compiled with LORA=False never reads."""
    if delta is None:
        return ((like,) * 4 + (0,) * 6,
                dict(LORA=False, SLOTS_PAD=1, BLOCK_R=16, KC=16, DELTA_PRECISION="ieee", DELTA_16BIT=False,
                     DELTA_FIRST=False))
    s, b = delta.s, delta.b
    return ((s, b, delta.scale, delta.slot, b.shape[0], b.shape[3], s.stride(0), b.stride(0), b.stride(1),
             b.stride(2)), dict(LORA=True, **delta.consts))


def _check_w8a8(op: str, a_scale: torch.Tensor | None, scales: ExpertScales | None,
                delta: GemmDelta | None) -> None:
    if a_scale is not None and (scales is None or (delta is not None and delta.in_k)):
        raise ValueError(f"{op}: a_scale (W8A8) needs FP8 experts (scales) and no LoRA delta in the K loop")


def launch_gemm1(x: torch.Tensor, w13: torch.Tensor, inter: torch.Tensor, blocks: Blocks, top_k: int,
                  cfg: dict, delta: GemmDelta | None = None, scales: ExpertScales | None = None,
                  a_scale: torch.Tensor | None = None,
                  quantized_out: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> None:
    """inter (block order) <- silu(gate) * up for every pair of `blocks`; x `[T, H]`; with
    `delta`, each pair's gate and up LoRA deltas added before silu; with `scales`, w13 is FP8;
    with `a_scale` too (W8A8), x is float8_e4m3fn and `a_scale` its group scales
    (`quant.act_quant`, groups of w13's block width). `quantized_out` (iq, is_, group): the rows
    written quantized per token in `group`-wide groups instead (float8_e4m3fn `iq` shaped like
    inter, fp32 scales `is_` `[rows, I / group]`), for a W8A8 gemm2, and with `delta` into inter
    as well (its down shrink's input); BLOCK_SIZE_N a multiple of group."""
    from compiled.moe import fused_moe_kernels as K
    _check_w8a8("launch_gemm1", a_scale, scales, delta)
    if quantized_out is not None and cfg["BLOCK_SIZE_N"] % quantized_out[2]:
        raise ValueError(f"launch_gemm1: quantized_out needs BLOCK_SIZE_N ({cfg['BLOCK_SIZE_N']}) a multiple of its "
                         f"group ({quantized_out[2]})")
    iq, is_, group = quantized_out or (inter, inter, 0)
    I, H = w13.shape[1] // 2, w13.shape[2]
    bn, bk = cfg["BLOCK_SIZE_N"], fp8_block_k(scales, w13, cfg["BLOCK_SIZE_K"])
    grid = (blocks.expert_ids.numel() * triton.cdiv(I, bn),)
    # W8A16's FP8 tiles are scaled after their pointer loads: no TMA for them; W8A8's go to the dot as loaded
    desc = weight_desc(w13, bn, bk) if cfg.get("TMA") and (scales is None or a_scale is not None) else None
    lora_args, lora_consts = _delta_args(delta, w13)
    K.moe_gemm1_kernel[grid](
        x, w13, desc, inter, blocks.sorted_ids, blocks.expert_ids, blocks.num_post, x.shape[0] * top_k, I, H,
        x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        TOP_K=top_k, **_dot_flags(x.dtype),
        BLOCK_M=cfg["BLOCK_SIZE_M"], BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_SIZE_M"],
        EVEN_K=H % bk == 0, HALF_M=cfg["HALF_M"], TMA=desc is not None, **lora_consts,
        PAIR_ROWS=0 if delta is None else delta.pair_rows(),
        **fp8_kwargs(scales, "w13", w13, bk, w8a8=a_scale is not None, block_n=bn), **_act_kwargs(a_scale, x),
        IQ=iq, IS=is_, stride_iq=iq.stride(0), stride_is=is_.stride(0), OUT_GROUP=group,
        SWAP=bool(cfg.get(SWAP_KEY, 0)) and a_scale is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_kwargs(x.device),
        **dict(zip(_LORA_ARGS, lora_args)))


def launch_w8a8_gemm1(xq: torch.Tensor, xs: torch.Tensor, w13: torch.Tensor, inter: torch.Tensor,
                      quantized: tuple[torch.Tensor, torch.Tensor, int], blocks: Blocks, top_k: int, cfg: dict,
                      scales: ExpertScales, delta: GemmDelta | None = None) -> None:
    """W8A8's up GEMM (x quantized: `xq`, `xs`; `delta` as `launch_gemm1`'s) with the intermediate
    quantized for the down GEMM into `quantized` (iq, is_, group): by the up GEMM's epilogue where
    its N tiles hold whole groups, else by a pass after it over the rows of the blocks in use,
    padding rows too (their products are never stored; the buffer's rows past them, sized for the
    worst spread over the experts, are never read)."""
    iq, is_, group = quantized
    if cfg["BLOCK_SIZE_N"] % group == 0:
        launch_gemm1(xq, w13, inter, blocks, top_k, cfg, delta, scales, a_scale=xs, quantized_out=quantized)
        return
    launch_gemm1(xq, w13, inter, blocks, top_k, cfg, delta, scales, a_scale=xs)
    quantize_per_token_group(inter, group, out=iq, scale_out=is_, live_rows=blocks.num_post)


def align_quantized(ws: MoEWorkspace, x: torch.Tensor, ids: torch.Tensor, E: int, block_m: int,
                    groups: tuple[int, int] | None,
                    route: Routed | None = None) -> tuple[Blocks, QuantizedRows | None]:
    """`moe_align_block_size` into the workspace (routing `route` first); where the grouped GEMMs
    run W8A8 (`groups`), x quantized by the same launch into the workspace's `x_q` / `x_s`
    (groups[0] wide). The op and its LoRA variant both run it."""
    if groups is None:
        return moe_align_block_size(ids, E, block_m, ws, route=route), None
    into = QuantizedRows(*quantized_buffers(ws, "x", x, groups[0]), groups[0])
    return moe_align_block_size(ids, E, block_m, ws, quantize=(x, into), route=route), into


def quantized_gemm1(ws: MoEWorkspace, xquant: QuantizedRows, w13: torch.Tensor, inter: torch.Tensor,
                    groups: tuple[int, int], blocks: Blocks, top_k: int, cfg: dict, scales: ExpertScales,
                    delta: GemmDelta | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's up GEMM from x quantized (`align_quantized`), `launch_w8a8_gemm1` with the
    intermediate quantized (groups[1] wide) into the workspace; returns (iq, is_), what the W8A8
    down GEMM reads. The op and its LoRA variant both run it."""
    xq, xs = xquant.q, xquant.s
    iq, is_ = quantized_buffers(ws, "inter", inter, groups[1])
    launch_w8a8_gemm1(xq, xs, w13, inter, (iq, is_, groups[1]), blocks, top_k, cfg, scales, delta)
    return iq, is_


def launch_gemm2(inter: torch.Tensor, w2: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, blocks: Blocks,
                  cfg: dict, top_k: int = 1, delta: GemmDelta | None = None,
                  scales: ExpertScales | None = None, a_scale: torch.Tensor | None = None) -> None:
    """y `[T*k, H]` <- each pair's routing weight (`weights`, `[T*k]`) times its row of inter . w2
    (plus, with `delta`, its down LoRA delta; `top_k` maps the pairs to their tokens' slots; with
    `scales`, w2 is FP8, and a delta must not run in the K loop; with `a_scale` too (W8A8), inter
    is float8_e4m3fn and `a_scale` its rows' group scales)."""
    from compiled.moe import fused_moe_kernels as K
    _check_w8a8("launch_gemm2", a_scale, scales, delta)
    H, I = w2.shape[1], w2.shape[2]
    bm, bn, bk = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], fp8_block_k(scales, w2, cfg["BLOCK_SIZE_K"])
    if blocks.block_m % bm or (delta is not None and bm != blocks.block_m):
        raise ValueError(f"launch_gemm2: BLOCK_SIZE_M={bm} must divide the blocks' height {blocks.block_m} "
                         f"(and equal it with a LoRA delta)")
    grid = (blocks.expert_ids.numel() * triton.cdiv(H, bn),)
    if scales is not None and delta is not None and delta.in_k:
        raise ValueError("launch_gemm2: an FP8 w2 takes its LoRA delta in the epilogue, not in the K loop")
    desc = weight_desc(w2, bn, bk) if cfg.get("TMA") and (scales is None or a_scale is not None) else None
    # The intermediate's full-height tiles through TMA wherever the weights' go.
    a_desc = tma_descriptor(inter, [bm, bk]) if cfg.get("TMA") else None
    lora_args, lora_consts = _delta_args(delta, w2)
    K.moe_gemm2_kernel[grid](
        inter, a_desc, w2, desc, y, weights, blocks.sorted_ids, blocks.expert_ids, blocks.num_post, weights.numel(),
        H, I, inter.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        **_dot_flags(inter.dtype),
        BLOCK_M=bm, EXPERT_BLOCK_M=blocks.block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_SIZE_M"],
        EVEN_K=I % bk == 0, HALF_M=cfg["HALF_M"], TMA=desc is not None, A_TMA=a_desc is not None,
        TOP_K=top_k, **lora_consts, DELTA_IN_K=delta is not None and delta.in_k,
        R_FULL=delta is not None and delta.b.shape[3] == lora_consts["BLOCK_R"],
        **fp8_kwargs(scales, "w2", w2, bk, w8a8=a_scale is not None, block_n=bn), **_act_kwargs(a_scale, inter),
        SWAP=bool(cfg.get(SWAP_KEY, 0)) and a_scale is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_kwargs(inter.device),
        **dict(zip(_LORA_ARGS, lora_args)))


# The grouped kernels' LoRA operands, by name (`_delta_args` gives them in this order).
_LORA_ARGS = ("L_S", "L_B", "L_SCALE", "L_SLOT", "L_NS", "L_R", "stride_ls", "stride_lbs", "stride_lbe", "stride_lbn")


# Buffers the kernels keep at zero between launches (they restore them): the alignment's
# per-expert totals and arrival counter. Each is allocated once per device, zeroed, and only ever
# replaced by a larger one outside CUDA graph capture; replaced buffers stay alive because
# captured graphs hold their addresses.
MIN_ZEROED = 1 << 16
_ZEROED: dict[tuple[torch.device, str], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def zeroed(device: torch.device, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    """At least `numel` zeros of `dtype` that the kernel using them leaves at zero, or None when
    the buffer would have to grow inside a capture (the caller then takes another path)."""
    buf = _ZEROED.get((device, name))
    if buf is not None and buf.numel() >= numel and buf.dtype == dtype:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if buf is not None:
        _RETIRED.append(buf)
    buf = _ZEROED[(device, name)] = torch.zeros(max(numel, MIN_ZEROED), dtype=dtype, device=device)
    return buf


@dataclass(frozen=True)
class MoECall:
    """One call's launch plan: its operands, contiguous (x `[T, H]`, the pairs' routing weights
    `[T*k]` in fp32 and experts `[T, k]`, the stacked weights), the workspace its scratch comes
    from, and y, where the down GEMM(V) writes the weighted expert outputs: `[T*k, H]` for the
    top-k sum after it, or the output itself for top-1."""
    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    ws: MoEWorkspace
    y: torch.Tensor
    scales: ExpertScales | None = None

    @property
    def top_k(self) -> int:
        return self.ids.shape[1]

    def inter(self, rows: int) -> torch.Tensor:
        """The workspace's intermediate (silu(gate) * up), `[rows, I]`."""
        I = self.w2.shape[2]
        return self.ws.get("inter", rows * I, self.x.dtype, self.x.device).view(rows, I)


def quantized_buffers(ws: MoEWorkspace, name: str, a: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The workspace's `{name}_q` and `{name}_s`: `a [rows, K]` quantized per token in groups of
    `group` (W8A8) goes there."""
    rows, K = a.shape
    G = triton.cdiv(K, group)
    return (ws.get(name + "_q", rows * K, torch.float8_e4m3fn, a.device).view(rows, K),
            ws.get(name + "_s", rows * G, torch.float32, a.device).view(rows, G))


def _plan(x, topk_weights, topk_ids, w13, w2, ws: MoEWorkspace, out: torch.Tensor | None,
          scales: ExpertScales | None) -> MoECall:
    numel, H = topk_ids.numel(), x.shape[1]
    x = x.contiguous()
    y = out if topk_ids.shape[1] == 1 else ws.get("y", numel * H, x.dtype, x.device).view(numel, H)
    return MoECall(x, topk_weights.contiguous().reshape(-1), topk_ids.contiguous(), w13.contiguous(),
                   w2.contiguous(), ws, y, scales)


def _launch_gemv(call: MoECall, tiles: dict) -> None:
    """One token: y `[k, H]` <- its k weighted expert outputs, through the intermediate `[k, I]`.
    Where the down GEMV's FP8 K range fits the preload (`preload_fits`), it reads it before its
    wait, the up GEMV letting it in once the ids are written."""
    from compiled.moe import gemv_kernels as G
    x, w13, w2 = call.x, call.w13, call.w2
    H, I = w2.shape[1], w2.shape[2]
    k = call.ids.numel()
    ids = call.ids.reshape(-1)
    inter = call.inter(k)
    up = _gemv_kwargs(call.scales, "w13", w13, tiles["up"])
    down = _gemv_kwargs(call.scales, "w2", w2, tiles["down"])
    pdl = launch_kwargs(x.device)
    preload = preload_fits(down["BLOCK_N"], down["BLOCK_K"], I, down["num_warps"]) if down["CHUNK"] > 1 else 0
    G.moe_gemv_up_kernel[(k * triton.cdiv(I, up["BLOCK_N"]),)](
        x, w13, ids, inter, I, H, w13.stride(0), w13.stride(1), inter.stride(0), EVEN_K=H % up["BLOCK_K"] == 0,
        LET_IN_AFTER_WAIT=preload > 0, **up, **pdl)
    G.moe_gemv_down_kernel[(k * triton.cdiv(H, down["BLOCK_N"]),)](
        inter, w2, ids, call.weights, call.y, H, I, inter.stride(0), w2.stride(0), w2.stride(1), call.y.stride(0),
        EVEN_K=I % down["BLOCK_K"] == 0, PRELOAD=preload, **down, **pdl)


def _gemv_kwargs(scales: ExpertScales | None, name: str, w: torch.Tensor, tile: dict) -> dict:
    """A one-token GEMV's tile and scale arguments: the tile's columns, K step, warps and stages;
    FP8 ones as `fp8_kwargs` gives them, with the runs of products scaled at once (`gemv_chunk`)
    and the PTX conversion where the device has it."""
    fp8 = fp8_kwargs(scales, name, w, tile["BLOCK_K"], gemv=True)
    return dict(BLOCK_N=tile["BLOCK_N"], BLOCK_K=tile["BLOCK_K"], num_warps=tile["num_warps"],
                STAGES=tile.get("num_stages", 1), num_stages=1, FP8_ASM=scales is not None and fp8_convert_asm(w.device),
                CHUNK=gemv_chunk(fp8["FP8"], fp8["BI"], tile["BLOCK_K"]), **fp8)


def _launch_grouped(call: MoECall, config: dict, route: Routed | None = None) -> None:
    """Two tokens or more: the pairs sorted by expert into BLOCK_M blocks (`route`: routed
    first), gemm1 into the intermediate (each block's rows at its offset: `intermediate_rows`),
    gemm2 into y."""
    up, down = split_config(config)
    block_m = up["BLOCK_SIZE_M"]
    groups = w8a8_groups(call.scales, call.w13, call.w2, call.x.shape[0], up, down, tuned_mode(config))
    blocks, xquant = align_quantized(call.ws, call.x, call.ids, call.w13.shape[0], block_m, groups, route)
    inter = call.inter(blocks.expert_ids.numel() * block_m)
    if groups is None:
        launch_gemm1(call.x, call.w13, inter, blocks, call.top_k, up, scales=call.scales)
        launch_gemm2(inter, call.w2, call.y, call.weights, blocks, down, call.top_k, scales=call.scales)
        return
    iq, is_ = quantized_gemm1(call.ws, xquant, call.w13, inter, groups, blocks, call.top_k, up, call.scales)
    launch_gemm2(iq, call.w2, call.y, call.weights, blocks, down, call.top_k, scales=call.scales, a_scale=is_)


def launch_sum(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, pdl: dict | None = None,
               delta: torch.Tensor | None = None) -> None:
    """out `[T, H]` <- each token's top-k sum of y `[T*k, H]` (`moe_sum_kernel`), the pairs of id
    < 0 (ids `[T, k]`, contiguous) left out; plus `delta` `[T, H]` fp32 where given."""
    from compiled.moe import fused_moe_kernels as K
    T, H = out.shape
    bh = min(1024, triton.next_power_of_2(H))
    K.moe_sum_kernel[(T, triton.cdiv(H, bh))](y, ids, y if delta is None else delta, out, H, TOP_K=ids.shape[1],
                                              BLOCK_H=bh, DELTA=delta is not None, num_warps=4,
                                              **(pdl if pdl is not None else launch_kwargs(y.device)))


def moe_sum_add_rms_norm_ref(pairs: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             ids: torch.Tensor | None = None, delta: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, normed) from gemm2's weighted expert outputs `pairs [T*k, H]`: their top-k sum in fp32
    (with `ids [T, k]`, of the pairs of id >= 0 only; plus `delta` `[T, H]` fp32 where given),
    rounded to x's dtype (as the sum kernel stores it), then `add_rms_norm_ref(x, sum)`."""
    T, H = x.shape
    pairs = pairs.view(T, -1, H).float()
    if ids is not None:
        pairs = torch.where((ids >= 0)[:, :, None], pairs, 0.0)
    total = pairs.sum(1) if delta is None else delta + pairs.sum(1)
    return add_rms_norm_ref(x, total.to(x.dtype), norm_weight, eps)


# The norm kernel's LoRA shrink of the next linear (`moe_sum_add_rms_norm_triton`): a program
# takes one token and `shrink_outputs_a_program` of the shrink's outputs, all its A rows in one
# [outputs, 2,048] tile. H100, the 30B's qkv (3 x rank 16), µs a call against the norm kernel and
# the shrink's own launch at 1 / 64 tokens, CUDA graphs of 50 calls (`bench/norm_lora_bench.py`):
# 2.35 / 7.52 against 3.23 / 7.93 (16 outputs a program, 8 rows a step: 3.76 / 8.65).
SHRINK_MAX_OUTPUTS_A_PROGRAM = 8


def shrink_outputs_a_program(T: int) -> int:
    """One output a program at one token (the shrink's GEMV mode spreads one row likewise),
    SHRINK_MAX_OUTPUTS_A_PROGRAM above: fewer programs re-read the experts' outputs."""
    return 1 if T == 1 else SHRINK_MAX_OUTPUTS_A_PROGRAM


def moe_sum_add_rms_norm_triton(pairs: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                shrink: tuple[torch.Tensor, torch.Tensor] | None = None,
                                ids: torch.Tensor | None = None,
                                quantize: QuantizedRows | None = None,
                                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The reference's contract in one launch (`moe_sum_add_rms_norm_kernel`); x's last dim
    contiguous; `delta` as the reference's, contiguous. `shrink` (a `[S, NR, H]` with its last dim
    contiguous, slot `[T]`): also the next linear's LoRA shrink of normed, `lora_shrink(normed, a,
    slot)` `[T, NR]` fp32, as a third output. `ids` (the routing's `[T, k]`): the pairs of id < 0
    are left out of the sum; None: none is. `quantize`: normed also quantized into its buffers
    (`quantize_row`), a power-of-two group dividing H's power of two."""
    from compiled.moe import fused_moe_kernels as K
    T, H = x.shape
    if quantize is not None and not row_quantizable(H, quantize.group):
        raise ValueError(f"moe_sum_add_rms_norm_triton: quantize needs a power-of-two group dividing "
                         f"{triton.next_power_of_2(H)}, got group {quantize.group}")
    xq, xs, group = quantize if quantize is not None else (x, x, 0)   # x: placeholders never read
    top_k = pairs.shape[0] // T if T else 1
    ids = ids.contiguous() if ids is not None else torch.zeros((T, top_k), dtype=torch.int64, device=x.device)
    h, normed = x.new_empty((T, H)), x.new_empty((T, H))
    if shrink is None:   # the shrink's arguments are never read (one kernel variant at every T)
        a, slot, s, n_per, splits, args = x, x, x, 1, 1, (0, 0, 0, 0)
    else:
        a, slot = shrink
        s = torch.empty((T, a.shape[1]), dtype=torch.float32, device=x.device)
        n_per = shrink_outputs_a_program(T)
        splits, args = triton.cdiv(a.shape[1], n_per), (a.shape[0], a.shape[1], a.stride(0), a.stride(1))
    if T:
        block = triton.next_power_of_2(H)
        K.moe_sum_add_rms_norm_kernel[(T, splits)](
            pairs, ids, pairs if delta is None else delta, x, norm_weight, h, normed, H, eps, x.stride(0), a, s, slot,
            *args, xq, xs, xq.stride(0), xs.stride(0), xs.stride(1), TOP_K=top_k, BLOCK_H=block,
            SHRINK=shrink is not None, N_PER=n_per, GROUP=group, DELTA=delta is not None, num_warps=row_warps(block),
            **launch_kwargs(x.device))
    return (h, normed) if shrink is None else (h, normed, s)


def _dot_flags(dtype: torch.dtype) -> dict:
    """fp32 stays fp32 (no tf32); under the CPU interpreter 16-bit operands are upcast for tl.dot.
    FP8 operands (W8A8) go to tl.dot as they are, on the GPU and under the interpreter (whose fp8
    dot is exact); "tf32", tl.dot's default, is ignored for them."""
    if dtype == torch.float8_e4m3fn:
        return dict(PRECISION="tf32", DOT_FP32=False)
    interp = interpreting()
    fp32 = dtype == torch.float32 or interp
    return dict(PRECISION="ieee" if fp32 else "tf32", DOT_FP32=interp and dtype != torch.float32)


def _check_shapes(x, topk_weights, topk_ids, w13, w2) -> None:
    T, H = x.shape
    E, I = w13.shape[0], w2.shape[2]
    assert w13.shape == (E, 2 * I, H) and w2.shape == (E, H, I), (x.shape, w13.shape, w2.shape)
    assert topk_weights.shape == topk_ids.shape == (T, topk_ids.shape[1])


def fused_moe_triton(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     w13: torch.Tensor, w2: torch.Tensor, config: dict | None = None,
                     workspace: MoEWorkspace | None = None, out: torch.Tensor | None = None,
                     sum_slots: bool = True, gemv_tiles: dict | None = None,
                     scales: ExpertScales | None = None, route: Routed | None = None) -> torch.Tensor:
    """The Triton path of `compiled::fused_moe`: one token as two GEMVs (`gemv_tiles`, else the
    tuned file's or GEMV_TILES), more as the two grouped GEMMs (`config`, else the tuned or default
    config; FP8 experts' own file first), then the top-k sum as a kernel of its own.
    `sum_slots=False` (top-k > 1): returns the weighted expert outputs `[T*k, H]` unsummed, for a
    kernel after it to sum them (`moe_sum_add_rms_norm_triton`); `out` is then unused. `scales`:
    the experts are FP8. `route`: topk_weights and topk_ids are its buffers, filled before anything
    reads them: by the alignment's count kernel where it runs (`routes_in_align`), else by the
    routing kernel first."""
    _check_shapes(x, topk_weights, topk_ids, w13, w2)
    T, H = x.shape
    top_k = topk_ids.shape[1]
    if sum_slots:
        if out is None:
            out = torch.empty_like(x)
        assert out.is_contiguous() and out.shape == x.shape, "fused_moe_triton: out must be a contiguous [T, H]"
    elif top_k == 1:   # the unsummed outputs go to the workspace's y; no [T, H] output is allocated
        raise ValueError("fused_moe_triton: sum_slots=False needs top-k > 1")
    if T == 0:
        return out if sum_slots else x.new_empty((0, H))
    call = _plan(x, topk_weights, topk_ids, w13, w2, workspace or MoEWorkspace(), out, scales)
    fp8 = scales is not None
    if T == 1:
        if route is not None:
            route_into(*route)
        _launch_gemv(call, gemv_tiles or get_gemv_tiles(w13.shape[0], w2.shape[2], x.dtype, x.device, fp8))
    else:
        if top_k == 1:   # the down GEMM writes the placed pairs' rows only: another rank's stay zero
            out.zero_()
        _launch_grouped(call, config if config is not None else get_config(T, w13.shape[0], w2.shape[2], x.dtype,
                                                                            x.device, fp8), route)
    if not sum_slots:
        return call.y
    if top_k > 1:
        launch_sum(call.y, call.ids, out)
    return out


# ----------------------------------------------------------------------------- the backend

BACKEND = BackendChoice("COMPILED_MOE_BACKEND")


def backend(x: torch.Tensor) -> str:
    """'triton' or 'torch': BACKEND's choice, where 'auto' is Triton on CUDA."""
    if BACKEND.name == "auto":
        return "triton" if x.is_cuda else "torch"
    return BACKEND.name
