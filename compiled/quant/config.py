"""`quantization_config` of a config.json, validated into one frozen value.

Two formats load unchanged: block FP8 (`quant_method: fp8`, Qwen and DeepSeek: a scale per
[bo, bi] block, stored as `weight_scale_inv`) and compressed-tensors float-quantized (a scale per
output channel or per tensor, stored as `weight_scale`). Activations are dynamic (quantized at run
time) or static (a calibrated per-tensor `input_scale` beside each quantized weight); a
compressed-tensors `kv_cache_scheme` adds each attention's calibrated `k_scale` and `v_scale`.
Every error names the field at fault."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

from compiled.errors import ConfigError

QUANT_METHODS = ("fp8", "compressed-tensors")
SCHEMES = ("block", "channel", "tensor")
# The projections a format may quantize; embeddings, norms, the router and the LM head stay in
# the engine dtype whatever the ignore list says.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ACTIVATION_SCHEMES = ("dynamic", "static")
INPUT_SCALE = "input_scale"   # a static scheme's per-tensor activation scale, beside each quantized weight
KV_SCALES = ("k_scale", "v_scale")   # a kv_cache_scheme's, beside each attention's projections


@dataclass(frozen=True)
class QuantConfig:
    method: str                           # one of QUANT_METHODS
    scheme: str                           # "block", "channel" (a scale per output row) or "tensor"
    block: tuple[int, int] | None = None  # (rows, cols) of a scale block, for "block"
    ignore: tuple[str, ...] = ()          # module names or `re:` patterns left unquantized
    # "static": the checkpoint holds INPUT_SCALE tensors, checked and not used: the W8A8 kernels
    # quantize activations per token and group at run time, finer than one scale a tensor
    activation_scheme: str = "dynamic"
    # a kv_cache_scheme's KV_SCALES, checked and not used: the KV cache stays in the engine dtype
    kv_cache_scales: bool = False

    @property
    def scale_suffix(self) -> str:
        """The checkpoint name of a weight's scale, next to its `weight`."""
        return "weight_scale_inv" if self.method == "fp8" else "weight_scale"

    def quantizes(self, module: str) -> bool:
        """Whether the linear `module` (e.g. `model.layers.0.mlp.experts.3.up_proj`) is FP8."""
        if module.rpartition(".")[2] not in PROJECTIONS:
            return False
        return not any(_matches(pattern, module) for pattern in self.ignore)

    @property
    def op_block(self) -> tuple[int, int]:
        """The ops' `weight_block` operand: a side of 0 spans the whole dim, so per channel is
        (1, 0) and per tensor (0, 0)."""
        if self.scheme == "block":
            return self.block
        return (1, 0) if self.scheme == "channel" else (0, 0)

    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """The scale tensor's shape for a `[rows, cols]` weight (per tensor: one element)."""
        if self.scheme == "block":
            bo, bi = self.block
            return (math.ceil(rows / bo), math.ceil(cols / bi))
        return (rows, 1) if self.scheme == "channel" else (1,)


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def parse_quantization(raw: object, fail: Callable[[str], ConfigError]) -> QuantConfig | None:
    """The `quantization_config` object of a config.json (None when absent)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise fail(f"field 'quantization_config' must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method not in QUANT_METHODS:
        raise fail(f"field 'quantization_config.quant_method' is {method!r} (supported: {', '.join(QUANT_METHODS)})")
    return _block_fp8(raw, fail) if method == "fp8" else _compressed_tensors(raw, fail)


def _block_size(value: object, field: str, fail: Callable[[str], ConfigError]) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise fail(f"field {field!r} must be two positive ints, got {value!r}")
    return int(value[0]), int(value[1])


def _ignore_list(raw: dict, key: str, fail: Callable[[str], ConfigError]) -> tuple[str, ...]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise fail(f"field 'quantization_config.{key}' must be a list of module names, got {value!r}")
    for pattern in value:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as e:
                raise fail(f"field 'quantization_config.{key}' has a bad pattern {pattern!r} ({e})") from None
    return tuple(value)


def _block_fp8(raw: dict, fail: Callable[[str], ConfigError]) -> QuantConfig:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise fail(f"field 'quantization_config.fmt' is {fmt!r} (supported: 'e4m3')")
    activations = raw.get("activation_scheme", "dynamic")
    if activations not in ACTIVATION_SCHEMES:
        raise fail(f"field 'quantization_config.activation_scheme' is {activations!r} "
                   f"(supported: {', '.join(map(repr, ACTIVATION_SCHEMES))})")
    if raw.get("weight_block_size") is None:
        raise fail("field 'quantization_config.weight_block_size' is missing (per-tensor fp8 is not supported)")
    block = _block_size(raw["weight_block_size"], "quantization_config.weight_block_size", fail)
    # transformers writes `modules_to_not_convert`, vLLM's own FP8 files `ignored_layers`: either leaves a module 16-bit
    ignore = _ignore_list(raw, "modules_to_not_convert", fail) + _ignore_list(raw, "ignored_layers", fail)
    return QuantConfig("fp8", "block", block, ignore, activations)


def _compressed_tensors(raw: dict, fail: Callable[[str], ConfigError]) -> QuantConfig:
    fmt = raw.get("format")
    if fmt != "float-quantized":
        raise fail(f"field 'quantization_config.format' is {fmt!r} (supported: 'float-quantized')")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise fail("field 'quantization_config.config_groups' must be a non-empty object")
    schemes = {_group_weights(name, group, fail) for name, group in groups.items()}
    if len(schemes) > 1:
        raise fail(f"field 'quantization_config.config_groups' mixes weight schemes {sorted(map(str, schemes))}")
    activations = {_group_activations(name, group, fail) for name, group in groups.items()}
    if len(activations) > 1:
        raise fail("field 'quantization_config.config_groups' mixes static and dynamic input_activations")
    kv = raw.get("kv_cache_scheme")
    if kv is not None:
        if not isinstance(kv, dict):
            raise fail(f"field 'quantization_config.kv_cache_scheme' must be an object or null, got {kv!r}")
        _check_float8(kv, "quantization_config.kv_cache_scheme", "KV cache scales", fail)
    scheme, block = schemes.pop()
    return QuantConfig("compressed-tensors", scheme, block, _ignore_list(raw, "ignore", fail), activations.pop(),
                       kv_cache_scales=kv is not None)


def _group_weights(name: str, group: object, fail: Callable[[str], ConfigError]) -> tuple[str, tuple | None]:
    """(scheme, block) of one config group's `weights`: 8-bit floats, per channel, tensor or block."""
    field = f"quantization_config.config_groups.{name}.weights"
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        raise fail(f"field {field!r} must be an object")
    _check_float8(weights, field, "weights", fail)
    strategy = weights.get("strategy")
    if strategy not in SCHEMES:
        raise fail(f"field '{field}.strategy' is {strategy!r} (supported: {', '.join(SCHEMES)})")
    block = _block_size(weights.get("block_structure"), f"{field}.block_structure", fail) \
        if strategy == "block" else None
    return strategy, block


