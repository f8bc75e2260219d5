"""Compile the Triton kernels a CPU test launches for an H100/H200 (sm_90), without a GPU.

The interpreter (TRITON_INTERPRET=1) runs a kernel's Python, so it accepts code that Triton's
compiler refuses (a constexpr branch returning another dtype than the other, a block size the
layouts cannot hold). `record()` notes each interpreted launch (the kernel, its arguments' types
and its constexprs); `compile_all()`, in a process without the interpreter, compiles each
distinct launch through Triton's whole pipeline to a cubin for sm_90 and returns the failures.

    python tests/hopper_compile.py launches.json     # compile the launches a run recorded
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import sys

import torch

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
           torch.float8_e4m3fn: "fp8e4nv", torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16",
           torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _kind(value) -> str | None:
    """The signature type of a runtime argument (None: pass it as a constexpr)."""
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def _launch(fn, args, kwargs) -> dict:
    params = list(inspect.signature(fn).parameters.values())
    bound = dict(zip((p.name for p in params), args))
    bound.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
    signature, constexprs = {}, {}
    for p in params:
        value = bound.get(p.name, p.default)
        kind = None if "constexpr" in str(p.annotation) else _kind(value)
        if kind is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = value if isinstance(value, (int, float, bool, str, type(None))) else str(value)
        else:
            signature[p.name] = kind
    return {"module": fn.__module__, "name": fn.__qualname__, "signature": signature, "constexprs": constexprs,
            "options": {k: kwargs[k] for k in _OPTIONS if kwargs.get(k) is not None}}


@contextlib.contextmanager
def record(into: list[dict]):
    """Note every interpreted launch inside the block into `into` (needs TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction
    run = InterpretedFunction.run

    def noting(self, *args, grid, warmup, **kwargs):
        entry = _launch(self.fn, args, kwargs)
        if entry not in into:
            into.append(entry)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = noting
    try:
        yield into
    finally:
        InterpretedFunction.run = run


def _constexpr(value):
    import triton.language as tl
    if isinstance(value, str) and value.startswith("torch."):   # a dtype passed as a constexpr
        return getattr(tl, _DTYPES[getattr(torch, value[6:])].replace("fp8e4nv", "float8e4nv")
                       .replace("bf16", "bfloat16").replace("fp16", "float16").replace("fp32", "float32"))
    return value


def compile_all(launches: list[dict]) -> list[str]:
    """Compile each launch for sm_90; one line per failure (kernel: the compiler's first lines)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", 90, 32)
    failures = []
    for launch in launches:
        kernel = getattr(importlib.import_module(launch["module"]), launch["name"].split(".")[-1])
        fn = kernel
        while not isinstance(fn, triton.runtime.JITFunction):   # autotuners and heuristics wrap it
            fn = fn.fn
        constexprs = {(i,): _constexpr(launch["constexprs"][name])
                      for i, name in enumerate(launch["signature"]) if name in launch["constexprs"]}
        src = ASTSource(fn, {k: v for k, v in launch["signature"].items()}, constexprs)
        try:
            triton.compile(src, target=target, options=launch["options"])
        except Exception as e:   # noqa: BLE001 (every compiler error is a finding)
            failures.append(f"{launch['name']} {launch['constexprs']}: {' | '.join(str(e).splitlines()[-3:])}")
    return failures


if __name__ == "__main__":
    found = compile_all(json.load(open(sys.argv[1])))
    print(json.dumps(found))
