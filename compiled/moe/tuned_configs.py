"""The fused MoE's kernel configs: the tuned files they come from, the defaults without one.

A file `configs/E={E},N={I},device_name={name},dtype={dtype}.json` (written by `bench/tune_moe.py`)
maps token counts to grouped-GEMM configs (BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, num_stages,
optional HALF_M, TMA and SWAP_AB, and an optional "down" override of M/N/K/GROUP/warps/stages and
those three for the second GEMM, whose BLOCK_SIZE_M, where given, divides the up GEMM's: a program
takes an alignment block of the up GEMM's height as that many shorter down tiles in turn). HALF_M = 1
(2) runs an expert's partial last block as a tile of half (a quarter of) the height when its rows
fit; TMA loads the weight tiles through tensor descriptors (Hopper's TMA) instead of pointer loads;
SWAP_AB = 1 runs W8A8 tiles of 16 rows or more as weight tile x rows on the MMA, so that a few
tokens an expert still take Hopper's 64-row warpgroup MMA. The entry whose token count is nearest
wins. An optional top-level "gemv" entry, `{"up": {BLOCK_N, BLOCK_K, num_warps}, "down": {...}}`
(either stage may be left out), gives the one-token GEMVs' tiles in place of GEMV_TILES
(`bench/moe_bench.py --only-gemv --write-gemv` writes it); a malformed one is a one-line error
naming the file and the key.

The file's dtype is the activations' (`bfloat16`), or for FP8 experts (float8_e4m3fn weights with
block scales) `fp8_w8a8` (vLLM's name for its FP8 expert files). Its entries may say which mode
their tiles are for, "W8A8": 1 (activations quantized, fp8 x fp8 dots) or 0 (W8A16), as the tuner
found the faster; without the key, below `fused_moe.W8A8_MIN_TOKENS` tokens W8A16. FP8 experts
look their file up first, then the activations' dtype's; the token table and the "gemv" entry
each come from the first file in that order that has one, else `default_config` / GEMV_TILES.
`COMPILED_MOE_CONFIG_DIR` adds a config folder searched before the checked-in one."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch

import compiled.envs as envs

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent / "configs"
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
SWAP_KEY = "SWAP_AB"   # W8A8 tiles: the weight tile as the MMA's wide side
OPTIONAL_KEYS = ("HALF_M", "TMA", SWAP_KEY)  # 0 when absent
MAX_HALVINGS = 2  # HALF_M: partial blocks run tiles of down to a quarter of BLOCK_SIZE_M
MODE_KEY = "W8A8"   # an FP8 experts' entry: 1 W8A8, 0 W8A16, absent: by fused_moe.W8A8_MIN_TOKENS
DOWN_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages",
             *OPTIONAL_KEYS)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
FP8_CONFIG_DTYPE = "fp8_w8a8"   # the files of FP8 experts, whatever the activations' dtype
GEMV_STAGES = ("up", "down")
GEMV_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps")
GEMV_OPTIONAL_KEYS = ("num_stages",)   # K tiles in flight (the K loop's pipeline depth), 1 without it
MAX_GEMV_WARPS = 32

# One token runs as two GEMVs (`gemv_kernels.py`: no 16-row tensor-core tile for its one live
# row), with these tiles unless a tuned file's "gemv" entry says otherwise (the best of
# `bench/moe_bench.py --sweep-gemv` on an H100 for bf16 experts: 30.6 µs a layer against 34.5 for
# the grouped GEMMs; the 30B's batch-1 step 0.14 ms shorter, RESULTS.md).
GEMV_TILES = dict(up=dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4), down=dict(BLOCK_N=8, BLOCK_K=256, num_warps=4))


def device_name(device: torch.device | None = None) -> str:
    """`torch.cuda.get_device_name` with spaces as underscores (vLLM's file naming); "cpu" without CUDA."""
    if device is not None and device.type != "cuda":
        return "cpu"
    return _cuda_device_name(None if device is None else device.index)


@functools.lru_cache(maxsize=None)
def _cuda_device_name(index: int | None) -> str:
    # Cached: every MoE call looks its config up, and `is_available` queries the driver each time.
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(index).replace(" ", "_")


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def config_dtypes(dtype: torch.dtype, fp8: bool = False) -> tuple[str, ...]:
    """The config files' dtype names in lookup order for activations of `dtype` and, with `fp8`,
    FP8 experts: their own file first, then the activations'. The first is the one a tuner writes."""
    own = dtype_name(dtype)
    return (FP8_CONFIG_DTYPE, own) if fp8 else (own,)


def config_file_name(E: int, N: int, device: str, dtype: torch.dtype | str) -> str:
    """`E=128,N=768,device_name=NVIDIA_H200,dtype=bfloat16.json`; N is the expert width I."""
    dt = dtype if isinstance(dtype, str) else dtype_name(dtype)
    return f"E={E},N={N},device_name={device},dtype={dt}.json"


def _config_dirs() -> list[Path]:
    extra = envs.read("COMPILED_MOE_CONFIG_DIR")
    return ([Path(extra)] if extra else []) + [CONFIG_DIR]


def find_config_file(E: int, N: int, device: str, dtype: str) -> Path | None:
    """The tuned file of this shape/device/dtype name, from the first config folder holding one."""
    name = config_file_name(E, N, device, dtype)
    return next((d / name for d in _config_dirs() if (d / name).is_file()), None)


@functools.lru_cache(maxsize=None)
def _config_file(E: int, N: int, device: str, dtype: str) -> dict:
    """The tuned file's contents for this shape/device/dtype name (its "gemv" entry checked), or {}."""
    path = find_config_file(E, N, device, dtype)
    if path is None:
        log.info("fused_moe: no tuned config %s", config_file_name(E, N, device, dtype))
        return {}
    log.info("fused_moe: using %s", path)
    raw = json.loads(path.read_text())
    if "gemv" in raw:
        check_gemv(raw["gemv"], str(path))
    for key, entry in raw.items():
        if key.isdigit() and MODE_KEY in entry and entry[MODE_KEY] not in (0, 1):
            raise ValueError(f"{path}: {key}.{MODE_KEY} must be 0 (W8A16) or 1 (W8A8), got {entry[MODE_KEY]!r}")
        if key.isdigit():
            check_down_height(entry, f"{path}: {key}")
    return raw


def check_down_height(entry: dict, where: str) -> None:
    """A one-line ValueError naming `where` unless the entry's down BLOCK_SIZE_M (if any) is a
    power of two of at least 16 dividing its BLOCK_SIZE_M."""
    down_m = (entry.get("down") or {}).get("BLOCK_SIZE_M")
    if down_m is None:
        return
    up_m = entry.get("BLOCK_SIZE_M")
    if type(down_m) is not int or down_m < 16 or down_m & (down_m - 1) or not isinstance(up_m, int) or up_m % down_m:
        raise ValueError(f"{where}.down.BLOCK_SIZE_M must be a power of two >= 16 dividing BLOCK_SIZE_M "
                         f"({up_m!r}), got {down_m!r}")


@functools.lru_cache(maxsize=None)
def load_configs(E: int, N: int, device: str, dtype: str) -> dict[int, dict] | None:
    """The tuned table `{token count: config}` for this shape/device/dtype name, or None."""
    table = {int(k): v for k, v in _config_file(E, N, device, dtype).items() if k.isdigit()}
    return table or None


def check_gemv(entry: object, where: str) -> dict:
    """A "gemv" entry as the one-token GEMVs take it, or a one-line ValueError naming `where`
    (the file) and the key at fault."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: gemv must be an object with up and/or down tiles, got {entry!r}")
    for stage, tile in entry.items():
        if stage not in GEMV_STAGES:
            raise ValueError(f"{where}: gemv.{stage} is not a GEMV stage (expected {', '.join(GEMV_STAGES)})")
        if not isinstance(tile, dict):
            raise ValueError(f"{where}: gemv.{stage} must be an object of {', '.join(GEMV_KEYS)}, got {tile!r}")
        for key in tile:
            if key not in GEMV_KEYS + GEMV_OPTIONAL_KEYS:
                raise ValueError(f"{where}: gemv.{stage}.{key} is not a GEMV tile key "
                                 f"(expected {', '.join(GEMV_KEYS + GEMV_OPTIONAL_KEYS)})")
        stages = tile.get("num_stages", 1)
        if type(stages) is not int or stages < 1:
            raise ValueError(f"{where}: gemv.{stage}.num_stages must be an int >= 1, got {stages!r}")
        for key in GEMV_KEYS:
            if key not in tile:
                raise ValueError(f"{where}: gemv.{stage}.{key} is missing")
            value = tile[key]
            if type(value) is not int or value <= 0 or value & (value - 1):
                raise ValueError(f"{where}: gemv.{stage}.{key} must be a positive power of two, got {value!r}")
            if key == "num_warps" and value > MAX_GEMV_WARPS:
                raise ValueError(f"{where}: gemv.{stage}.num_warps must be at most {MAX_GEMV_WARPS}, got {value}")
    return entry


def _first(names: tuple[str, ...], found) -> object | None:
    """`found(name)` of the first name where it is not None."""
    return next((v for v in map(found, names) if v is not None), None)


def default_config(M: int, E: int) -> dict:
    """Used without a tuned file: small blocks for decode, larger tiles for prefill."""
    if M <= 32:
        return dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=4)
    if M * 8 <= E * 16:
        return dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=3)
    if M <= 1024:
        return dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=3)


def get_config(M: int, E: int, N: int, dtype: torch.dtype, device: torch.device | None = None,
               fp8: bool = False) -> dict:
    """Config for M tokens (activations of `dtype`; `fp8`: FP8 experts): the entry with the nearest
    token count of the first tuned table in `config_dtypes` order, else `default_config`."""
    dev = device_name(device)
    table = _first(config_dtypes(dtype, fp8), lambda dt: load_configs(E, N, dev, dt))
    if not table:
        return default_config(M, E)
    return dict(table[min(table, key=lambda m: abs(m - M))])


def get_gemv_tiles(E: int, N: int, dtype: torch.dtype, device: torch.device | None = None,
                   fp8: bool = False) -> dict:
    """The one-token GEMVs' tiles `{"up": ..., "down": ...}`: the "gemv" entry of the first tuned
    file in `config_dtypes` order that has one, its stages left out taken from GEMV_TILES."""
    dev = device_name(device)
    entry = _first(config_dtypes(dtype, fp8), lambda dt: _config_file(E, N, dev, dt).get("gemv")) or {}
    return {stage: dict(entry.get(stage) or GEMV_TILES[stage]) for stage in GEMV_STAGES}


def clear_caches() -> None:
    """Forget the files read so far (after writing one: tuners, tests)."""
    load_configs.cache_clear()
    _config_file.cache_clear()


def tuned_mode(cfg: dict) -> bool | None:
    """Whether the entry's tiles are for W8A8 (its MODE_KEY, checked when the file is read), or
    None where it does not say."""
    return None if MODE_KEY not in cfg else bool(cfg[MODE_KEY])


def split_config(cfg: dict) -> tuple[dict, dict]:
    """(up GEMM config, down GEMM config); HALF_M and TMA default to 0, and HALF_M is capped so
    that no tile is shorter than 16 rows."""
    up = {k: int(cfg[k]) for k in CONFIG_KEYS}
    up.update({k: int(cfg.get(k, 0)) for k in OPTIONAL_KEYS})
    down = dict(up)
    down.update({k: int(v) for k, v in (cfg.get("down") or {}).items() if k in DOWN_KEYS})
    for c in (up, down):
        c["HALF_M"] = min(c["HALF_M"], MAX_HALVINGS, (c["BLOCK_SIZE_M"] // 16).bit_length() - 1)
    return up, down
