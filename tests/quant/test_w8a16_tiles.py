"""The W8A16 GEMM's tiles: forced configs (split K, narrow column blocks, K tiles over several
scale blocks) and the heuristic's own against F.linear in fp32 over the dequantized weight (its
W8A8 configs: with x quantized per token as well), on CPU under TRITON_INTERPRET=1 (one
subprocess, as tests/quant/test_fp8_kernel.py); the heuristic's choices on the 30B's shapes; a
forced config's validation; the FP8 GEMV tiles of the skinny GEMM."""

from __future__ import annotations

import json
import os

import pytest
import torch
import triton

from compiled.linear import fp8_kernels as fk
from compiled.linear import skinny_kernels as lk
from compiled.linear.fp8_kernels import W8A16Config
from compiled.quant.config import QuantConfig
from compiled.quant.dequant import dequantize_blocks, quantize, resolve_block
from tests.conftest import child_env

# (name, M, N, K, scale block, dtype, forced config or None: the heuristic's)
CASES = [("split3_narrow_block128", 37, 53, 300, (128, 128), torch.float32, W8A16Config(16, 16, 64, 3)),
         ("split4_gather_block16x24", 37, 53, 300, (16, 24), torch.float32, W8A16Config(64, 32, 16, 4)),
         ("split2_many_blocks16x8", 20, 33, 130, (16, 8), torch.float32, W8A16Config(32, 16, 32, 2, 4, 2)),
         ("narrow_unsplit_block128", 19, 45, 200, (128, 128), torch.float32, W8A16Config(32, 16, 128, 1)),
         ("split2_bf16_block128", 21, 40, 520, (128, 128), torch.bfloat16, W8A16Config(32, 16, 128, 2)),
         ("heuristic_splits_block128", 20, 48, 2048, (128, 128), torch.float32, None),
         ("a8_split3_partial_k_block128", 37, 53, 300, (128, 128), torch.float32, W8A16Config(16, 16, 128, 3, a8=True)),
         ("a8_blocks16x64_k32", 20, 48, 256, (16, 64), torch.float32, W8A16Config(32, 32, 32, 2, 4, 2, a8=True)),
         ("a8_bf16_k64_block128", 19, 45, 200, (128, 128), torch.bfloat16, W8A16Config(32, 16, 64, 1, a8=True)),
         ("a8_per_channel_split2", 33, 40, 256, (1, 0), torch.float32, W8A16Config(64, 16, 64, 2, a8=True)),
         ("a8_swap_split2_block128", 10, 70, 300, (128, 128), torch.float32,
          W8A16Config(16, 64, 128, 2, a8=True, swap=True)),
         ("a8_swap_bf16_blocks32x64", 3, 40, 200, (32, 64), torch.bfloat16, W8A16Config(16, 32, 64, 1, a8=True, swap=True)),
         # whole K tiles (no K masks), one weight scale a tile; ragged rows and columns
         ("a8_even_k_one_scale_split2", 45, 200, 512, (128, 128), torch.float32, W8A16Config(64, 64, 128, 2, a8=True)),
         ("a8_swap_even_k_one_scale", 7, 90, 256, (32, 64), torch.float32,
          W8A16Config(16, 32, 64, 2, a8=True, swap=True))]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}   # relative to the output's largest value


def w8a16_case(M: int, N: int, K: int, block: tuple, dtype: torch.dtype, config: W8A16Config | None) -> dict:
    """The kernel's output against the reference, the config it ran, and the workspace's semaphores
    (all back at 0) after it."""
    from compiled.linear import workspace
    g = torch.Generator().manual_seed(M * N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) / K ** 0.5
    # (1, 0): one scale a row (compressed-tensors per channel), the whole of K one block
    q, s = quantize(w, QuantConfig("fp8", "channel") if block == (1, 0) else QuantConfig("fp8", "block", block))
    group = resolve_block(list(block), N, K)[1]
    ref = torch.nn.functional.linear(a8_rows(x.to(dtype), group) if config and config.a8 else x.to(dtype).float(),
                                     dequantize_blocks(q, s, list(block), torch.float32))
    y = fk.w8a16_linear(x.to(dtype), q, s, list(block), config)
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    if config and config.a8:   # x quantized by a kernel before (the norm's), passed in
        from compiled.quant.act_quant import QuantizedRows, quantize_per_token_group
        pre = QuantizedRows(*quantize_per_token_group(x.to(dtype), group), group)
        y = fk.w8a16_linear(x.to(dtype), q, s, list(block), config, quantized=pre)
        err = max(err, ((y.float() - ref).abs().max() / ref.abs().max()).item())
    ran = config or fk.w8a16_config(M, N, K, fk.num_sms(x.device), resolve_block(list(block), N, K)[1])
    ws = workspace.allocated(lk.SKINNY_KERNEL, x.device)
    return dict(err=err, tol=TOL[dtype], config=list(ran),
                dtype=str(y.dtype), semaphores_clear=ws is None or not ws.semaphores.any().item())


