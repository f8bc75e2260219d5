"""Engine settings: the one place that holds the runtime's limits and defaults.

`LLM(model, **kwargs)` fills an `EngineConfig`; every CLI command reads its option defaults from
`DEFAULTS`. `resolve()` turns the user's choices (None for "pick for me") into the concrete
values the engine runs with (a torch device and dtype, a context length)."""

from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass

import torch

from compiled.compilation.split import SPLITTING_OPS
from compiled.envs import BACKENDS
from compiled.errors import ConfigError
from compiled.quant.at_load import METHODS as QUANTIZE_AT_LOAD
from compiled.runtime.loader import LOAD_FORMATS

# The step's token budget when max_num_batched_tokens is not chosen (and CP does not need more).
DEFAULT_BATCHED_TOKENS = 8192
# The op families with a kernel/reference switch: each has a `<family>_backend` field.
BACKEND_FAMILIES = ("attention", "linear", "moe", "routing", "lora")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    # Folder of a Qwen3 / Qwen3-MoE checkpoint; None: the demo MoE model shipped in the package.
    model: str | None = None
    # Tokenizer folder; None: the model's folder.
    tokenizer: str | None = None
    # None: cuda when available, else cpu.
    device: str | torch.device | None = None
    # None: bfloat16 on cuda, float32 on cpu.
    dtype: str | torch.dtype | None = None
    # "auto" reads safetensors; "dummy" fills the real shapes with random weights.
    load_format: str = "auto"
    # "fp8": quantize an unquantized checkpoint to block FP8 while loading (quant/at_load.py);
    # None: weights as the checkpoint stores them (an FP8 checkpoint stays FP8 either way).
    quantization: str | None = None
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    max_num_seqs: int = 256
    # Token budget of one step; longer prompts are prefilled in chunks of at most this many.
    # None: DEFAULT_BATCHED_TOKENS, or `cp_min_tokens` if larger when context-parallel (a smaller
    # budget would never give CP a chunk to split).
    max_num_batched_tokens: int | None = None
    # A step that also decodes carries at most this many tokens in all (its decodes and prompt
    # chunks), so that admitted prompts do not stall every running request for a whole
    # `max_num_batched_tokens` chunk (SGLang's chunked-prefill size, vLLM's
    # long_prefill_token_threshold). None: `max_piecewise_tokens`, so that such a step replays the
    # piecewise CUDA graphs. With as many requests decoding as this, new prompts wait for some to end.
    max_mixed_step_tokens: int | None = None
    # Explicit KV budget in tokens; when None it is sized from memory (see runtime/memory.py).
    kv_cache_tokens: int | None = None
    # Fraction of the GPU's memory the engine may use in all (weights + KV + activations).
    mem_fraction: float = 0.9
    seed: int = 0
    # Graph passes by name, in order; None: every pass (passes/manager.py DEFAULT_PASSES).
    passes: tuple[str, ...] | None = None
    # False: the plain eager module (no trace, no passes, no compile).
    use_graph: bool = True
    # Eager torch modules only: no Inductor, no CUDA graphs (debugging).
    enforce_eager: bool = False
    # Lower the pieces with Inductor; None means on CUDA only (CPU compiles are slow to start).
    compile: bool | None = None
    # Ops the graph is split at for Inductor and the piecewise CUDA graphs.
    splitting_ops: tuple[str, ...] = SPLITTING_OPS
    # Decode CUDA-graph buckets; None means every size up to 16, then 24, 32, ... up to
    # max_cuda_graph_batch (compilation/buckets.py).
    cuda_graph_buckets: tuple[int, ...] | None = None
    max_cuda_graph_batch: int = 256
    # Token buckets of the piecewise CUDA graphs for prefill and mixed batches (compiled model
    # only); None means 16, 32, 64, ... up to min(max_piecewise_tokens, max_num_batched_tokens).
    piecewise_buckets: tuple[int, ...] | None = None
    max_piecewise_tokens: int = 2048
    # Launch a decode step before the previous step's tokens are read back (see engine.py).
    overlap_schedule: bool = True
    # Keep finished requests' K/V indexed by (adapter, tokens) and start new requests from their
    # longest cached prefix (runtime/prefix_cache.py); `compiled serve` turns it on.
    enable_prefix_caching: bool = False
    # Load compiled pieces from this `compiled export` folder instead of compiling.
    artifact: str | None = None
    # A mismatched artifact is logged and recompiled instead of being an error.
    recompile_on_mismatch: bool = False
    # Kernel or torch reference per op family: auto (the kernel where it applies), torch, triton.
    # The COMPILED_*_BACKEND environment variables override these (compiled/envs.py).
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    moe_backend: str = "auto"
    routing_backend: str = "auto"
    lora_backend: str = "auto"       # the multi-LoRA shrink / expand ops
    # Multi-LoRA: adapters to load at start (name -> PEFT folder); enable_lora=None turns LoRA on
    # exactly when some are given. `max_loras_per_batch` GPU slots of rank up to `max_lora_rank`;
    # at most `max_loaded_loras` adapters in the CPU tier (None: no limit).
    lora_modules: dict[str, str] | None = None
    enable_lora: bool | None = None
    max_lora_rank: int = 64
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    # Fold an adapter into the dense weights while it is the only one the running requests use, so
    # that such batches run at the base model's speed (lora/merged.py); costs a copy of the weights
    # it may change (taken from the KV cache's memory). Adapters with expert weights stay unmerged.
    merge_lora: bool = False
    # Context parallelism: this many processes (one GPU each) hold the whole model, and a step with
    # a prefill chunk of at least `cp_min_tokens` tokens (and 2 per process) splits that chunk's
    # tokens over them; 1: off. Two H100s win from about 8k-16k tokens a chunk (8,192: 0.86-1.07x,
    # 16,384: 1.63-1.74x; bench/RESULTS.md); the step's token budget must be at least this large (its
    # default is, under CP). `cp_timeout`: seconds a rank may take to answer before the group counts as dead.
    context_parallel_size: int = 1
    cp_min_tokens: int = 12288
    cp_timeout: float = 60.0
    # Tensor parallelism: this many processes (one GPU each) hold a share of every layer (heads,
    # MLP and expert widths; `passes/tp_shard.py`) and run every step together; 1: off. Rank 0
    # schedules and sends each step to the others (`runtime/tensor_parallel.py`). A rank that does
    # not answer within `cp_timeout` seconds counts as dead. With context_parallel_size > 1 as well,
    # each context-parallel rank is such a group (T x C processes; `parallel/mesh.py`).
    tensor_parallel_size: int = 1
    # With tensor_parallel_size > 1: each rank holds num_experts / N whole experts instead of every
    # expert's 1/N of the width (attention stays tensor-parallel, routing is replicated).
    enable_expert_parallel: bool = False
    # Without a GPU there is no "memory left" to measure; this many bytes go to the KV cache.
    cpu_kv_cache_bytes: int = 2 << 30
    # Prompt-logprob rows are pushed through the LM head this many at a time to bound memory.
    logits_chunk: int = 1024

    @classmethod
    def from_kwargs(cls, owner: str = "LLM", **kwargs) -> EngineConfig:
        """The config of `kwargs`, checked (`validate`) before any file is read; an unknown name is
        an error listing the valid ones."""
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise TypeError(f"{owner} got an unexpected argument {unknown[0]!r} (valid: {', '.join(valid)})")
        for name, value in kwargs.items():
            kwargs[name] = _normalise(name, value)
        config = cls(**kwargs)
        config.validate()
        return config

    def resolve(self, max_position_embeddings: int) -> EngineConfig:
        """Concrete device, dtype and context length, after checking every value."""
        self.validate()
        device = resolve_device(self.device)
        max_len = max_position_embeddings if self.max_model_len is None else self.max_model_len
        for name in ("context_parallel_size", "tensor_parallel_size"):
            if device.type == "cuda" and getattr(self, name) > torch.cuda.device_count():
                raise ConfigError(f"{name}={getattr(self, name)}: only {torch.cuda.device_count()} GPU(s) are "
                                  "visible, one per process is needed")
        if device.type == "cuda" and self.world_size > torch.cuda.device_count():
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size} x context_parallel_size="
                              f"{self.context_parallel_size}: only {torch.cuda.device_count()} GPU(s) are visible, "
                              "one per process is needed")
        if self.context_parallel_size > 1 and self.max_num_batched_tokens is not None \
                and self.max_num_batched_tokens < self.cp_min_tokens:
            raise ConfigError(f"context_parallel_size={self.context_parallel_size} would never split a prefill: "
                              f"max_num_batched_tokens={self.max_num_batched_tokens} is below cp_min_tokens="
                              f"{self.cp_min_tokens}; raise max_num_batched_tokens or lower cp_min_tokens")
        if max_len > max_position_embeddings:
            raise ConfigError(f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                              f"{max_position_embeddings}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < max_len:
            # Checked here too (runtime/memory.py checks every size) so it fails before loading.
            raise kv_cache_too_small(self.kv_cache_tokens, max_len, f"kv_cache_tokens={self.kv_cache_tokens}",
                                     f"raise kv_cache_tokens to at least {max_len}")
        mixed = self.max_piecewise_tokens if self.max_mixed_step_tokens is None else self.max_mixed_step_tokens
        return dataclasses.replace(self, device=device, dtype=resolve_dtype(self.dtype, device),
                                   max_model_len=max_len, max_mixed_step_tokens=mixed,
                                   max_num_batched_tokens=self.batched_tokens)

    def validate(self) -> None:
        """Every field's type and range; the first bad one is a ConfigError naming it, its value and
        what it takes. Values that only fail deep inside the engine (a zero token budget queues
        requests that never run, a negative KV size reaches torch.zeros) are refused here."""
        for name, low in _INT_AT_LEAST.items():
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise _bad(name, value, f"an int >= {low}")
        for name, low in _OPTIONAL_INT_AT_LEAST.items():
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < low):
                raise _bad(name, value, f"None or an int >= {low}")
        if not _is_real(self.mem_fraction) or not 0 < self.mem_fraction <= 1:  # NaN fails both
            raise _bad("mem_fraction", self.mem_fraction, "a float in (0, 1]")
        if not _is_real(self.cp_timeout) or not self.cp_timeout > 0:
            raise _bad("cp_timeout", self.cp_timeout, "seconds > 0")
        if not _is_int(self.seed):
            raise _bad("seed", self.seed, "an int")
        for name in ("use_graph", "enforce_eager", "overlap_schedule", "recompile_on_mismatch",
                     "enable_prefix_caching", "merge_lora", "enable_expert_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "True or False")
        if self.compile is not None and not isinstance(self.compile, bool):
            raise _bad("compile", self.compile, "None, True or False")
        if self.enable_lora is not None and not isinstance(self.enable_lora, bool):
            raise _bad("enable_lora", self.enable_lora, "None, True or False")
        if self.lora_modules is not None and not (
                isinstance(self.lora_modules, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in self.lora_modules.items())):
            raise _bad("lora_modules", self.lora_modules, "None or a dict of adapter name -> PEFT folder")
        if self.enable_lora is False and self.lora_modules:
            raise _bad("enable_lora", False, "True (or None) when lora_modules are given")
        if self.tensor_parallel_size > 1:
            self._check_tp()
        if self.merge_lora and self.context_parallel_size > 1:
            raise _bad("merge_lora", True, "False with context_parallel_size > 1 (the other ranks hold unmerged "
                                           "weights)")
        for name in ("model", "tokenizer", "artifact"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise _bad(name, getattr(self, name), "None or a folder path")
        if self.device is not None and not isinstance(self.device, (str, torch.device)):
            raise _bad("device", self.device, "None, cpu, cuda or cuda:N")
        if self.dtype is not None and not (isinstance(self.dtype, str) and self.dtype in DTYPES) \
                and not (isinstance(self.dtype, torch.dtype) and self.dtype in DTYPES.values()):
            raise _bad("dtype", self.dtype, f"None or one of {', '.join(DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise _bad("load_format", self.load_format, f"one of {', '.join(LOAD_FORMATS)}")
        if self.quantization not in (None, *QUANTIZE_AT_LOAD):
            raise _bad("quantization", self.quantization, f"None or one of {', '.join(QUANTIZE_AT_LOAD)}")
        for name in (f"{family}_backend" for family in BACKEND_FAMILIES):
            if getattr(self, name) not in BACKENDS:
                raise _bad(name, getattr(self, name), f"one of {', '.join(BACKENDS)}")
        for name in ("passes", "splitting_ops"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, tuple) and all(isinstance(v, str) for v in value)):
                raise _bad(name, value, "None or a list of names")
        for name in ("cuda_graph_buckets", "piecewise_buckets"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, tuple) and all(_is_int(b) and b >= 1 for b in value)):
                raise _bad(name, value, "None or a list of ints >= 1")

    @property
    def lora(self) -> bool:
        """Whether the engine serves LoRA adapters."""
        return bool(self.lora_modules) if self.enable_lora is None else self.enable_lora

    @property
    def batched_tokens(self) -> int:
        """The step's token budget: the chosen one, else the default that suits the CP setting."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(DEFAULT_BATCHED_TOKENS, self.cp_min_tokens) if self.cp else DEFAULT_BATCHED_TOKENS

    def _check_tp(self) -> None:
        """What tensor parallelism does not combine with yet, refused before anything loads."""
        if self.merge_lora:
            raise _bad("merge_lora", True, "False with tensor_parallel_size > 1 (merging into sharded weights is "
                                           "not built)")

    @property
    def world_size(self) -> int:
        """The processes of one engine: each context-parallel rank is a tensor-parallel group."""
        return self.context_parallel_size * self.tensor_parallel_size

    @property
    def tp(self) -> bool:
        """Whether every layer is sharded over tensor-parallel ranks."""
        return self.tensor_parallel_size > 1

    @property
    def cp(self) -> bool:
        """Whether prefill runs context-parallel."""
        return self.context_parallel_size > 1

    @property
    def use_compile(self) -> bool:
        if self.enforce_eager:
            return False
        return self.device.type == "cuda" if self.compile is None else self.compile

    @property
    def use_cuda_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.enforce_eager

    @property
    def backends(self) -> dict[str, str]:
        """Op family -> the configured backend choice."""
        return {name: getattr(self, f"{name}_backend") for name in BACKEND_FAMILIES}


# Lower bounds of the integer settings. A context of one token could hold a prompt but not the
# token it generates, so max_model_len starts at 2.
_INT_AT_LEAST = dict(max_num_seqs=1, max_cuda_graph_batch=1, max_piecewise_tokens=1,
                     cpu_kv_cache_bytes=1, logits_chunk=1, max_lora_rank=1, max_loras_per_batch=1,
                     context_parallel_size=1, cp_min_tokens=1, tensor_parallel_size=1)
_OPTIONAL_INT_AT_LEAST = dict(max_num_batched_tokens=1, max_model_len=2, kv_cache_tokens=1, max_loaded_loras=1, max_mixed_step_tokens=1)
_SEQUENCES = ("passes", "splitting_ops", "cuda_graph_buckets", "piecewise_buckets")


def _is_int(value) -> bool:
    # bool is an int subclass, but `max_num_seqs=True` is a mistake, not 1.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _bad(name: str, value, expected: str) -> ConfigError:
    shown = repr(value).replace("\n", " ")
    return ConfigError(f"{name}={shown}: expected {expected}")


def _normalise(name: str, value):
    """What the caller meant, in the field's own type: numpy ints as ints, paths as strings, lists
    as tuples (the config is frozen and hashable). A bare string where a list of names belongs
    would be split into characters, so it stays a string and `validate` refuses it."""
    if value is None or isinstance(value, bool):
        return value
    if name in _SEQUENCES:
        if isinstance(value, (list, tuple)):
            return tuple(int(v) if _is_int(v) else v for v in value)
        return value
    if name in ("model", "tokenizer", "artifact") and isinstance(value, os.PathLike):
        return os.fspath(value)
    if _is_int(value) and not isinstance(value, int):
        return int(value)
    if name == "mem_fraction" and _is_real(value) and not isinstance(value, float):
        return float(value)
    return value


def kv_cache_too_small(slots: int, max_model_len: int, where: str, fix: str) -> ConfigError:
    """The start-up error for a KV cache that cannot hold one max_model_len sequence (as vLLM's)."""
    return ConfigError(f"the KV cache holds {slots} tokens ({where}), fewer than one max_model_len={max_model_len}"
                       f" sequence needs; {fix} or lower max_model_len to at most {slots}")


DEFAULTS = EngineConfig()


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device={device!r}: expected cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {str(device)!r} requested but CUDA is not available")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported (choose from {', '.join(DTYPES)})")
    return DTYPES[dtype]
