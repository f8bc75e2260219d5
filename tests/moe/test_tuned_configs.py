"""The fused MoE's tuned config files: which file FP8 and bf16 experts read, the fallback order,
the one-token GEMVs' "gemv" entry (checked, and used by `fused_moe_triton` at one token under
TRITON_INTERPRET=1 against the reference over the dequantized experts), and the tuners' FP8 search
space and writes (`bench/tune_moe.py`, `bench/moe_bench.py`), their CPU smoke runs end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from compiled.moe import fused_moe as fm  # noqa: E402
from compiled.moe import tuned_configs as tc  # noqa: E402
from tests.conftest import child_env  # noqa: E402

MARK = "@@TUNED_CONFIGS@@"
CPU = torch.device("cpu")
E, I = 16, 48


def _cfg(bm: int, bn: int, bk: int) -> dict:
    return dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=1, num_warps=4, num_stages=2)


def _tile(bn: int, bk: int, warps: int = 4) -> dict:
    return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)


def _write(folder: Path, dtype: str, table: dict, e: int = E, i: int = I) -> Path:
    path = folder / tc.config_file_name(e, i, "cpu", dtype)
    path.write_text(json.dumps(table))
    return path


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """An empty config folder searched first; the files read are forgotten before and after."""
    monkeypatch.setenv("COMPILED_MOE_CONFIG_DIR", str(tmp_path))
    tc.clear_caches()
    yield tmp_path
    tc.clear_caches()


def _tuner(name: str):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


# ----------------------------------------------------------------------------- file names, fallback

def test_fp8_experts_file_name_comes_before_the_activations():
    assert tc.config_dtypes(torch.bfloat16) == ("bfloat16",)
    assert tc.config_dtypes(torch.bfloat16, fp8=True) == ("fp8_w8a8", "bfloat16")
    assert tc.config_dtypes(torch.float16, fp8=True) == ("fp8_w8a8", "float16")
    assert tc.config_file_name(128, 768, "NVIDIA_H200", tc.config_dtypes(torch.bfloat16, True)[0]) == \
        "E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8.json"


def test_fallback_order_fp8_file_then_activations_then_default(config_dir):
    bf16 = torch.bfloat16
    assert tc.get_config(8, E, I, bf16, CPU, fp8=True) == tc.default_config(8, E)   # no file at all
    assert tc.get_gemv_tiles(E, I, bf16, CPU, fp8=True) == tc.GEMV_TILES
    _write(config_dir, "bfloat16", {"1": _cfg(16, 32, 64), "gemv": {"down": _tile(16, 128)}})
    tc.clear_caches()
    # FP8 experts without a file of their own: the activations' dtype's table and tiles
    assert tc.get_config(8, E, I, bf16, CPU, fp8=True) == _cfg(16, 32, 64)
    assert tc.get_gemv_tiles(E, I, bf16, CPU, fp8=True) == dict(up=tc.GEMV_TILES["up"], down=_tile(16, 128))
    _write(config_dir, "fp8_w8a8", {"1": _cfg(16, 64, 128), "512": _cfg(64, 128, 128),
                                     "gemv": {"up": _tile(8, 2048, 8)}})
    tc.clear_caches()
    assert tc.get_config(8, E, I, bf16, CPU, fp8=True) == _cfg(16, 64, 128)
    assert tc.get_config(400, E, I, bf16, CPU, fp8=True) == _cfg(64, 128, 128)
    # the FP8 file's "gemv" entry as a whole (its missing stage from GEMV_TILES, not the bf16 file)
    assert tc.get_gemv_tiles(E, I, bf16, CPU, fp8=True) == dict(up=_tile(8, 2048, 8), down=tc.GEMV_TILES["down"])
    # bf16 experts never read the FP8 file
    assert tc.get_config(400, E, I, bf16, CPU) == _cfg(16, 32, 64)
    assert tc.get_gemv_tiles(E, I, bf16, CPU) == dict(up=tc.GEMV_TILES["up"], down=_tile(16, 128))
    # an FP8 file holding only "gemv" tiles: the token table still comes from the bf16 file
    _write(config_dir, "fp8_w8a8", {"gemv": {"up": _tile(2, 512)}})
    tc.clear_caches()
    assert tc.get_config(8, E, I, bf16, CPU, fp8=True) == _cfg(16, 32, 64)
    assert tc.get_gemv_tiles(E, I, bf16, CPU, fp8=True)["up"] == _tile(2, 512)


@pytest.mark.parametrize("gemv, key", [
    ({"up": _tile(3, 1024)}, "gemv.up.BLOCK_N must be a positive power of two, got 3"),
    ({"down": dict(_tile(8, 256), num_warps=0)}, "gemv.down.num_warps must be a positive power of two, got 0"),
    ({"down": dict(_tile(8, 256), num_warps=64)}, "gemv.down.num_warps must be at most 32, got 64"),
    ({"up": dict(BLOCK_N=4, BLOCK_K=1024)}, "gemv.up.num_warps is missing"),
    ({"up": dict(_tile(4, 1024), num_stage=2)}, "gemv.up.num_stage is not a GEMV tile key"),
    ({"up": dict(_tile(4, 1024), num_stages=0)}, "gemv.up.num_stages must be an int >= 1, got 0"),
    ({"sideways": _tile(4, 1024)}, "gemv.sideways is not a GEMV stage"),
    ({"up": [4, 1024, 4]}, "gemv.up must be an object"),
    ([4, 1024], "gemv must be an object"),
    ({"up": dict(_tile(4, 1024), BLOCK_K="1024")}, "gemv.up.BLOCK_K must be a positive power of two, got '1024'"),
])
def test_bad_gemv_entry_is_a_one_line_error_naming_file_and_key(config_dir, gemv, key):
    path = _write(config_dir, "bfloat16", {"1": _cfg(16, 32, 64), "gemv": gemv})
    for lookup in (lambda: tc.get_gemv_tiles(E, I, torch.bfloat16, CPU),
                   lambda: tc.get_config(2, E, I, torch.bfloat16, CPU, fp8=True)):
        with pytest.raises(ValueError) as err:
            lookup()
        msg = str(err.value)
        assert msg.startswith(f"{path}: ") and key in msg and "\n" not in msg, msg


@pytest.mark.parametrize("down_m", [32, 24, 8, "16"])
def test_bad_down_height_is_a_one_line_error_naming_file_and_key(config_dir, down_m):
    entry = dict(_cfg(16, 32, 64), down=dict(BLOCK_SIZE_M=down_m))
    path = _write(config_dir, "bfloat16", {"1": _cfg(16, 32, 64), "64": entry})
    with pytest.raises(ValueError) as err:
        tc.get_config(64, E, I, torch.bfloat16, CPU)
    msg = str(err.value)
    assert msg.startswith(f"{path}: 64.down.BLOCK_SIZE_M must be a power of two >= 16 dividing BLOCK_SIZE_M (16), "
                          f"got {down_m!r}") and "\n" not in msg, msg


def test_down_height_dividing_the_blocks_is_taken(config_dir):
    entry = dict(_cfg(64, 32, 64), down=dict(BLOCK_SIZE_M=32))
    _write(config_dir, "bfloat16", {"1": _cfg(16, 32, 64), "64": entry})
    up, down = tc.split_config(tc.get_config(64, E, I, torch.bfloat16, CPU))
    assert (up["BLOCK_SIZE_M"], down["BLOCK_SIZE_M"]) == (64, 32)


def test_swap_ab_per_gemm_zero_when_absent(config_dir):
    """SWAP_AB: the down GEMM takes the entry's unless its "down" says otherwise; 0 without it."""
    swapped = dict(_cfg(16, 128, 128), SWAP_AB=1, W8A8=1)
    _write(config_dir, "fp8_w8a8", {"1": _cfg(16, 32, 64), "8": swapped, "16": dict(swapped, down=dict(SWAP_AB=0))})
    for T, want in ((1, (0, 0)), (8, (1, 1)), (16, (1, 0))):
        up, down = tc.split_config(tc.get_config(T, E, I, torch.bfloat16, CPU, fp8=True))
        assert (up[tc.SWAP_KEY], down[tc.SWAP_KEY]) == want, T


