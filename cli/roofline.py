"""The decode bandwidth floor: bytes one decode step must read, over the device's copy bandwidth.

Decode is bandwidth-bound: each step reads every weight that any token in the batch uses, plus
the KV cache of every request. For a batch of B tokens this is

    all non-expert weights (attention, norms, routers, dense MLPs)      read once per step
  + the LM head                                                         read once per step
  + B rows of the embedding table
  + per MoE layer: expected distinct experts E·(1 - (1 - k/E)^B) × bytes per expert
  + the KV cache: context tokens × 2 (K, V) × layers × kv_heads × head_dim × element size

(uniform routing: each token picks k of E experts, so an expert is missed by all B tokens with
probability (1 - k/E)^B). With FP8 weights the projections and experts count one byte an element
plus their fp32 block scales; embeddings, norms, routers and the LM head keep the engine dtype. Dividing by the device bandwidth, measured as (bytes read + bytes
written) / time of a large copy, gives the floor time of one step.

`device_bandwidth` measures that copy once per device and caches it in
$XDG_CACHE_HOME/compiled/bandwidth.json (default ~/.cache/compiled/)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import compiled.envs as envs
from compiled.graphs.config import ModelConfig
from compiled.quant.config import QuantConfig

# ---- bytes per decode step ---------------------------------------------------------------


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts that `tokens` tokens touch, each choosing `top_k` of
    `num_experts` uniformly: E·(1 - (1 - k/E)^B)."""
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def attention_params(cfg: ModelConfig) -> int:
    """q/k/v/o projections (+ biases) and the q/k RMSNorm weights of one layer."""
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    n = h * (q + 2 * kv) + q * h + 2 * cfg.head_dim
    if cfg.attention_bias:
        n += q + 2 * kv + h
    return n


