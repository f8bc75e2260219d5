"""Zero-copy safetensors reading: each tensor is a view of the memory-mapped file.

Copying from the view into the final parameter is the only data movement, so loading allocates
nothing beyond the model itself (the page cache holds the file, not the process heap)."""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from typing import Iterator

import torch

from compiled.errors import CheckpointError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def read_header(file: str, mm: mmap.mmap) -> tuple[dict, int]:
    if len(mm) < 8:
        raise CheckpointError(f"{file}: truncated safetensors file ({len(mm)} bytes)")
    (size,) = struct.unpack("<Q", mm[:8])
    if 8 + size > len(mm):
        raise CheckpointError(f"{file}: truncated safetensors header")
    try:
        header = json.loads(mm[8:8 + size])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{file}: malformed safetensors header") from None
    return header, 8 + size


def iter_safetensors(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, read-only CPU view) for every tensor in `file`, in file order."""
    try:
        with open(file, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot map safetensors file ({e})") from None
    header, base = read_header(file, mm)
    entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                     key=lambda kv: kv[1]["data_offsets"][0])
    for name, info in entries:
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        begin, end = info["data_offsets"]
        shape = info["shape"]
        numel = 1
        for d in shape:
            numel *= d
        if base + end > len(mm):
            raise CheckpointError(f"{file}: truncated: tensor {name!r} ends past the end of the file")
        if end - begin != numel * torch.empty((), dtype=dtype).element_size():
            raise CheckpointError(f"{file}: tensor {name!r} has {end - begin} bytes for shape {shape}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the view is read-only; we only ever copy from it
            flat = torch.frombuffer(mm, dtype=dtype, count=numel, offset=base + begin) if numel else \
                torch.empty(0, dtype=dtype)
        yield name, flat.view(shape)