@pytest.mark.parametrize("mode", [2, "yes", None])
def test_bad_mode_in_an_entry_is_a_one_line_error_naming_file_and_key(config_dir, mode):
    path = _write(config_dir, "fp8_w8a8", {"1": _cfg(16, 32, 64), "8": dict(_cfg(64, 32, 64), W8A8=mode)})
    with pytest.raises(ValueError) as err:
        tc.get_config(8, E, I, torch.bfloat16, CPU, fp8=True)
    msg = str(err.value)
    assert msg.startswith(f"{path}: 8.W8A8 must be 0 (W8A16) or 1 (W8A8)") and "\n" not in msg, msg


def test_an_entrys_mode_is_read_where_it_names_one(config_dir):
    _write(config_dir, "fp8_w8a8", {"8": dict(_cfg(64, 32, 64), W8A8=1), "64": dict(_cfg(16, 32, 64), W8A8=0),
                                     "512": _cfg(64, 64, 64)})
    got = [tc.tuned_mode(tc.get_config(T, E, I, torch.bfloat16, CPU, fp8=True)) for T in (8, 64, 512)]
    assert got == [True, False, None]


def test_lora_calls_over_fp8_experts_run_w8a8_in_16_row_tiles_only(config_dir):
    """Expert-LoRA calls over FP8 experts: the FP8 file's entry and mode where it is W8A16 or a
    W8A8 one of 16-row tiles (the group widths returned); the activations' file's entry, W8A16,
    where it is W8A8 in taller tiles (by its key, or by W8A8_MIN_TOKENS without one)."""
    from compiled.moe.expert_lora import _lora_configs
    from compiled.moe.fused_moe import W8A8_MIN_TOKENS, ExpertScales
    big = W8A8_MIN_TOKENS * 2
    _write(config_dir, "fp8_w8a8", {"8": dict(_cfg(64, 32, 64), W8A8=1), "16": dict(_cfg(16, 64, 32), W8A8=1),
                                     "64": dict(_cfg(16, 32, 64), W8A8=0), str(big): _cfg(64, 64, 64)})
    _write(config_dir, "bfloat16", {"8": _cfg(16, 128, 64), "16": _cfg(16, 16, 64), "64": _cfg(16, 64, 64),
                                     str(big): _cfg(32, 128, 64)})
    H = 64
    w13, w2 = torch.zeros(E, 2 * I, H, dtype=torch.float8_e4m3fn), torch.zeros(E, H, I, dtype=torch.float8_e4m3fn)
    scales = ExpertScales(torch.ones(E, 6, 2), torch.ones(E, 2, 2), [16, 32])
    x = torch.zeros(1, H, dtype=torch.bfloat16)
    got = [_lora_configs(T, E, I, x, None, scales, w13, w2) for T in (8, 16, 64, big)]
    assert [(up["BLOCK_SIZE_N"], groups) for up, _, groups in got] == [(128, None), (64, (32, 32)), (32, None),
                                                                      (128, None)]
    assert _lora_configs(8, E, I, x, None, None, w13, w2)[1]["BLOCK_SIZE_N"] == 128


