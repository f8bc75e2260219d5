"""Triton helpers shared by the kernels of several op folders: the device checks (Hopper or newer,
the CPU interpreter), the SM count, TMA descriptors, programmatic dependent launch, and the
@triton.jit pieces more than one kernel calls (weight tiles, FP8 ones scaled, FP8 x FP8 K steps; the
residual add, RMSNorm and SiLU-and-mul arithmetic, each rounded where torch rounds it).

Programmatic dependent launch (Hopper+): a decode step's small Triton kernels overlap their
launch with the kernel before them. A kernel launched with `launch_pdl=True` may start while the
previous kernel of the stream is still running, once all of that kernel's programs have started
and called `gdc_launch_dependents`. Each such kernel here begins with `pdl_wait`: it lets the next
kernel launch, then waits (`gdc_wait`) until the previous one has finished and its writes are
visible, and only then writes anything or reads what a kernel of the step may have written: the
weights (`preload_tiles`, the skinny GEMV's first tile) and what the host uploads before the step
(decode attention's lengths and slots) may be read before the wait, and what a kernel two back
wrote where the one between lets the next in only after its own wait (the one-token MoE down
GEMV reading the routing's expert ids). A kernel that does not take part
(cuBLAS, Inductor's) serialises as usual, before and after, and so ends any early start.
(Prefetching the next weights into L2 before the wait measured slower, per cache line and as bulk
TMA prefetches, and so did prefetching them from the decode attention's grid while DRAM idles;
the register loads before the wait measured faster; so did asking L2 for the decode attention's
first KV tile where that tile is a split's whole share: bench/RESULTS.md.)

`COMPILED_PDL=0` (read at import) turns it off; it is also off off-GPU, before Hopper and under
the Triton interpreter, where the flag is a compile-time False and the kernels are unchanged."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

import compiled.envs as envs

DEFAULT_NUM_SMS = 132  # an H100 / H200: what the heuristics assume without a CUDA device (the interpreter)
FP8_GEMV_CHUNK = 16    # FP8 products a GEMV sums before a scale multiply (`gemv_chunk`)
FP8_DOT_MIN_K = 32     # tl.dot on fp8 operands takes K tiles of 32 or more (Hopper's fp8 MMA)
# One-row FP8 GEMVs whose K range is at most MAX_PRELOAD steps and PRELOAD_THREAD_BYTES of weight a
# thread load it all, with its scales, before the PDL wait (`preload_tiles`): a program of an early
# launch streams its weights while the kernel before it runs (H200, bench/RESULTS.md).
MAX_PRELOAD = 4
PRELOAD_THREAD_BYTES = 384


# ----------------------------------------------------------------------------- the device

def hopper_or_newer(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer (TMA, programmatic dependent launch)."""
    return device.type == "cuda" and _capability(device.index)[0] >= 9


def fp8_convert_asm(device: torch.device) -> bool:
    """Whether kernels on `device` convert float8_e4m3fn to fp32 with the PTX conversion of two
    at once (`fp8_f32`): compute capability 8.9 or newer, not the interpreter (no inline PTX)."""
    return device.type == "cuda" and not interpreting() and _capability(device.index) >= (8, 9)


def fp8_dot_fits(block_k: int, scale_block_k: int) -> bool:
    """Whether K tiles of `block_k` can take fp8 x fp8 dots (W8A8) over a weight whose scale blocks
    are `scale_block_k` wide (the activations quantized in groups that wide): each tile inside one
    block, and at least FP8_DOT_MIN_K long."""
    return block_k >= FP8_DOT_MIN_K and scale_block_k % block_k == 0


def gemv_chunk(fp8_mode: int, block_width: int, block_k: int) -> int:
    """The runs of products an FP8 GEMV step sums before scaling them (`chunk_scaled_dots`): up to
    FP8_GEMV_CHUNK (a thread's 16-byte load of a row), a power of two dividing the scale block's
    width and the K step, where a tile takes a scale per row and block (`fp8_mode` 2,
    `quant.dequant.FP8_BLOCKS`); 1 (a scale an element) otherwise."""
    return math.gcd(FP8_GEMV_CHUNK, block_width, block_k) if fp8_mode == 2 else 1


