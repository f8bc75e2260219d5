"""The validated model config: the one source of truth for every shape."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from compiled.errors import ConfigError
from compiled.json_file import read_json_object
from compiled.quant.config import QuantConfig, parse_quantization

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# model_type -> architecture, for a config.json without "architectures" (what a bare
# `Qwen3MoeConfig(...).save_pretrained` writes); transformers' Auto classes resolve it the same way.
MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # MoE fields; num_experts == 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    # FP8 weights (`quantization_config`); None: every weight in the engine dtype.
    quantization: QuantConfig | None = None
    source: str = field(default="", compare=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        # The same rule as HF's Qwen3MoeDecoderLayer.
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def projection_shape(self, proj: str, expert: bool = False) -> tuple[int, int]:
        """(in, out) of a projection of a layer (`expert`: of one MoE expert)."""
        h, inter = self.hidden_size, self.moe_intermediate_size if expert else self.intermediate_size
        return {"q_proj": (h, self.q_size), "k_proj": (h, self.kv_size), "v_proj": (h, self.kv_size),
                "o_proj": (self.q_size, h), "gate_proj": (h, inter), "up_proj": (h, inter),
                "down_proj": (inter, h)}[proj]

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer, per element size 1 (multiply by the dtype's size)."""
        return 2 * self.num_hidden_layers * self.kv_size

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise ConfigError(f"{file}: config.json not found")
        return cls.from_dict(read_json_object(file), source=file)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        return _parse(raw, source)


class _Fields:
    """Typed reads of one config.json, each error naming the file and the field."""

    def __init__(self, raw: dict, source: str) -> None:
        self.raw, self.source = raw, source

    def fail(self, msg: str) -> ConfigError:
        return ConfigError(f"{self.source}: {msg}")

    def get(self, name: str, kind: type, default=None, *aliases: str):
        for key in (name, *aliases):
            if key in self.raw and self.raw[key] is not None:
                value = self.raw[key]
                break
        else:
            if default is None:
                raise self.fail(f"missing field {name!r}")
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(f"field {name!r} must be {kind.__name__}, got {value!r}")
        return value

    def positive(self, name: str, kind: type = int, default=None):
        value = self.get(name, kind, default)
        if value <= 0:
            raise self.fail(f"field {name!r} must be positive, got {value}")
        return value


def _architecture(f: _Fields) -> str:
    """`architectures[0]`, else the one `model_type` names (a bare `save_pretrained`'s config)."""
    archs = f.raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch is None and f.raw.get("model_type") is not None:
        model_type = f.raw["model_type"]
        arch = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
        if arch is None:
            raise f.fail(f"no 'architectures' and unsupported model_type {model_type!r} "
                         f"(supported: {', '.join(MODEL_TYPES)})")
    if arch is None:
        raise f.fail(f"neither 'architectures' nor 'model_type' is set (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise f.fail(f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return arch


def _rope_theta(f: _Fields) -> float:
    """The default RoPE's theta; any other rope type, or sliding windows, are refused."""
    rope = f.raw.get("rope_parameters") or f.raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise f.fail(f"field 'rope_parameters' must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise f.fail(f"unsupported rope_type {rope_type!r} (only 'default')")
    if f.raw.get("use_sliding_window"):
        raise f.fail("sliding-window attention is not supported")
    return float(rope.get("rope_theta", f.raw.get("rope_theta", 1_000_000.0)))


def _int_list(f: _Fields, name: str) -> tuple[int, ...]:
    """`mlp_only_layers` (a list) or `eos_token_id` (an int or a list) as a tuple of ints >= 0."""
    value = f.raw.get(name)
    items = value if isinstance(value, list) else ([] if value is None else [value])
    if (name == "mlp_only_layers" and value is not None and not isinstance(value, list)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in items):
        what = "a list of layer indices" if name == "mlp_only_layers" else "an int or a list of ints >= 0"
        raise f.fail(f"field {name!r} must be {what}, got {value!r}")
    return tuple(items)


def _moe_fields(f: _Fields) -> dict:
    """The expert settings of a Qwen3MoeForCausalLM, checked against each other."""
    num_experts = f.get("num_experts", int, 0, "num_local_experts")
    if num_experts <= 0:
        raise f.fail("field 'num_experts' must be positive for Qwen3MoeForCausalLM")
    top_k = f.get("num_experts_per_tok", int, 0)
    if not 0 < top_k <= num_experts:
        raise f.fail(f"field 'num_experts_per_tok' must be in 1..{num_experts}, got {top_k}")
    width = f.get("moe_intermediate_size", int, 0)
    if width <= 0:
        raise f.fail("field 'moe_intermediate_size' must be positive")
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                norm_topk_prob=f.get("norm_topk_prob", bool, False),
                decoder_sparse_step=f.positive("decoder_sparse_step", int, 1))


def _parse(raw: dict, source: str) -> ModelConfig:
    f = _Fields(raw, source)
    arch = _architecture(f)
    hidden, heads = f.positive("hidden_size"), f.positive("num_attention_heads")
    kv_heads = f.positive("num_key_value_heads", int, heads)
    if heads % kv_heads:
        raise f.fail(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
    if f.get("hidden_act", str, "silu") != "silu":
        raise f.fail(f"unsupported hidden_act {raw['hidden_act']!r} (only 'silu')")
    is_moe = arch == "Qwen3MoeForCausalLM"
    rope_theta = _rope_theta(f)
    moe = _moe_fields(f) if is_moe else {}
    return ModelConfig(
        architecture=arch,
        vocab_size=f.positive("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.positive("intermediate_size"),
        num_hidden_layers=f.positive("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        # HF's defaults differ: Qwen3Config has head_dim=128, Qwen3MoeConfig derives it.
        head_dim=f.positive("head_dim", int, hidden // heads if is_moe else 128),
        rms_norm_eps=f.get("rms_norm_eps", float, 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=f.positive("max_position_embeddings", int, 40960),
        tie_word_embeddings=f.get("tie_word_embeddings", bool, False),
        attention_bias=f.get("attention_bias", bool, False),
        mlp_only_layers=_int_list(f, "mlp_only_layers"),
        eos_token_ids=_int_list(f, "eos_token_id"),
        quantization=parse_quantization(raw.get("quantization_config"), f.fail),
        source=source,
        **moe,
    )