# ----------------------------------------------------------------------------- the op (interpreter)

def case_one_token_reads_the_fp8_files_gemv_tiles() -> dict:
    """`fused_moe_triton` over FP8 experts at an odd size: at one token the GEMVs get the FP8
    file's tiles (which differ from GEMV_TILES: K tiles covering two scale blocks up, one block's
    part down), at two tokens the grouped GEMMs its entry; bf16 experts get theirs. Each result
    against the reference over the dequantized experts (fp32 activations)."""
    from compiled.quant.config import QuantConfig
    from compiled.quant.dequant import dequantize_blocks
    from tests.quant.test_fp8_kernel import _stacked_fp8
    folder = Path(os.environ["COMPILED_MOE_CONFIG_DIR"])
    E_, H, I_, k, block = 6, 40, 24, 3, (16, 16)
    gemv = {"up": _tile(2, 32, 2), "down": _tile(16, 16, 1)}
    _write(folder, "fp8_w8a8", {"2": _cfg(16, 16, 32), "gemv": gemv}, E_, I_)
    _write(folder, "float32", {"2": _cfg(16, 32, 16)}, E_, I_)
    g = torch.Generator().manual_seed(5)
    q13, s13, blk = _stacked_fp8(torch.randn(E_, 2 * I_, H, generator=g) / H ** 0.5, QuantConfig("fp8", "block", block))
    q2, s2, _ = _stacked_fp8(torch.randn(E_, H, I_, generator=g) / I_ ** 0.5, QuantConfig("fp8", "block", block))
    w13, w2 = dequantize_blocks(q13, s13, blk, torch.float32), dequantize_blocks(q2, s2, blk, torch.float32)
    seen = []
    gemv_launch, grouped_launch = fm._launch_gemv, fm._launch_grouped
    fm._launch_gemv = lambda call, tiles: (seen.append(("gemv", tiles)), gemv_launch(call, tiles))[1]
    fm._launch_grouped = lambda call, cfg, *route: (seen.append(("grouped", cfg)), grouped_launch(call, cfg, *route))[1]
    errs = {}
    try:
        for T in (1, 2):
            x = torch.randn(T, H, generator=g)
            w, ids = torch.rand(T, k, generator=g), torch.stack([torch.randperm(E_, generator=g)[:k] for _ in range(T)])
            ref = fm.fused_moe_ref(x, w, ids, w13, w2)
            got = fm.fused_moe_triton(x, w, ids, q13, q2, scales=fm.ExpertScales(s13, s2, blk))
            plain = fm.fused_moe_triton(x, w, ids, w13, w2)
            errs[T] = max((got - ref).abs().max().item(), (plain - ref).abs().max().item())
            errs[f"scale{T}"] = ref.abs().max().item()
    finally:
        fm._launch_gemv, fm._launch_grouped = gemv_launch, grouped_launch
    return dict(errs=errs, seen=seen, gemv=gemv)