def expert_params(cfg: ModelConfig) -> int:
    """gate, up and down of one expert."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def dense_mlp_params(cfg: ModelConfig) -> int:
    return 3 * cfg.hidden_size * cfg.intermediate_size


def num_moe_layers(cfg: ModelConfig) -> int:
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def projection_params(cfg: ModelConfig) -> int:
    """The q/k/v/o weights of one layer (what FP8 quantizes of attention)."""
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    return h * (q + 2 * kv) + q * h


def fp8_bytes_per_element(quant: QuantConfig | None, dtype_bytes: int) -> float:
    """Bytes an element of a quantized linear costs: the fp8 byte plus its share of a 4-byte scale."""
    if quant is None:
        return float(dtype_bytes)
    return 1.0 + (4.0 / (quant.block[0] * quant.block[1]) if quant.scheme == "block" else 0.0)


def non_expert_bytes(cfg: ModelConfig, dtype_bytes: int, quant: QuantConfig | None) -> float:
    """`non_expert_params` in bytes, the projections and dense MLPs at their FP8 size under `quant`."""
    linear = cfg.num_hidden_layers * projection_params(cfg) + \
        (cfg.num_hidden_layers - num_moe_layers(cfg)) * dense_mlp_params(cfg)
    return (non_expert_params(cfg) - linear) * dtype_bytes + linear * fp8_bytes_per_element(quant, dtype_bytes)


def non_expert_params(cfg: ModelConfig) -> int:
    """Every per-layer weight that is not an expert (attention, norms, routers, dense MLPs) plus
    the final norm; the embedding and LM head are counted separately."""
    moe = num_moe_layers(cfg)
    dense = cfg.num_hidden_layers - moe
    per_layer = attention_params(cfg) + 2 * cfg.hidden_size
    return (cfg.num_hidden_layers * per_layer + moe * cfg.hidden_size * cfg.num_experts
            + dense * dense_mlp_params(cfg) + cfg.hidden_size)


def total_params(cfg: ModelConfig) -> int:
    """All parameters of the model (a tied LM head counts once)."""
    embed = cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else embed
    return non_expert_params(cfg) + num_moe_layers(cfg) * cfg.num_experts * expert_params(cfg) + embed + head


@dataclass(frozen=True)
class DecodeBytes:
    """Bytes one decode step reads, by kind (see the module docstring)."""
    batch: int
    context: int                 # tokens in the KV cache per request
    non_expert: float
    lm_head: int
    embedding_rows: int
    experts: float
    kv: int
    experts_per_layer: float
    bytes_per_expert: float

    @property
    def weights(self) -> float:
        return self.non_expert + self.lm_head + self.embedding_rows + self.experts

    @property
    def total(self) -> float:
        return self.weights + self.kv

    def floor_s(self, bandwidth: float) -> float:
        """Seconds to read `total` bytes at `bandwidth` bytes/s."""
        return self.total / bandwidth

    def as_dict(self) -> dict:
        return dict(asdict(self), weights=self.weights, total=self.total)


def decode_bytes(cfg: ModelConfig, batch: int, context: int | list[int], dtype_bytes: int = 2,
                 quant: QuantConfig | None = None) -> DecodeBytes:
    """Bytes read by one decode step of `batch` requests, each with `context` tokens of KV (or a
    list of per-request contexts), with weights and KV in a `dtype_bytes`-sized dtype (the
    quantized linears of `quant` in FP8)."""
    contexts = [context] * batch if isinstance(context, int) else list(context)
    if len(contexts) != batch:
        raise ValueError(f"got {len(contexts)} contexts for a batch of {batch}")
    per_expert = expert_params(cfg) * fp8_bytes_per_element(quant, dtype_bytes)
    experts = expected_experts(cfg.num_experts, cfg.num_experts_per_tok, batch) if cfg.is_moe else 0.0
    return DecodeBytes(
        batch=batch,
        context=round(sum(contexts) / batch) if batch else 0,
        non_expert=non_expert_bytes(cfg, dtype_bytes, quant),
        lm_head=cfg.vocab_size * cfg.hidden_size * dtype_bytes,
        embedding_rows=batch * cfg.hidden_size * dtype_bytes,
        experts=num_moe_layers(cfg) * experts * per_expert,
        kv=sum(contexts) * cfg.kv_bytes_per_token * dtype_bytes,
        experts_per_layer=experts,
        bytes_per_expert=per_expert,
    )


# ---- device bandwidth ----------------------------------------------------------------------


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "cpu"
    n = torch.get_num_threads()
    return f"{name} ({n} thread{'' if n == 1 else 's'})"


def cache_dir() -> Path:
    base = envs.read("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "compiled"


def measure_bandwidth(device: torch.device | str, nbytes: int | None = None, iters: int | None = None) -> float:
    """Copy bandwidth in bytes/s: (bytes read + bytes written) / time of a large copy, median of
    `iters` copies after a warm-up. CUDA: device-to-device, timed with events; CPU: memcpy."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    if nbytes is None:
        nbytes = 1 << 30 if cuda else 256 << 20
        if cuda:
            nbytes = min(nbytes, torch.cuda.mem_get_info(device)[0] // 4)
    iters = iters or (20 if cuda else 5)
    n = nbytes // 4
    src = torch.rand(n, device=device)   # random, not zeros
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * n * 4 / statistics.median(times)


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float
    device: str
    source: str    # "measured", "cache" or "given"

    def as_dict(self) -> dict:
        return asdict(self)


def device_bandwidth(device: torch.device | str, remeasure: bool = False) -> Bandwidth:
    """The device's copy bandwidth, measured once and cached per device name."""
    device = torch.device(device)
    name = device_name(device)
    key = f"{device.type}:{name}"
    file = cache_dir() / "bandwidth.json"
    cached: dict = {}
    try:
        cached = json.loads(file.read_text())
        if not isinstance(cached, dict):
            cached = {}
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key)
    if not remeasure and isinstance(entry, dict) and isinstance(entry.get("bytes_per_s"), (int, float)):
        return Bandwidth(float(entry["bytes_per_s"]), name, "cache")
    bw = measure_bandwidth(device)
    cached[key] = {"bytes_per_s": bw, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__}
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(file)
    except OSError:
        pass  # a read-only home still gets a number, just not a cached one
    return Bandwidth(bw, name, "measured")
