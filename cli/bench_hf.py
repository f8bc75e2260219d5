"""`compiled bench --compare hf`: the same workload through HF transformers in the same process.

The model is `AutoModelForCausalLM` on the same device and dtype: `from_pretrained` for a
checkpoint, `from_config` (random weights, built on the device) for `--load-format dummy`; MoE
models use `experts_implementation="grouped_mm"` (HF's fastest experts). Latency times each
decode step with a DynamicCache and greedy argmax; throughput runs `generate` on batches."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from cli.bench_core import Item, free_memory, summary_ms, sync


def _implementation(cfg) -> dict:
    archs = getattr(cfg, "architectures", None) or []
    return {"experts_implementation": "grouped_mm"} if any("Moe" in a for a in archs) else {}


def load(model_path: str, load_format: str, device: torch.device, dtype: torch.dtype, seed: int):
    """(model, load seconds, description)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    cfg = AutoConfig.from_pretrained(model_path)
    kwargs = _implementation(cfg)
    if load_format == "dummy":
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **kwargs).to(device)
    model.eval()
    sync(device)
    how = "from_config" if load_format == "dummy" else "from_pretrained"
    desc = f"transformers AutoModelForCausalLM.{how}" + "".join(f", {k}={v}" for k, v in kwargs.items())
    return model, time.perf_counter() - t0, desc


@torch.inference_mode()
def _latency_once(model, ids: torch.Tensor, output_len: int, device: torch.device) -> tuple[float, list[float]]:
    from transformers import DynamicCache
    sync(device)
    t0 = time.perf_counter()
    cache = DynamicCache(config=model.config)
    out = model(ids, past_key_values=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    sync(device)
    ttft = time.perf_counter() - t0
    steps = []
    for _ in range(output_len - 1):
        s = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        sync(device)
        steps.append(time.perf_counter() - s)
    return ttft, steps


def latency(model_path: str, load_format: str, device: torch.device, dtype: torch.dtype, seed: int,
            prompts: list[list[int]], output_len: int, iters: int, warmup: int) -> dict:
    """Prefill the batch (TTFT), then `output_len - 1` decode steps, timed one by one."""
    model, load_s, desc = load(model_path, load_format, device, dtype, seed)
    try:
        ids = torch.tensor(prompts, device=device)
        for _ in range(warmup):
            _latency_once(model, ids, output_len, device)
        runs = [_latency_once(model, ids, output_len, device) for _ in range(iters)]
    finally:
        del model
        free_memory(device)
    steps = [s for _, ss in runs for s in ss]
    elapsed = sum(t + sum(ss) for t, ss in runs)
    out_tokens = iters * len(prompts) * output_len
    decode = summary_ms(steps)
    return {
        "implementation": desc, "load_s": load_s,
        "ttft_ms": summary_ms([t for t, _ in runs]),
        "decode_step_ms": decode,
        "decode_tokens_per_s": len(prompts) / (decode["p50"] / 1e3) if decode else None,
        "elapsed_s": elapsed, "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / elapsed,
    }


@torch.inference_mode()
def _generate(model, batch: Sequence[Item], device: torch.device, pad_id: int) -> None:
    longest = max(len(it.prompt) for it in batch)
    n = max(it.output_len for it in batch)
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for i, it in enumerate(batch):   # left padding
        ids[i, longest - len(it.prompt):] = torch.tensor(it.prompt)
        mask[i, longest - len(it.prompt):] = 1
    model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=n, min_new_tokens=n,
                   do_sample=False, pad_token_id=pad_id)


def throughput(model_path: str, load_format: str, device: torch.device, dtype: torch.dtype, seed: int,
               items: Sequence[Item], max_batch: int, tokenizer=None) -> dict:
    """`generate` over the requests in batches of `max_batch` (left-padded, each batch runs to
    its longest output); tokens counted are the ones the requests asked for."""
    if any(isinstance(it.prompt, str) for it in items):
        if tokenizer is None:
            raise ValueError("--compare hf needs token ids or a tokenizer for text prompts")
        items = [Item(tokenizer.encode(it.prompt) if isinstance(it.prompt, str) else it.prompt, it.output_len)
                 for it in items]
    model, load_s, desc = load(model_path, load_format, device, dtype, seed)
    try:
        pad = model.generation_config.pad_token_id
        pad = pad if isinstance(pad, int) else 0
        _generate(model, items[:min(len(items), 2)], device, pad)   # warm-up
        sync(device)
        t0 = time.perf_counter()
        for i in range(0, len(items), max_batch):
            _generate(model, items[i:i + max_batch], device, pad)
        sync(device)
        elapsed = time.perf_counter() - t0
    finally:
        del model
        free_memory(device)
    inp = sum(len(it.prompt) for it in items)
    out = sum(it.output_len for it in items)
    return {
        "implementation": desc + ", generate (greedy, left-padded batches)", "load_s": load_s,
        "batch_size": max_batch, "num_requests": len(items), "elapsed_s": elapsed,
        "input_tokens": inp, "output_tokens": out, "total_tokens": inp + out,
        "requests_per_s": len(items) / elapsed, "output_tokens_per_s": out / elapsed,
        "total_tokens_per_s": (inp + out) / elapsed,
    }


def startup(model_path: str, load_format: str, device: torch.device, dtype: torch.dtype, seed: int,
            prompt: list[int]) -> dict:
    """Model construction/loading, then one request's first token (cold, then warm)."""
    model, load_s, desc = load(model_path, load_format, device, dtype, seed)
    try:
        ids = torch.tensor([prompt], device=device)
        cold, _ = _latency_once(model, ids, 1, device)
        warm, _ = _latency_once(model, ids, 1, device)
    finally:
        del model
        free_memory(device)
    return {"implementation": desc, "stages_s": {"load": load_s}, "llm_init_s": load_s,
            "ttft_cold_s": cold, "ttft_warm_s": warm, "total_s": load_s + cold}