def case_tuner_times_w8a8_and_w8a16() -> dict:
    """`tune_moe.tune_tokens` over tiny FP8 experts in both modes (one config a space): an entry each."""
    tune_moe = _tuner("tune_moe")
    tune_moe.DEVICE, tune_moe.MAX_CONFIGS = "cpu", 1
    w13, w2, scales = tune_moe.make_fp8_weights(1, 4, 64, 32)
    out = {}
    for w8a8 in (False, True):
        mode = tune_moe.Mode(True, w8a8, 64, 32)
        prob = tune_moe.Problem(w13, w2, 4, 2, 4, scales=scales, mode=mode, dtype=torch.bfloat16)
        best = tune_moe.tune_tokens(prob, 4, set(), thin=False)
        out[mode.name] = None if best is None else dict(up=best["up"][1], down=best["down"][1])
    modes = [tune_moe.Mode(True, w8a8, 64, 32) for w8a8 in (False, True)]
    best = tune_moe.best_over_modes(w13, w2, scales, 4, 2, 4, torch.bfloat16, modes, set(), thin=False)
    out["best_mode"] = None if best is None else best["mode"].name
    return out


CASES = (case_one_token_reads_the_fp8_files_gemv_tiles, case_tuner_times_w8a8_and_w8a16)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("moe_configs")
    env = child_env(TRITON_INTERPRET="1", COMPILED_MOE_CONFIG_DIR=str(folder))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=str(REPO), capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len(MARK):])


def test_one_token_runs_the_tuned_files_gemv_tiles(interpreted):
    r = interpreted[case_one_token_reads_the_fp8_files_gemv_tiles.__name__]
    assert isinstance(r, dict), r
    seen = [tuple(s) for s in r["seen"]]
    # per token count: the FP8 call, then the plain fp32 call (its own file, no "gemv": GEMV_TILES)
    assert seen[0] == ("gemv", r["gemv"]) and seen[1] == ("gemv", tc.GEMV_TILES), seen
    assert seen[2] == ("grouped", _cfg(16, 16, 32)) and seen[3] == ("grouped", _cfg(16, 32, 16)), seen
    for T in ("1", "2"):
        assert r["errs"][T] <= 1e-5 * max(1.0, r["errs"]["scale" + T]) and r["errs"]["scale" + T] > 0.05, r


def test_tuner_times_fp8_experts_in_both_modes(interpreted):
    r = interpreted[case_tuner_times_w8a8_and_w8a16.__name__]
    assert isinstance(r, dict), r
    assert r["w8a16"] is not None and r["w8a8"] is not None and r["best_mode"] in ("w8a16", "w8a8"), r
    for bk in (r["w8a8"]["up"]["BLOCK_SIZE_K"], r["w8a8"]["down"]["BLOCK_SIZE_K"]):
        assert bk >= fm.FP8_DOT_MIN_K, r


# ----------------------------------------------------------------------------- the tuners (no kernels)