def preload_fits(block_n: int, block_k: int, K: int, num_warps: int) -> int:
    """The K steps of an FP8 GEMV program (`block_n` rows, `block_k` a step) where they fit the
    preload (`MAX_PRELOAD`, `PRELOAD_THREAD_BYTES`), else 0."""
    steps = triton.cdiv(K, block_k)
    fits = steps <= MAX_PRELOAD and block_n * block_k * steps <= PRELOAD_THREAD_BYTES * 32 * num_warps
    return steps if fits else 0


def hopper(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.x (what cuBLAS's blockwise FP8 recipe runs on)."""
    return device.type == "cuda" and _capability(device.index)[0] == 9


def interpreting() -> bool:
    """Triton kernels run under the CPU interpreter (TRITON_INTERPRET, as Triton itself reads it)."""
    from triton import knobs
    return knobs.runtime.interpret


def interpreter_upcast(dtype: torch.dtype) -> bool:
    """Triton's CPU interpreter computes `tl.dot` on bf16 operands wrongly (as raw 16-bit
    integers), so under TRITON_INTERPRET=1 the kernels run their dots on bf16 data in fp32."""
    return dtype == torch.bfloat16 and interpreting()


def num_sms(device: torch.device, off_gpu: int = DEFAULT_NUM_SMS) -> int:
    """The CUDA device's SM count (cached); `off_gpu` for any other device (the interpreter)."""
    return _sm_count(device.index) if device.type == "cuda" else off_gpu


def tma_descriptor(x: torch.Tensor, block: list[int]):
    """A TMA tensor descriptor over the 2-D `x` with tiles of `block`, or None where TMA cannot
    take it: a 16-bit or float8_e4m3fn tensor with unit last stride and 16-byte aligned base and
    rows, on Hopper or newer (or the interpreter). Built per call: a small host object the
    launcher encodes, and caching it would keep freed tensors alive."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn) or x.dim() != 2 or x.stride(1) != 1:
        return None
    if (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        return None
    if not (hopper_or_newer(x.device) or interpreting()):
        return None
    return TensorDescriptor.from_tensor(x, block)


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def row_warps(block: int) -> int:
    """Warps for a program holding one row of `block` columns (a norm's row kernels)."""
    return max(1, min(16, block // 256))


# ----------------------------------------------------------------------------- programmatic dependent launch

@functools.cache
def pdl_enabled() -> bool:
    """COMPILED_PDL, read once at the first launch (unset: on)."""
    return envs.read("COMPILED_PDL") is not False


def use_pdl(device: torch.device) -> bool:
    """Whether launches on `device` use programmatic dependent launch."""
    return pdl_enabled() and not interpreting() and hopper_or_newer(device)


def launch_kwargs(device: torch.device) -> dict:
    """`PDL=` (the kernels' constexpr) and Triton's `launch_pdl=` for one launch on `device`."""
    on = use_pdl(device)
    return dict(PDL=on, launch_pdl=True) if on else dict(PDL=False)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one (no-ops when PDL is off)."""
    pdl_let_next_in(PDL)
    pdl_wait_only(PDL)


@triton.jit
def pdl_wait_only(PDL: tl.constexpr):
    """Wait for the previous kernel, letting the next one in later (`pdl_let_next_in`): for a
    kernel whose grid the early next one would crowd (the skinny GEMM with a prologue)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_let_next_in(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, nbytes: tl.constexpr, ok):
    """Ask L2 for `nbytes` (a multiple of 16) at each of `ptrs` (16-byte aligned) where `ok`:
    Hopper's bulk prefetch, a hint that costs the issuing thread no wait."""
    tl.inline_asm_elementwise(
        "{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n@p cp.async.bulk.prefetch.L2.global [$1], $3;\nmov.b32 $0, 0;\n}",
        "=r,l,r,r", [ptrs, ok.to(tl.int32), nbytes + tl.zeros_like(ok.to(tl.int32))],
        dtype=tl.int32, is_pure=False, pack=1)


# ----------------------------------------------------------------------------- @triton.jit pieces

@triton.jit
def tile_mask(mask_rows, mask_k, EVEN_K: tl.constexpr):
    """The mask of a `[rows, BLOCK_K]` tile; EVEN_K: rows only, none along K (the loads stay
    vectorised)."""
    return mask_rows[:, None] if EVEN_K else mask_rows[:, None] & mask_k[None, :]


@triton.jit
def weight_tile(w_ptrs, mask_n, mask_k, EVEN_K: tl.constexpr):
    """One `[BLOCK_N, BLOCK_K]` weight tile (`tile_mask`)."""
    return tl.load(w_ptrs, mask=tile_mask(mask_n, mask_k, EVEN_K), other=0.0, eviction_policy="evict_first")


@triton.jit
def fp8_f32(w, ASM: tl.constexpr):
    """A float8_e4m3fn tensor as fp32. ASM (`fp8_convert_asm`): four bytes a register, two at once
    to f16 pairs (exact), then each to fp32 (exact); the plain `.to` takes each byte out of its
    register and packs pairs back in first, which bounded the GEMVs by instructions, not bytes."""
    if ASM:
        out = tl.inline_asm_elementwise(
            """{
            .reg .b16 lo, hi;
            .reg .b32 p01, p23;
            .reg .f16 f0, f1, f2, f3;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 p01, lo;
            cvt.rn.f16x2.e4m3x2 p23, hi;
            mov.b32 {f0, f1}, p01;
            mov.b32 {f2, f3}, p23;
            cvt.f32.f16 $0, f0;
            cvt.f32.f16 $1, f1;
            cvt.f32.f16 $2, f2;
            cvt.f32.f16 $3, f3;
            }""",
            "=r,=r,=r,=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.float32, is_pure=True, pack=4)
    else:
        out = w.to(tl.float32)
    return out


@triton.jit
def scaled_tile(w, s_ptr, rows, cols, ok, stride_sn, BO, BI, dtype: tl.constexpr, FP8: tl.constexpr):
    """A weight tile as the dot reads it: w itself, or with FP8 (w float8_e4m3fn) w times its
    block scale `s_ptr[rows // BO, cols // BI]` gathered per element (rows and cols broadcast to
    the tile's shape, `ok` its loadable elements), rounded to `dtype` as the dequantized weight
    of the torch reference is. A gather per element serves partial edge blocks, per-channel and
    per-tensor scales alike; a tile's scales are a few cache lines."""
    # one return: a constexpr branch is compiled alone, but returns of two dtypes are refused
    if FP8:
        s = tl.load(s_ptr + (rows // BO) * stride_sn + cols // BI, mask=ok, other=0.0)
        tile = (w.to(tl.float32) * s.to(tl.float32)).to(dtype)
    else:
        tile = w
    return tile


@triton.jit
def row_scaled(w, s_ptr, rows, row_ok, k0, K, stride_sn, BO, BI, dtype: tl.constexpr, KB: tl.constexpr,
               ASM: tl.constexpr = False):
    """`scaled_tile` for a tile w `[R, BLOCK_K]` (weight rows `rows` down, K across from k0) with
    one scale per row and scale block (`quant.dequant.scale_tiling`): KB = 1, the tile inside one
    block; KB > 1, the tile KB whole blocks (BLOCK_K = KB * BI). R * KB scale loads a tile, not
    one per element. ASM: converted by `fp8_f32`'s PTX."""
    s = row_block_scales(s_ptr, rows, row_ok, k0, K, stride_sn, BO, BI, KB)
    if KB == 1:
        tile = (fp8_f32(w, ASM) * s[:, None]).to(dtype)
    else:
        w3 = tl.reshape(fp8_f32(w, ASM), (w.shape[0], KB, w.shape[1] // KB))
        tile = tl.reshape((w3 * s[:, :, None]).to(dtype), (w.shape[0], w.shape[1]))
    return tile


@triton.jit
def row_block_scales(s_ptr, rows, row_ok, k0, K, stride_sn, BO, BI, KB: tl.constexpr):
    """The fp32 scales of a tile whose K range starts at k0 (`row_scaled`'s tiling): KB = 1,
    `[R]`, one a row; KB > 1, `[R, KB]`, one a row and block the tile covers."""
    if KB == 1:
        s = tl.load(s_ptr + (rows // BO) * stride_sn + k0 // BI, mask=row_ok, other=0.0)
    else:
        kb = k0 // BI + tl.arange(0, KB)
        s = tl.load(s_ptr + (rows // BO)[:, None] * stride_sn + kb[None, :],
                    mask=row_ok[:, None] & (kb * BI < K)[None, :], other=0.0)
    return s.to(tl.float32)


@triton.jit
def chunk_scaled_dots(w, x, s_ptr, rows, row_ok, k0, K, stride_sn, BO, BI, KB: tl.constexpr, CHUNK: tl.constexpr):
    """A GEMV step over an FP8 tile w `[R, BLOCK_K]` (float8_e4m3fn, or fp32 as `fp8_f32` gave it;
    weight rows `rows` down, K across from k0, its scales as `row_scaled` takes them) and fp32 x
    `[BLOCK_K]`: `[R, BLOCK_K / CHUNK]`, each run of CHUNK products summed, then scaled by its
    block's scale, so a step takes one scale multiply a run instead of one an element and the
    accumulator is CHUNK times smaller. CHUNK divides the scale block and is what a thread holds of
    a row, so the sums stay in its registers."""
    return chunk_sums_scaled(w, x, row_block_scales(s_ptr, rows, row_ok, k0, K, stride_sn, BO, BI, KB), KB, CHUNK)


@triton.jit
def chunk_sums_scaled(w, x, s, KB: tl.constexpr, CHUNK: tl.constexpr):
    """`chunk_scaled_dots` with the tile's scales `s` already loaded (`row_block_scales`)."""
    R: tl.constexpr = w.shape[0]
    RUNS: tl.constexpr = w.shape[1] // CHUNK
    sums = tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], (R, RUNS, CHUNK)), axis=2)
    if KB == 1:
        out = sums * s[:, None]
    else:
        out = tl.reshape(tl.reshape(sums, (R, KB, RUNS // KB)) * s[:, :, None], (R, RUNS))
    return out


@triton.jit
def _raw_tile(w_ptrs, s_ptr, rows, row_ok, k0, k_end, K, stride_sn, BO, BI, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, KB: tl.constexpr):
    """One FP8 GEMV tile as loaded (float8_e4m3fn) and its row-block scales (`row_block_scales`)."""
    w = weight_tile(w_ptrs, row_ok, k0 + tl.arange(0, BLOCK_K) < k_end, EVEN_K)
    return w, row_block_scales(s_ptr, rows, row_ok, k0, K, stride_sn, BO, BI, KB)


@triton.jit
def preload_tiles(w_ptrs, s_ptr, rows, row_ok, k_start, k_end, K, stride_sn, BO, BI, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr, KB: tl.constexpr, STEPS: tl.constexpr):
    """A one-row FP8 GEMV's K range, loaded ahead (`preload_fits`): the STEPS (1 to MAX_PRELOAD)
    tiles of the weight rows `rows` from k_start (w_ptrs: the first tile's) and their scales
    (`_raw_tile`), as four (tile, scales) pairs, held as FP8 bytes; those past STEPS repeat the
    first and are never read. Triton has no list of tensors to loop over."""
    w0, s0 = _raw_tile(w_ptrs, s_ptr, rows, row_ok, k_start, k_end, K, stride_sn, BO, BI, BLOCK_K, EVEN_K, KB)
    w1, s1, w2, s2, w3, s3 = w0, s0, w0, s0, w0, s0
    if STEPS > 1:
        w1, s1 = _raw_tile(w_ptrs + BLOCK_K, s_ptr, rows, row_ok, k_start + BLOCK_K, k_end, K, stride_sn, BO, BI,
                           BLOCK_K, EVEN_K, KB)
    if STEPS > 2:
        w2, s2 = _raw_tile(w_ptrs + 2 * BLOCK_K, s_ptr, rows, row_ok, k_start + 2 * BLOCK_K, k_end, K, stride_sn, BO,
                           BI, BLOCK_K, EVEN_K, KB)
    if STEPS > 3:
        w3, s3 = _raw_tile(w_ptrs + 3 * BLOCK_K, s_ptr, rows, row_ok, k_start + 3 * BLOCK_K, k_end, K, stride_sn, BO,
                           BI, BLOCK_K, EVEN_K, KB)
    return w0, s0, w1, s1, w2, s2, w3, s3


@triton.jit
def preloaded_dots(x_ptr, w0, s0, w1, s1, w2, s2, w3, s3, k_start, k_end, BLOCK_K: tl.constexpr, KB: tl.constexpr,
                   CHUNK: tl.constexpr, FP8_ASM: tl.constexpr, EVEN_K: tl.constexpr, STEPS: tl.constexpr):
    """The row at x_ptr times the STEPS tiles `preload_tiles` gave: `[BLOCK_N, BLOCK_K / CHUNK]`,
    as `chunk_scaled_dots` sums them step by step."""
    acc = _preloaded_step(x_ptr, w0, s0, k_start, k_end, KB, CHUNK, FP8_ASM, EVEN_K)
    if STEPS > 1:
        acc += _preloaded_step(x_ptr, w1, s1, k_start + BLOCK_K, k_end, KB, CHUNK, FP8_ASM, EVEN_K)
    if STEPS > 2:
        acc += _preloaded_step(x_ptr, w2, s2, k_start + 2 * BLOCK_K, k_end, KB, CHUNK, FP8_ASM, EVEN_K)
    if STEPS > 3:
        acc += _preloaded_step(x_ptr, w3, s3, k_start + 3 * BLOCK_K, k_end, KB, CHUNK, FP8_ASM, EVEN_K)
    return acc


@triton.jit
def _preloaded_step(x_ptr, w, s, k0, k_end, KB: tl.constexpr, CHUNK: tl.constexpr, FP8_ASM: tl.constexpr,
                    EVEN_K: tl.constexpr):
    """One step of `preloaded_dots`: the row's slice from k0 times the tile w."""
    x = row_slice(x_ptr, k0 + tl.arange(0, w.shape[1]), k_end, EVEN_K)
    return chunk_sums_scaled(fp8_f32(w, FP8_ASM), x, s, KB, CHUNK)


@triton.jit
def row_slice(x_ptr, ks, k_end, EVEN_K: tl.constexpr):
    """A row's elements ks (those from k_end on read as 0), fp32; EVEN_K: no mask along K, which
    keeps the load vectorised."""
    if EVEN_K:
        x = tl.load(x_ptr + ks)
    else:
        x = tl.load(x_ptr + ks, mask=ks < k_end, other=0.0)
    return x.to(tl.float32)


@triton.jit
def col_scaled(w, s_ptr, cols, k0, stride_sn, BO, BI, dtype: tl.constexpr):
    """`scaled_tile` for a tile w `[BLOCK_K, BLOCK_N]` (K down, weight rows across) whose K range
    starting at k0 lies inside one scale block: one scale per weight row `cols` (every row valid),
    a vector load instead of a gather per element."""
    return (w.to(tl.float32) * col_scales(s_ptr, cols, k0, stride_sn, BO, BI)[None, :]).to(dtype)


@triton.jit
def col_scales(s_ptr, cols, k0, stride_sn, BO, BI):
    """The block scales `s_ptr[cols // BO, k0 // BI]` of the weight rows `cols` at K offset k0, fp32."""
    return tl.load(s_ptr + (cols // BO) * stride_sn + k0 // BI).to(tl.float32)


@triton.jit
def w8a8_rows(offs_nw, pid_n, BLOCK_N: tl.constexpr, ONE_SCALE: tl.constexpr):
    """The weight rows whose block scales a W8A8 tile reads (`w8a8_scales`): its rows `offs_nw`, or
    with ONE_SCALE (the tile inside one block) its first row alone."""
    rows = offs_nw
    if ONE_SCALE:
        rows = (pid_n * BLOCK_N).to(tl.int64)
    return rows


@triton.jit
def w8a8_scales(as_ptr, s_ptr, cols, k0, stride_sn, BO, BI):
    """The scales of one K step of an FP8 x FP8 GEMM from k0: the rows' activation group scales
    (`as_ptr`, one pointer a row, at group 0) and the weight rows `cols`' block scales (`s_ptr`,
    `col_scales`; `cols` one row: the block's one scale), fp32. Kernels load them a step ahead of
    their dot, so that a step does not wait for them."""
    return tl.load(as_ptr + k0 // BI).to(tl.float32), col_scales(s_ptr, cols, k0, stride_sn, BO, BI)


@triton.jit
def w8a8_step(acc, a, w, sa, sw, PRECISION: tl.constexpr, ONE_SCALE: tl.constexpr):
    """acc + one K step of an FP8 x FP8 GEMM: a `[M, BLOCK_K]` (activations quantized per token
    and group, `sa` the rows' group scales) times w `[BLOCK_K, BLOCK_N]` (a weight tile inside one
    scale block, `sw` its columns' scales, ONE_SCALE: the tile's one scale; `w8a8_scales`),
    products exact and summed in fp32 on the tensor cores, then scaled by both."""
    if ONE_SCALE:
        scale = (sa * sw)[:, None]
    else:
        scale = sa[:, None] * sw[None, :]
    return acc + tl.dot(a, w, input_precision=PRECISION) * scale


@triton.jit
def w8a8_step_t(acc_t, a, w, sa, sw, PRECISION: tl.constexpr, ONE_SCALE: tl.constexpr):
    """`w8a8_step` into the transposed accumulator acc_t `[BLOCK_N, M]`: the weight tile is the
    MMA's wide side, so a few rows still fill Hopper's 64-row warpgroup MMA."""
    if ONE_SCALE:
        scale = (sa * sw)[None, :]
    else:
        scale = sw[:, None] * sa[None, :]
    return acc_t + tl.dot(tl.trans(w), tl.trans(a), input_precision=PRECISION) * scale


@triton.jit
def residual_add(x, d):
    """x + d rounded to x's dtype, as torch's add of two 16-bit tensors rounds it."""
    return (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)


@triton.jit
def weighted_rows(h, nw):
    """What a GEMM with an RMSNorm prologue multiplies for the rows h (the residual stream after
    its add): h * norm_weight rounded to h's dtype, its rows' 1 / rms applied to the product
    afterwards; and the rows' sums of squares of h for that 1 / rms (the skinny GEMM and the LoRA
    shrink share it, so that the shrink reads what the GEMM reads)."""
    hf = h.to(tl.float32)
    return (hf * nw.to(tl.float32)[None, :]).to(h.dtype), tl.sum(hf * hf, axis=1)


@triton.jit
def rms_normed(h, rstd, nw):
    """`functional.rms_norm`'s output (fp32, not yet rounded to h's dtype) from h, its 1 / rms and
    the norm weight, broadcast to h's shape by the caller: h * rstd is rounded before the weight."""
    return nw.to(tl.float32) * (h.to(tl.float32) * rstd).to(h.dtype).to(tl.float32)


@triton.jit
def silu_mul(g, u):
    """silu(gate) * up, each result rounded as torch's F.silu(gate) * up rounds it."""
    gf = g.to(tl.float32)
    s = (gf * tl.sigmoid(gf)).to(g.dtype)
    return (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype)


@triton.jit
def add_rms_norm_row(x, d, NW, H, NORMED, cols, mask, K, eps):
    """One row's residual add + RMSNorm from its tiles x and d (masked lanes 0): stores h = x + d
    at H and RMSNorm(h) * norm weight at NORMED (pointers to the row's start)."""
    h, normed = add_rms_norm_values(x, d, NW, cols, mask, K, eps)
    tl.store(H + cols, h, mask=mask)
    tl.store(NORMED + cols, normed, mask=mask)


@triton.jit
def add_rms_norm_values(x, d, NW, cols, mask, K, eps):
    """(h = x + d, RMSNorm(h) * norm weight), both rounded to x's dtype, for one row's tiles."""
    h = residual_add(x, d)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / K + eps)
    nw = tl.load(NW + cols, mask=mask, other=0.0)
    return h, rms_normed(h, rstd, nw).to(x.dtype)


@triton.jit
def masked_dot_t(acc, x_ptrs, a_ptrs, rows, cols, k_start, k_end, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """`acc + x[rows, k_start:k_end] @ a[cols, k_start:k_end].T` in BLOCK_K steps, `x_ptrs` /
    `a_ptrs` pointing at the first K element of each row; masked rows and columns read zeros
    (the LoRA shrinks of the linear and the MoE share it). EVEN_K: the range is whole blocks."""
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = (k0 + offs_k) < k_end
        x = tl.load(x_ptrs, mask=tile_mask(rows, k_ok, EVEN_K), other=0.0)
        a = tl.load(a_ptrs, mask=tile_mask(cols, k_ok, EVEN_K), other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    return acc


@triton.jit
def split_k_store(acc, o_ptrs, part_ptrs, split_stride, mask, sem, pid_k, SPLIT_K: tl.constexpr):
    """Store a K-split reduction's `acc` at o_ptrs: at once when SPLIT_K is 1; else as split
    pid_k's fp32 partial (at part_ptrs + pid_k * split_stride), bumping the group's semaphore `sem`,
    and the last split to arrive sums the partials in split order (deterministic), stores the
    sum and puts the semaphore back to 0 (the LoRA shrinks' scheme)."""
    if SPLIT_K == 1:
        tl.store(o_ptrs, acc, mask=mask)
    else:
        tl.store(part_ptrs + pid_k * split_stride, acc, mask=mask)
        tl.debug_barrier()   # every thread's partial store before the release below
        if tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for sp in tl.static_range(SPLIT_K):   # .cg: from L2, never a stale L1 line
                total += tl.load(part_ptrs + sp * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(o_ptrs, total, mask=mask)
            tl.atomic_xchg(sem, 0)


@triton.jit
def slot_stacked_delta(acc, S_IN, B, SCALE, slots, rows, cols, cols_ok, expert, col0, R,
                       stride_s, stride_bs, stride_be, stride_bc, stride_scale, scale_col,
                       SLOTS_PAD: tl.constexpr, BLOCK_R: tl.constexpr, KC: tl.constexpr,
                       PRECISION: tl.constexpr, LOW_PRECISION: tl.constexpr):
    """acc + each row's LoRA expand: scale[s, scale_col] * S_IN[rows, col0:col0+R] @
    B[s, expert, cols, :R].T, s the row's slot (-1: none). Rows that all share one slot (every
    prefill block of one request) take one dot of K = BLOCK_R; mixed rows take dots over the
    slots stacked along K (k = s * BLOCK_R + r): the rows' shrink outputs go into a `[rows, KC]`
    tile that is zero outside each row's own slot block, every slot's B rows into a `[KC, cols]`
    tile (slots absent from the block masked, so not read, found from one bit mask of the rows'
    slots where S <= 32): the loads of all slots go out at once. LOW_PRECISION:
    the dot in B's 16-bit dtype, else in fp32 at PRECISION (the linear and the MoE expands share it)."""
    lo = tl.min(tl.where(slots >= 0, slots, SLOTS_PAD), axis=0)
    if lo == tl.max(slots, axis=0):
        _, sr, sc, b = one_slot_operands(S_IN, B, SCALE, slots, rows, cols, cols_ok, expert, col0, R, stride_s,
                                         stride_bs, stride_be, stride_bc, stride_scale, scale_col, SLOTS_PAD,
                                         BLOCK_R)
        acc = one_slot_dot(acc, sr, sc, b, PRECISION, LOW_PRECISION)
    else:
        acc = _stacked_delta(acc, S_IN, B, SCALE, slots, rows.to(tl.int64), cols.to(tl.int64), cols_ok, expert, col0,
                             R, stride_s, stride_bs, stride_be, stride_bc, stride_scale, scale_col, SLOTS_PAD, BLOCK_R,
                             KC, PRECISION, LOW_PRECISION)
    return acc


@triton.jit
def one_slot_dot(acc, sr, sc, b, PRECISION: tl.constexpr, LOW_PRECISION: tl.constexpr):
    """acc + (sr * sc) @ b: the rows' shrink outputs `[rows, BLOCK_R]` times their one slot's scale
    and B `[BLOCK_R, cols]` (in b's 16-bit dtype with LOW_PRECISION, else fp32 at PRECISION)."""
    if LOW_PRECISION:
        return tl.dot((sr * sc).to(b.dtype), b, acc)
    return tl.dot(sr * sc, b.to(tl.float32), acc, input_precision=PRECISION)


@triton.jit
def one_slot_operands(S_IN, B, SCALE, slots, rows, cols, cols_ok, expert, col0, R, stride_s, stride_bs, stride_be,
                      stride_bc, stride_scale, scale_col, SLOTS_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """The loads of `slot_stacked_delta` where the rows with an adapter share one slot, which a
    GEMM may load before its K loop and consume after it (`one_slot_dot`): (whether they share
    one, their shrink outputs, that slot's scale, its B tile). Where they do not (several slots,
    or none), nothing is read but the scale of slot 0."""
    lo = tl.min(tl.where(slots >= 0, slots, SLOTS_PAD), axis=0)
    hi = tl.max(slots, axis=0)
    one = lo == hi
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    # (vector masks built without broadcasting a scalar bool: the interpreter rejects those)
    mine = (slots == lo) & ((slots * 0 + lo) == hi)
    sr = tl.load(S_IN + rows.to(tl.int64)[:, None] * stride_s + (col0 + r)[None, :], mask=mine[:, None] & r_ok[None, :],
                 other=0.0)
    slot = lo % SLOTS_PAD
    sc = tl.load(SCALE + slot * stride_scale + scale_col)
    b_ok = cols_ok & ((cols * 0 + lo) == hi)
    b = tl.load(B + slot.to(tl.int64) * stride_bs + expert * stride_be + cols.to(tl.int64)[None, :] * stride_bc
                + r[:, None], mask=r_ok[:, None] & b_ok[None, :], other=0.0)
    return one, sr, sc, b


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def slot_bits(slots):
    """The slots present among `slots` (-1: none) as one int32 bit mask (slots below 32)."""
    return tl.reduce(tl.where(slots >= 0, tl.full(slots.shape, 1, tl.int32) << slots, 0), 0, _bit_or)


@triton.jit
def _stacked_delta(acc, S_IN, B, SCALE, slots, rows64, cols64, cols_ok, expert, col0, R, stride_s, stride_bs,
                   stride_be, stride_bc, stride_scale, scale_col, SLOTS_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                   KC: tl.constexpr, PRECISION: tl.constexpr, LOW_PRECISION: tl.constexpr):
    """`slot_stacked_delta` for rows of several slots: the stacked dots, KC of K each."""
    if SLOTS_PAD <= 32:   # the slots present as one bit mask: one reduction for every chunk
        bits = slot_bits(slots)
    for c in tl.static_range(SLOTS_PAD * BLOCK_R // KC):
        k = c * KC + tl.arange(0, KC)
        slot_k = k // BLOCK_R
        r = k % BLOCK_R
        r_ok = r < R
        hit = slots[:, None] == slot_k[None, :]
        if SLOTS_PAD <= 32:
            present = ((bits >> slot_k) & 1) != 0
        else:
            present = tl.sum(hit.to(tl.int32), axis=0) > 0
        sr = tl.load(S_IN + rows64[:, None] * stride_s + (col0 + r)[None, :], mask=hit & r_ok[None, :], other=0.0)
        sc = tl.load(SCALE + slot_k * stride_scale + scale_col, mask=present, other=0.0)
        b = tl.load(B + slot_k.to(tl.int64)[:, None] * stride_bs + expert * stride_be + cols64[None, :] * stride_bc
                    + r[:, None], mask=(present & r_ok)[:, None] & cols_ok[None, :], other=0.0)
        if LOW_PRECISION:
            acc = tl.dot((sr * sc[None, :]).to(b.dtype), b, acc)
        else:
            acc = tl.dot(sr * sc[None, :], b.to(tl.float32), acc, input_precision=PRECISION)
    return acc


@triton.jit
def row_shrink(x, A, OUT, SLOT, row, cols, in_cols, S, NR, stride_as, stride_an, stride_ot, n_lo,
               N_PER: tl.constexpr):
    """`lora_shrink` of one row x (its tile, columns `cols` of K) for outputs n_lo .. n_lo + N_PER
    (those below NR): OUT[row, n] = sum_k x[k] A[slot, n, k] in fp32 FMAs, zeros where the row has
    no adapter (whose A is not read)."""
    slot = tl.load(SLOT + row).to(tl.int32)
    n = n_lo + tl.arange(0, N_PER)
    in_n = n < NR
    slots = slot + tl.zeros_like(n)   # a vector: the interpreter takes no scalar in a mask
    live = in_n & (slots >= 0) & (slots < S)
    a = tl.load(A + tl.where(live, slots, 0).to(tl.int64)[:, None] * stride_as + n.to(tl.int64)[:, None] * stride_an
                + cols[None, :], mask=live[:, None] & in_cols[None, :], other=0.0)
    tl.store(OUT + row * stride_ot + n, tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1), mask=in_n)