def _group_activations(name: str, group: dict, fail: Callable[[str], ConfigError]) -> str:
    """The activation scheme of one config group: "dynamic" (quantized at run time, or left
    16-bit: no `input_activations`) or "static" (8-bit floats, one stored scale a tensor)."""
    field = f"quantization_config.config_groups.{name}.input_activations"
    acts = group.get("input_activations")
    if acts is None:
        return "dynamic"
    if not isinstance(acts, dict):
        raise fail(f"field {field!r} must be an object or null")
    _check_float8(acts, field, "activations", fail)
    dynamic = acts.get("dynamic", False)   # compressed-tensors' default
    if type(dynamic) is not bool:
        raise fail(f"field '{field}.dynamic' must be true or false, got {dynamic!r}")
    if dynamic:
        return "dynamic"
    if acts.get("strategy") != "tensor":
        raise fail(f"field '{field}.strategy' is {acts.get('strategy')!r} with static scales (supported: 'tensor')")
    return "static"


def _check_float8(args: dict, field: str, what: str, fail: Callable[[str], ConfigError]) -> None:
    """A one-line error unless the quantization args at `field` say 8-bit floats."""
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise fail(f"field {field!r} must be 8-bit float {what}, got num_bits={args.get('num_bits')!r} "
                   f"type={args.get('type')!r}")