@pytest.mark.parametrize("T, w8a8", [(8, False), (8, True), (512, False), (512, True)])
def test_fp8_search_space_holds_only_what_the_op_runs(T, w8a8):
    tune_moe = _tuner("tune_moe")
    modes = tune_moe.modes_at(T, (128, 128), 2048, 768)
    assert [m.w8a8 for m in modes] == [False, True] and {(m.bi_up, m.bi_down) for m in modes} == {(128, 128)}
    mode = modes[w8a8]
    w13 = torch.empty(128, 2 * 768, 2048, device="meta")
    w2 = torch.empty(128, 2048, 768, device="meta")
    scales = fm.ExpertScales(w13, w2, [128, 128])
    candidates = tune_moe.block_m_candidates(T, mode)
    # W8A8 reaches the fp8 wgmma from 64 rows: a 64-row tile is searched at a few tokens too
    assert (tune_moe.WGMMA_MIN_M in candidates) == (w8a8 or T > 64)
    for bm in candidates:
        up, down = (tune_moe._space(bm, d, mode) for d in (False, True))
        assert up and down
        for space in (up, down):
            keys = [tuple(sorted(c.items())) for c in space]
            assert len(keys) == len(set(keys))   # no two configs the op launches alike
            assert all(128 % c["BLOCK_SIZE_K"] == 0 for c in space)   # K tiles inside one scale block
        # W8A16's FP8 weights take no TMA descriptor (its 16-bit intermediate does); W8A8's do
        assert {c["TMA"] for c in up} == ({0, 1} if mode.w8a8 else {0})
        assert {c["TMA"] for c in down} == {0, 1}
        # every pair runs in the mode it was timed in, the entry naming it
        pairs = [(u, d) for u in up[:5] + up[-5:] for d in down[:5] + down[-5:]]
        want = (128, 128) if mode.w8a8 else None
        assert all(fm.w8a8_groups(scales, w13, w2, T, u, d, mode.w8a8) == want for u, d in pairs)
        # from 64-row blocks the down GEMM's tiles are searched at half the height too, on those blocks
        halves = [c for c in tune_moe.gemm_space(bm, True, mode) if tune_moe.ALIGN_KEY in c]
        assert len(halves) == (len(tune_moe._space(bm // 2, True, mode)) if bm >= 64 else 0)
        assert all(c["BLOCK_SIZE_M"] == bm // 2 and tune_moe.align_m(c) == bm for c in halves)
        assert tune_moe.gemm_space(bm, False, mode) == up
    # scale blocks no W8A8 tile fits (24 wide: K tiles of 16 only): nothing searched, no crash
    assert tune_moe._space(64, False, tune_moe.Mode(True, True, 24, 24)) == []
    assert tune_moe._space(64, False, tune_moe.Mode(True, False, 24, 24))


def test_tuner_keeps_the_gemv_entry_and_gemv_writes_keep_the_table(tmp_path):
    tune_moe = _tuner("tune_moe")
    path = tmp_path / tc.config_file_name(E, I, "cpu", "fp8_w8a8")
    gemv = {"up": _tile(8, 2048), "down": _tile(16, 256)}
    tune_moe.merge_entry(path, "gemv", gemv, dict(gemv_us=3.0))
    assert json.loads(path.read_text()) == {"gemv": gemv, "_meta": {"gemv_us": 3.0}}
    assert tune_moe.kept_extras(path) == {"gemv": gemv}   # what a retuned table starts from
    assert tune_moe.kept_gemv_meta(path) == {"gemv_us": 3.0}   # and its meta, the entry's timing
    tune_moe._write(path, {"1": _cfg(16, 32, 64), **tune_moe.kept_extras(path)}, dict(E=E))
    tune_moe.merge_entry(path, "gemv", dict(gemv, up=_tile(4, 1024)), dict(gemv_us=2.0))
    raw = json.loads(path.read_text())
    assert raw["1"] == _cfg(16, 32, 64) and raw["gemv"]["up"] == _tile(4, 1024)
    assert raw["_meta"] == dict(E=E, gemv_us=2.0)
    assert not list(tmp_path.glob("*.tmp"))


def test_tuners_cpu_smoke_runs_write_a_table_the_op_reads(tmp_path):
    """tune_moe.py --quantization fp8 and moe_bench.py --only-gemv --write-gemv end to end on the
    CPU (interpreter, tiny shapes, one config a space): one FP8 file with both, read back; W8A8
    forced at 2 tokens (the op's W8A16 there) is timed and leaves the file as it was."""
    env = child_env(TRITON_INTERPRET="1", COMPILED_MOE_CONFIG_DIR=None)
    shape = ["--device", "cpu", "--E", "4", "--H", "40", "--I", "24", "--topk", "2", "--layers", "1",
             "--quantization", "fp8", "--max-configs", "1"]
    for cmd in (["bench/tune_moe.py", "--tokens", "2", "--workers", "1", "--out-dir", str(tmp_path)],
                ["bench/moe_bench.py", "--only-gemv", "--reps", "1", "--write-gemv", str(tmp_path),
                 "--out", str(tmp_path / "gemv.json")]):
        proc = subprocess.run([sys.executable, *cmd, *shape], env=env, cwd=str(REPO), capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = tmp_path / tc.config_file_name(4, 24, "cpu", "fp8_w8a8")
    before = path.read_text()
    forced = subprocess.run([sys.executable, "bench/tune_moe.py", "--tokens", "2", "--workers", "1", "--out-dir",
                             str(tmp_path), "--fp8-mode", "w8a8", *shape], env=env, cwd=str(REPO),
                            capture_output=True, text=True, timeout=600)
    assert forced.returncode == 0, forced.stdout[-3000:] + forced.stderr[-3000:]
    assert "T=    2 BM= 16 w8a8" in forced.stdout and "nothing written" in forced.stdout, forced.stdout[-2000:]
    assert path.read_text() == before   # a forced mode's tiles never reach the table
    raw = json.loads(path.read_text())
    assert set(raw) == {"2", "gemv", "_meta"} and raw["_meta"]["quantization"] == "fp8", raw
    os.environ["COMPILED_MOE_CONFIG_DIR"] = str(tmp_path)
    tc.clear_caches()
    try:
        assert tc.get_config(2, 4, 24, torch.bfloat16, CPU, fp8=True) == raw["2"]
        assert tc.get_gemv_tiles(4, 24, torch.bfloat16, CPU, fp8=True) == raw["gemv"]
    finally:
        del os.environ["COMPILED_MOE_CONFIG_DIR"]
        tc.clear_caches()


if __name__ == "__main__":   # run by the `interpreted` fixture under TRITON_INTERPRET=1
    results = {}
    for case in CASES:
        try:
            results[case.__name__] = case()
        except Exception:   # reported to the parent, which shows it
            import traceback
            results[case.__name__] = traceback.format_exc()
    print(MARK + json.dumps(results))


def test_tuner_compile_workers_size_buffers_for_every_block_m(monkeypatch):
    """The compile workers launch every config at 16 tokens: their intermediate must hold the rows
    of the largest BLOCK_SIZE_M among the jobs (a smaller one made gemm1 write out of bounds)."""
    tune_moe = _tuner("tune_moe")
    monkeypatch.setattr(tune_moe, "DEVICE", "cpu")
    w13, w2 = tune_moe.make_weights(1, 8, 64, 32, torch.float32)
    big = dict(_cfg(256, 32, 32), HALF_M=0, TMA=0)
    with pytest.raises(ValueError, match="BLOCK_SIZE_M=256"):
        tune_moe.Problem(w13, w2, 16, 8, 8).fns(big, down=False)
    sized = tune_moe.Problem(w13, w2, 16, 8, 8, block_ms=(256,))
    assert sized.inter.shape[0] >= fm.intermediate_rows(16 * 8, 8, 256)

    built = []

    class Recorded(tune_moe.Problem):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

        def fns(self, cfg, down):
            self.check_rows(cfg["BLOCK_SIZE_M"])   # no kernel on the CPU
            return [lambda: None]

    monkeypatch.setattr(tune_moe, "Problem", Recorded)
    jobs = [("up", tune_moe.Mode(), tuple(sorted(dict(_cfg(bm, 32, 32), HALF_M=0, TMA=0).items())))
            for bm in (16, 64, 256)]
    assert tune_moe._compile_worker((jobs, 8, 64, 32, 8, "float32", None, "cpu")) == []
    assert built and built[0].inter.shape[0] >= fm.intermediate_rows(16 * 8, 8, 256)
