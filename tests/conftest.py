"""Shared test helpers: small random-weight HF checkpoints written to a temp folder."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DENSE = dict(vocab_size=123, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
             rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False)
MOE = dict(DENSE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[])


def make_checkpoint(path, moe: bool = False, seed: int = 0, dtype=torch.float32, **overrides) -> str:
    """Save a randomly initialised HF Qwen3 / Qwen3-MoE model to `path` and return it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**dict(MOE, **overrides)))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**dict(DENSE, **overrides)))
    model.to(dtype).save_pretrained(str(path))
    return str(path)


def reduced_real_config(folder, name: str = "qwen3-30b-a3b", layers: int = 4) -> str:
    """A folder with only the config.json of bench/configs/`name`, cut to `layers` layers (every
    layer shape of the real model, for load_format="dummy")."""
    import json
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "bench", "configs", name, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = layers
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(folder)


def hf_model(path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.fixture(autouse=True, scope="module")
def _free_dropped_engines():
    """After each test module, the engines it dropped are freed: `LLM` freezes the start-up heap
    (the collector skips it), so a dropped engine's reference cycles, its KV cache included, would
    otherwise stay until the run ends (a worker runs many modules in one process)."""
    yield
    from compiled.runtime.llm import release_frozen_heap
    release_frozen_heap()


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """One intra-op thread for a module of tiny models: as fast, and it does not collapse (spinning
    OpenMP workers) when the CPU is shared with other processes."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def one_line_error(output: str) -> str:
    """The only line of a command's failure output (no traceback), asserted to start with error:."""
    lines = [line for line in output.splitlines() if line.strip()]
    assert "Traceback" not in output and len(lines) == 1 and lines[0].startswith("error:"), output
    return lines[0]


def run_cases(cases) -> dict[str, str]:
    """Each case function's outcome by name: "ok" or its traceback (the interpreter subprocesses
    of the kernel tests report every case to the parent this way)."""
    import traceback
    results = {}
    for fn in cases:
        try:
            fn()
            results[fn.__name__] = "ok"
        except Exception:  # reported per case by the parent
            results[fn.__name__] = traceback.format_exc()
    return results


def capture_without_host_sync(run):
    """After a first call of `run` (which compiles): one more with any host sync an error, then
    one captured in a CUDA graph; returns the graph and what the captured call returned."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


def assert_bf16_within_reference(out: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor, shape) -> None:
    """A bf16 kernel result against the bf16 torch reference and the fp32 result: at most twice
    the reference's own error from fp32 (plus 1e-3), and close to the reference."""
    err = (out.float() - exact).abs().max().item()
    ref_err = (ref.float() - exact).abs().max().item()
    assert out.dtype == torch.bfloat16 and out.shape == shape
    assert err <= 2 * ref_err + 1e-3, (err, ref_err)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def assert_same_outputs(outputs, reference, tol: float = 1e-4) -> None:
    """Two runs of the same requests (a parallel engine against one process): the same tokens and
    prompt logprobs over the same entries within `tol`."""
    for out, ref in zip(outputs, reference):
        assert out.token_ids == ref.token_ids
        assert len(out.prompt_logprobs) == len(ref.prompt_logprobs)
        for a, b in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert max(abs(a[k] - b[k]) for k in a) < tol


def prompt_logprob_gap(outputs, reference) -> tuple[float, float]:
    """The largest and the mean difference of two runs' prompt logprobs, over the entries both
    hold (top-k entries may differ where two tokens nearly tie)."""
    diffs = [abs(x[k] - y[k]) for a, b in zip(outputs, reference)
             for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]) for k in x.keys() & y.keys()]
    return max(diffs), sum(diffs) / len(diffs)


def rank_routing(weights: torch.Tensor, ids: torch.Tensor, first: int, count: int):
    """A routing over all experts as the rank holding experts [first, first + count) sees it
    under expert parallelism (`compiled::topk_route(local_experts=count)`): (its weights, 0 for
    the other ranks' pairs; its ids, made local, -1 for the others; which pairs are its)."""
    mine = (ids >= first) & (ids < first + count)
    return torch.where(mine, weights, 0.0), torch.where(mine, ids - first, -1), mine


def child_env(**overrides: str | None) -> dict:
    """The environment of a child Python process run from this checkout: the checkout first on
    PYTHONPATH and the rest of PYTHONPATH kept (an environment may provide packages through it),
    then `overrides` (None: the variable removed)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def torchrun_result(tmp_path, code: str, nproc: int = 2) -> dict:
    """Run `code` under `torchrun --nproc-per-node nproc` and return the JSON its rank 0 printed
    after "RESULT " (the other ranks' LLMs serve as workers and print nothing)."""
    import json
    import subprocess
    import sys
    script = tmp_path / "ranks.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), str(script)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0][len("RESULT "):])


# Units in the last place that two orderings of one formula may differ by, per dtype: fp32 sums
# of a few hundred terms drift by tens of ulps between BLAS kernels; a bf16 result rounds once more.
SAME_MATH_ULPS = {torch.float32: 64, torch.float64: 64, torch.bfloat16: 2, torch.float16: 2}


def same_math_tolerance(want: torch.Tensor) -> float:
    """The largest difference `assert_same_math` allows against `want`."""
    scale = max(1.0, want.detach().abs().max().item()) if want.numel() else 1.0
    return SAME_MATH_ULPS[want.dtype] * torch.finfo(want.dtype).eps * scale


def assert_same_math(got: torch.Tensor, want: torch.Tensor) -> None:
    """One formula computed by two code paths (a fused op and its parts, a kernel grouping rows
    differently, F.linear against `@`): the same dtype and shape and equal within a few units in
    the last place of want's magnitude. Bit-equality would depend on the CPU's BLAS kernels (AMD
    and Intel round such sums differently); a real bug (a missing term, a row given another's
    delta) moves values by far more, which a test shows where it matters."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    assert err <= same_math_tolerance(want), (err, same_math_tolerance(want))


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped, visibly, on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