def a8_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as a W8A8 GEMM sees it (the oracle of `a8` configs): quantized per token in groups, fp32."""
    from compiled.quant.act_quant import dequantize_per_token_group, quantize_per_token_group_ref
    return dequantize_per_token_group(*quantize_per_token_group_ref(x, group), group, torch.float32)


@pytest.fixture(scope="module")
def interpreted():
    from tests.linear.test_linear_kernel import run_interpreted
    return run_interpreted(__file__)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_interpreted_w8a16_matches_dequantized_reference(interpreted, name):
    r = interpreted[name]
    case = next(c for c in CASES if c[0] == name)
    assert r["err"] <= r["tol"] and r["semaphores_clear"] and r["dtype"] == str(case[5]), r
    if case[6] is None:   # the heuristic split K and narrowed the columns at this short grid
        assert r["config"][3] > 1 and r["config"][1] == fk.MIN_BLOCK, r


def programs(cfg: W8A16Config, M: int, N: int) -> int:
    return triton.cdiv(N, cfg.block_n) * triton.cdiv(M, cfg.block_m) * cfg.split_k


@pytest.mark.parametrize("sms", [132, 78])
@pytest.mark.parametrize("M", [17, 32, 64])
@pytest.mark.parametrize("N, K", [(5120, 2048), (2048, 4096)])   # the 30B's qkv and o_proj
def test_heuristic_fills_the_gpu_on_the_30b_shapes(M, N, K, sms):
    """Row tiles of 32 take the short tiles (K steps of two scale blocks) and fill half the SMs;
    of 64, one block a K step, all the SMs."""
    cfg = fk.w8a16_config(M, N, K, sms, 128)
    short = cfg.block_m <= fk.SHORT_TILE_M
    assert programs(cfg, M, N) >= (sms // 2 if short else sms), cfg
    assert cfg.block_m == max(16, triton.next_power_of_2(M)) and cfg.block_n >= fk.MIN_BLOCK
    assert cfg.block_k == (fk.SHORT_BLOCK_K if short else 128)
    assert triton.cdiv(K, cfg.split_k * cfg.block_k) >= fk.MIN_K_STEPS
    assert fk.fits_workspace(cfg.split_k, M, N, cfg.block_m, cfg.block_n)
    fk.check_config(cfg, M, N)


def test_heuristic_keeps_the_plain_tile_where_the_grid_is_full():
    """qkv at 64 rows (160 column blocks) and o_proj at 256 (4 row tiles x 64) fill 132 SMs unsplit."""
    assert fk.w8a16_config(64, 5120, 2048, 132, 128) == W8A16Config(64, fk.BLOCK_N, 128, 1)
    assert fk.w8a16_config(256, 2048, 4096, 132, 128) == W8A16Config(64, fk.BLOCK_N, 128, 1)
    o64 = fk.w8a16_config(64, 2048, 4096, 132, 128)
    assert o64.split_k > 1 and o64.block_n == fk.BLOCK_N   # split first: no more x re-reads
    assert fk.w8a16_config(64, 2048, 4096, 132, 0).block_k == 128   # one block across K
    assert fk.w8a16_config(20, 48, 200, 132, 24).block_k == 16      # fitted down, not below 16
    assert fk.w8a16_config(32, 2048, 4096, 132, 0).block_k == fk.SHORT_BLOCK_K   # inside the one block


def test_heuristic_runs_w8a8_past_short_tiles_on_gpus_with_fp8_dots():
    """64 rows and more on a GPU with FP8 tensor cores: the same tiles, W8A8; 32 rows, no FP8
    dots, or K tiles too short for them (a 24-wide scale block): W8A16."""
    for M, N, K in ((64, 5120, 2048), (64, 2048, 4096), (256, 2048, 4096)):
        a8 = fk.w8a16_config(M, N, K, 132, 128, fp8_dots=True)
        assert a8.a8 and a8 == fk.w8a16_config(M, N, K, 132, 128)._replace(a8=True), a8
    assert not fk.w8a16_config(32, 5120, 2048, 132, 128, fp8_dots=True).a8
    assert not fk.w8a16_config(64, 48, 200, 132, 24, fp8_dots=True).a8


def test_short_tiles_split_only_a_grid_short_of_half_the_sms():
    """32 rows: qkv's 80 column blocks run unsplit on 132 SMs, o_proj's 32 split K in 4."""
    assert fk.w8a16_config(32, 5120, 2048, 132, 128) == W8A16Config(32, 64, 256, 1, 4, fk.SHORT_STAGES)
    assert fk.w8a16_config(32, 2048, 4096, 132, 128) == W8A16Config(32, 64, 256, 4, 4, fk.SHORT_STAGES)


def test_x_quantized_in_front_takes_swapped_w8a8_tiles_up_to_short_tiles():
    """2-32 rows with x quantized in front on a GPU with FP8 dots: W8A8, the dots swapped,
    SWAP_BLOCK_N columns, K split until SWAP_PROGRAMS_PER_SM programs an SM (qkv's 80 column blocks
    in 4, o_proj's 32 in 8); not without FP8 dots, nor past the short tiles."""
    assert fk.w8a16_config(8, 5120, 2048, 132, 128, True, True) == W8A16Config(16, 64, 128, 4, a8=True, swap=True)
    assert fk.w8a16_config(8, 2048, 4096, 132, 128, True, True) == W8A16Config(16, 64, 128, 8, a8=True, swap=True)
    assert fk.w8a16_config(20, 5120, 2048, 132, 128, True, True).block_m == 32
    assert not fk.w8a16_config(8, 5120, 2048, 132, 128, False, True).swap
    assert fk.w8a16_config(64, 5120, 2048, 132, 128, True, True) == fk.w8a16_config(64, 5120, 2048, 132, 128, True)
    for M in (1, 2, 32, 33):
        assert fk.swap_rows(M, torch.device("cpu")) is False   # no FP8 tensor cores here


def test_swap_rows_are_two_to_short_tiles_on_gpus_with_fp8_dots(monkeypatch):
    """One row keeps the GEMV, past SHORT_TILE_M rows the plain W8A8 tiles (as on a Hopper GPU)."""
    monkeypatch.setattr(fk, "hopper_or_newer", lambda device: True)
    assert [M for M in range(0, 70) if fk.swap_rows(M, torch.device("cpu"))] == list(range(2, fk.SHORT_TILE_M + 1))


@pytest.mark.parametrize("config, message", [
    (W8A16Config(16, 64, 128, swap=True), "swap=True needs a8=True"),
    (W8A16Config(64, 24, 128), "block_n=24 must be a power of two >= 16"),
    (W8A16Config(64, 32, 8), "block_k=8 must be a power of two >= 16"),
    (W8A16Config(0, 32, 128), "block_m=0 must be a power of two >= 16"),
    (W8A16Config(64, 32, 128, 0), "split_k=0 with M=64, N=40 needs 1 <= split_k"),
    (W8A16Config(64, 32, 128, 1, 3), "num_warps=3 must be a power of two from 1 to 16"),
    (W8A16Config(64, 32, 128, 1, 4, 0), "num_stages=0 must be an int >= 1"),
    (W8A16Config(64, 32, 16, 1, a8=True), "a8 needs block_k=16 >= 32 dividing the weight's scale block width 128"),
])
def test_forced_config_errors_name_the_field(config, message):
    x, q = torch.randn(64, 256), torch.zeros(40, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=message) as err:
        fk.w8a16_linear(x, q, torch.ones(1, 2), [128, 128], config)
    assert "\n" not in str(err.value)


def test_split_beyond_the_workspace_and_a_plain_tuple_are_refused():
    M, N = 64, lk.PARTIALS // 64 // 2 + 16   # two splits of [M, N] overflow the partials
    with pytest.raises(ValueError, match=f"split_k=2 with M={M}, N={N} needs .* <= {lk.PARTIALS}"):
        fk.check_config(W8A16Config(64, 32, 128, 2), M, N)
    fk.check_config(W8A16Config(64, 32, 128, 1), M, N)
    with pytest.raises(TypeError, match="w8a16 linear: config must be a W8A16Config, got tuple"):
        fk.w8a16_linear(torch.randn(4, 256), torch.zeros(40, 256, dtype=torch.float8_e4m3fn), torch.ones(1, 2),
                        [128, 128], (64, 32, 128, 1, 4, 4))


def test_quantized_rows_for_a_w8a16_config_are_refused():
    from compiled.quant.act_quant import QuantizedRows
    x, q = torch.randn(4, 256), torch.zeros(40, 256, dtype=torch.float8_e4m3fn)
    pre = QuantizedRows(torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.ones(4, 2), 128)
    with pytest.raises(ValueError, match=r"x quantized for a W8A8 kernel, but the config .* is W8A16") as err:
        fk.w8a16_linear(x, q, torch.ones(1, 2), [128, 128], W8A16Config(16, 16, 128), quantized=pre)
    assert "\n" not in str(err.value)


@pytest.fixture
def fresh_configs():
    lk.skinny_config.cache_clear()
    yield
    lk.skinny_config.cache_clear()


def test_fp8_gemv_tiles_follow_their_own_constants(fresh_configs, monkeypatch):
    """One byte a weight element takes the FP8_GEMV_ constants (today twice the columns of the
    bf16 tile), a 2-byte weight keeps GEMV_'s."""
    N, K = 2048, 4096
    fp8, bf16 = lk.skinny_config(1, N, K, 132, weight_bytes=1), lk.skinny_config(1, N, K, 132)
    assert (fp8.block_n, fp8.block_k) == (lk.FP8_GEMV_BLOCK_N, lk.FP8_GEMV_MAX_BLOCK_K) != (bf16.block_n, bf16.block_k)
    monkeypatch.setattr(lk, "FP8_GEMV_MAX_BLOCK_K", 2048)
    monkeypatch.setattr(lk, "FP8_GEMV_BLOCK_N", 8)
    lk.skinny_config.cache_clear()
    fp8, bf16 = lk.skinny_config(1, N, K, 132, weight_bytes=1), lk.skinny_config(1, N, K, 132)
    assert fp8.gemv and (fp8.block_n, fp8.block_k) == (8, 2048)
    assert (bf16.block_n, bf16.block_k) == (lk.GEMV_BLOCK_N, lk.GEMV_MAX_BLOCK_K)


def test_fp8_gemv_takes_its_wide_tiles_where_n_fills_the_sms(fresh_configs):
    """The 30B's qkv (N 5,120) gives 640 programs of FP8_GEMV_WIDE_N columns, at least
    FP8_GEMV_WIDE_PROGRAMS_PER_SM an SM of 132: the wide tiles; its o_proj (N 2,048) does not."""
    qkv, o = lk.skinny_config(1, 5120, 2048, 132, weight_bytes=1), lk.skinny_config(1, 2048, 4096, 132, weight_bytes=1)
    assert qkv == lk.SkinnyConfig(lk.FP8_GEMV_WIDE_N, lk.FP8_GEMV_WIDE_BLOCK_K, 1, lk.FP8_GEMV_WIDE_WARPS, 1, True)
    assert (o.block_n, o.block_k, o.num_warps) == (lk.FP8_GEMV_BLOCK_N, lk.FP8_GEMV_MAX_BLOCK_K, lk.GEMV_NUM_WARPS)
    assert lk.skinny_config(1, 5120, 2048, 264, weight_bytes=1).block_n == lk.FP8_GEMV_BLOCK_N   # twice the SMs
    assert lk.skinny_config(1, 5120, 2048, 132).block_n == lk.GEMV_BLOCK_N                      # bf16


def test_fp8_gemv_runs_fit_the_scale_block_and_the_k_step():
    """An FP8 GEMV sums runs of up to 16 products before a scale only where a tile takes a scale per
    row and block (FP8_BLOCKS), each run inside one block and one K step; the PTX conversion is
    never asked of the CPU (the interpreter has no inline PTX)."""
    from compiled.quant.dequant import FP8_BLOCKS
    from compiled.triton_utils import fp8_convert_asm, gemv_chunk
    assert gemv_chunk(FP8_BLOCKS, 128, 512) == 16 and gemv_chunk(FP8_BLOCKS, 8, 64) == 8
    assert gemv_chunk(FP8_BLOCKS, 24, 16) == 8 and gemv_chunk(FP8_BLOCKS, 128, 4) == 4
    assert gemv_chunk(1, 128, 512) == 1 and gemv_chunk(0, 1, 1024) == 1
    assert not fp8_convert_asm(torch.device("cpu"))


def test_fp8_skinny_tiles_take_twice_the_k_and_the_split_columns(fresh_configs):
    """At 8 rows an FP8 weight's tiles are 256 long in K (bf16: 128) and its splits take twice the
    columns an SM: qkv splits in 2 (bf16: 1), o_proj in 8 (bf16: 4)."""
    for (N, K), fp8_split, bf16_split in (((5120, 2048), 2, 1), ((2048, 4096), 8, 4)):
        fp8, bf16 = lk.skinny_config(8, N, K, 132, weight_bytes=1), lk.skinny_config(8, N, K, 132)
        assert (fp8.block_k, fp8.split_k, fp8.gemv) == (2 * lk.MAX_BLOCK_K, fp8_split, False), fp8
        assert (bf16.block_k, bf16.split_k) == (lk.MAX_BLOCK_K, bf16_split), bf16
    assert lk.skinny_config(8, 2048, 4096, 132, weight_bytes=4) == lk.skinny_config(8, 2048, 4096, 132)


def test_fp8_sweep_smoke_run_on_cpu(tmp_path):
    """bench/linear_bench.py --fp8 --device cpu end to end (interpreted, two configs a pass): a row
    per smoke shape and M with the heuristic's pick and the best, every config computing right."""
    import subprocess
    import sys
    from tests.linear.test_linear_kernel import ROOT
    out = tmp_path / "fp8.json"
    env = child_env(TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "linear_bench.py"), "--fp8", "--device", "cpu",
                           "--fp8-m", "8", "20", "--max-configs", "2", "--reps", "1", "--out", str(out)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["fp8"]
    assert [(r["shape"], r["m"], r["kernel"]) for r in rows] == [
        ("smoke_qkv", 8, "skinny"), ("smoke_o", 8, "skinny"), ("smoke_qkv", 20, "w8a16"), ("smoke_o", 20, "w8a16")]
    for r in rows:
        assert r["failed"] == 0 and r["tried"] >= 2 and r["heuristic_us"] > 0 and r["best_us"] <= r["heuristic_us"], r
        assert r["w8a8_cublas_us"] is None, r   # cuBLAS's W8A8: Hopper only
    for r in rows[2:]:
        assert r["heuristic"] == list(fk.w8a16_config(20, r["n"], r["k"], 132, 128)), r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [32, 64])
def test_gpu_w8a16_heuristic_split_replays_from_a_cuda_graph(M):
    """o_proj's shape, where the heuristic splits K: eager and replayed from a CUDA graph (the
    workspace allocated before the capture) within bf16 tolerance, the semaphores back at 0."""
    from compiled.linear import workspace
    N, K = 2048, 4096
    q, s = quantize(torch.randn(N, K, device="cuda") / K ** 0.5, QuantConfig("fp8", "block", (128, 128)))
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    cfg = fk.w8a16_config(M, N, K, fk.num_sms(x.device), 128, fp8_dots=fk.hopper_or_newer(x.device))
    assert cfg.split_k > 1
    ref = torch.nn.functional.linear(a8_rows(x, 128) if cfg.a8 else x.float(),
                                     dequantize_blocks(q, s, [128, 128], torch.float32))
    eager = fk.w8a16_linear(x, q, s, [128, 128])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fk.w8a16_linear(x, q, s, [128, 128])
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for out in (eager, captured):
        assert (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    assert not workspace.allocated(lk.SKINNY_KERNEL, x.device).semaphores.any()


if __name__ == "__main__":   # run by the fixture above under TRITON_INTERPRET=1
    print(json.dumps({name: w8a16_case(*case) for name, *case in CASES}))
