"""The validated model config: the one source of truth for every shape."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from compiled.errors import ConfigError
from compiled.json_file import read_json_object

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


def _parse(raw: dict, source: str) -> ModelConfig:
    def fail(msg: str) -> ConfigError:
        return ConfigError(f"{source}: {msg}")

    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch is None and raw.get("model_type") is not None:
        model_type = raw["model_type"]
        arch = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
        if arch is None:
            raise fail(f"no 'architectures' and unsupported model_type {model_type!r} "
                       f"(supported: {', '.join(MODEL_TYPES)})")
    if arch is None:
        raise fail(f"neither 'architectures' nor 'model_type' is set (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise fail(f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def get(name: str, kind: type, default=None, *aliases: str):
        for key in (name, *aliases):
            if key in raw and raw[key] is not None:
                value = raw[key]
                break
        else:
            if default is None:
                raise fail(f"missing field {name!r}")
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise fail(f"field {name!r} must be {kind.__name__}, got {value!r}")
        return value

    def positive(name: str, value: int) -> int:
        if value <= 0:
            raise fail(f"field {name!r} must be positive, got {value}")
        return value

    hidden = positive("hidden_size", get("hidden_size", int))
    heads = positive("num_attention_heads", get("num_attention_heads", int))
    kv_heads = positive("num_key_value_heads", get("num_key_value_heads", int, heads))
    if heads % kv_heads:
        raise fail(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
    if get("hidden_act", str, "silu") != "silu":
        raise fail(f"unsupported hidden_act {raw['hidden_act']!r} (only 'silu')")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise fail(f"field 'rope_parameters' must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise fail(f"unsupported rope_type {rope_type!r} (only 'default')")
    rope_theta = rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))
    if raw.get("use_sliding_window"):
        raise fail("sliding-window attention is not supported")

    is_moe = arch == "Qwen3MoeForCausalLM"
    num_experts = get("num_experts", int, 0, "num_local_experts") if is_moe else 0
    if is_moe and num_experts <= 0:
        raise fail("field 'num_experts' must be positive for Qwen3MoeForCausalLM")
    layers = positive("num_hidden_layers", get("num_hidden_layers", int))
    mlp_only = raw.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise fail(f"field 'mlp_only_layers' must be a list of layer indices, got {mlp_only!r}")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos_ids):
        raise fail(f"field 'eos_token_id' must be an int or a list of ints >= 0, got {eos!r}")

    cfg = ModelConfig(
        architecture=arch,
        vocab_size=positive("vocab_size", get("vocab_size", int)),
        hidden_size=hidden,
        intermediate_size=positive("intermediate_size", get("intermediate_size", int)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        # HF's defaults differ: Qwen3Config has head_dim=128, Qwen3MoeConfig derives it.
        head_dim=positive("head_dim", get("head_dim", int, hidden // heads if is_moe else 128)),
        rms_norm_eps=get("rms_norm_eps", float, 1e-6),
        rope_theta=float(rope_theta),
        max_position_embeddings=positive("max_position_embeddings", get("max_position_embeddings", int, 40960)),
        tie_word_embeddings=get("tie_word_embeddings", bool, False),
        attention_bias=get("attention_bias", bool, False),
        num_experts=num_experts,
        num_experts_per_tok=get("num_experts_per_tok", int, 0) if is_moe else 0,
        moe_intermediate_size=get("moe_intermediate_size", int, 0) if is_moe else 0,
        norm_topk_prob=get("norm_topk_prob", bool, False) if is_moe else True,
        decoder_sparse_step=positive("decoder_sparse_step", get("decoder_sparse_step", int, 1)) if is_moe else 1,
        mlp_only_layers=tuple(mlp_only),
        eos_token_ids=eos_ids,
        source=source,
    )
    if is_moe and not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise fail(f"field 'num_experts_per_tok' must be in 1..{cfg.num_experts}, got {cfg.num_experts_per_tok}")
    if is_moe and cfg.moe_intermediate_size <= 0:
        raise fail("field 'moe_intermediate_size' must be positive")
    return cfg
