"""FP8 checkpoint tensors paired with their scales as they stream from the shards.

A quantized linear arrives as `weight` (float8_e4m3fn) and its scale (`weight_scale_inv` for
block FP8, `weight_scale` for compressed-tensors), in either order and possibly in different
shards; each pair leaves as one weight under the linear's `weight` name, so the weight map's
recipes (fused qkv, stacked experts) place it exactly as they place an unquantized one. Both
halves stay views of the mapped files until they meet. Calibration's scales that the engine does
not use (a static activation scheme's `input_scale`s, a KV cache scheme's `k_scale` / `v_scale`)
are checked and dropped here (`CalibrationScales`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

from compiled.errors import CheckpointError, ConfigError
from compiled.quant.config import INPUT_SCALE, KV_SCALES, QuantConfig
from compiled.quant.dequant import FP8, dequantize, quantize

if TYPE_CHECKING:
    from compiled.quant.at_load import Part

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
Stream = Iterable[tuple[str, str, torch.Tensor]]


def dequantized_stream(tensors: Stream, quant: QuantConfig | None, keep: set[str] = frozenset(),
                       quantize_weights: bool = False, device: torch.device | str = "cpu",
                       parts: dict[str, Part] | None = None
                       ) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(origin, name, tensor) with every FP8 weight and its scale merged into one dequantized
    float32 weight, except the weights of `keep` (parameters that stay FP8), which pass as they
    are with their scales; float8 tensors without a quantization_config are refused. With
    `quantize_weights` the checkpoint is unquantized and each weight `quant` covers is quantized
    here, one tensor at a time (of those in `parts`, only the blocks a tensor-parallel rank's
    slice touches: `at_load.rank_parts`). The arithmetic runs on `device` (the parameters')."""
    if quant is None:
        yield from _unquantized(tensors)
        return
    if quantize_weights:
        yield from _quantized_at_load(tensors, quant, keep, device, parts or {})
        return
    weights: dict[str, tuple[str, torch.Tensor]] = {}
    scales: dict[str, tuple[str, torch.Tensor]] = {}
    calibration = CalibrationScales(quant)
    for origin, name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        if calibration.take(origin, module, leaf, tensor):
            continue
        if not quant.quantizes(module) or leaf not in ("weight", quant.scale_suffix):
            if tensor.dtype in FLOAT8:
                raise CheckpointError(f"{origin}: tensor {name!r} is {tensor.dtype} but quantization_config "
                                      f"leaves {module!r} unquantized")
            yield origin, name, tensor
            continue
        if leaf == "weight":
            _check_fp8(origin, module, tensor)
            calibration.expect(origin, module)
        if f"{module}.weight" in keep:
            yield origin, name, tensor
            continue
        (weights if leaf == "weight" else scales)[module] = (origin, tensor)
        if module in weights and module in scales:
            yield weights[module][0], f"{module}.weight", _pair(module, weights.pop(module), scales.pop(module), quant, device)
    for module, (origin, _) in weights.items():
        raise CheckpointError(f"{origin}: missing tensor '{module}.{quant.scale_suffix}' (the scale of "
                              f"float8 weight '{module}.weight')")
    calibration.check_complete()


class CalibrationScales:
    """Scales from calibration that the engine checks (each one positive float) and does not use:
    a static activation scheme's `input_scale` beside every quantized weight (the kernels quantize
    activations per token at run time; each weight needs one) and a KV cache scheme's `k_scale` /
    `v_scale` beside an attention (the KV cache stays in the engine dtype; optional)."""

    def __init__(self, quant: QuantConfig) -> None:
        self.quant = quant
        self.static = quant.activation_scheme == "static"
        self.weights: dict[str, str] = {}   # quantized module -> the file of its weight (static scheme)
        self.seen: set[str] = set()

    def take(self, origin: str, module: str, leaf: str, tensor: torch.Tensor) -> bool:
        """Whether the tensor is such a scale (checked and dropped)."""
        if self.static and leaf == INPUT_SCALE and self.quant.quantizes(module):
            self.seen.add(module)
            kind = "a static per-tensor activation scale"
        elif self.quant.kv_cache_scales and leaf in KV_SCALES and module.rpartition(".")[2] == "self_attn":
            kind = "a per-tensor KV cache scale"
        else:
            return False
        what = f"shape {list(tensor.shape)} dtype {tensor.dtype}"
        ok = tensor.numel() == 1 and tensor.is_floating_point() and tensor.dtype not in FLOAT8
        if ok:
            value = float(tensor.reshape(()))
            ok, what = math.isfinite(value) and value > 0, f"{value!r}"
        if not ok:
            raise CheckpointError(f"{origin}: tensor '{module}.{leaf}' must be one positive float ({kind}), got {what}")
        return True

    def expect(self, origin: str, module: str) -> None:
        if self.static:
            self.weights[module] = origin

    def check_complete(self) -> None:
        missing = sorted(set(self.weights) - self.seen)
        if missing:
            raise CheckpointError(f"{self.weights[missing[0]]}: missing tensor '{missing[0]}.{INPUT_SCALE}' "
                                  f"(quantization_config's activations are static)")


def _quantized_at_load(tensors: Stream, quant: QuantConfig, keep: set[str], device: torch.device | str,
                       parts: dict[str, Part]) -> Iterator[tuple[str, str, torch.Tensor]]:
    for origin, name, tensor in _unquantized(tensors):
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or not quant.quantizes(module):
            yield origin, name, tensor
            continue
        part = parts.get(name)
        if part is not None:
            if tuple(tensor.shape) != part.shape:
                raise CheckpointError(f"{origin}: tensor {name!r} has shape {list(tensor.shape)}, expected "
                                      f"{list(part.shape)}")
            tensor = tensor.narrow(part.dim, part.start, part.length)
        q, s = quantize(tensor.to(device), quant)
        if name in keep:
            yield origin, name, q
            yield origin, f"{module}.{quant.scale_suffix}", s
        else:   # a parameter without one block grid: FP8's rounding, the engine dtype
            yield origin, name, dequantize(q, s, quant, torch.float32)


def _unquantized(tensors: Stream) -> Iterator[tuple[str, str, torch.Tensor]]:
    for origin, name, tensor in tensors:
        if tensor.dtype in FLOAT8 or name.endswith(SCALE_SUFFIXES):
            what = tensor.dtype if tensor.dtype in FLOAT8 else "an FP8 weight scale"
            raise ConfigError(f"{origin}: tensor {name!r} is {what} but config.json has no 'quantization_config'")
        yield origin, name, tensor


def _check_fp8(origin: str, module: str, w: torch.Tensor) -> None:
    if w.dtype != FP8:
        raise CheckpointError(f"{origin}: tensor '{module}.weight' has dtype {w.dtype}, expected "
                              f"float8_e4m3fn (quantization_config quantizes {module!r})")


def _pair(module: str, weight: tuple[str, torch.Tensor], scale: tuple[str, torch.Tensor],
          quant: QuantConfig, device: torch.device | str) -> torch.Tensor:
    (w_origin, w), (s_origin, s) = weight, scale
    if w.dim() != 2:
        raise CheckpointError(f"{w_origin}: tensor '{module}.weight' has shape {list(w.shape)}, expected 2 dims")
    expected = quant.scale_shape(*w.shape)
    if tuple(s.shape) not in _accepted(expected) or not s.is_floating_point() or s.dtype in FLOAT8:
        raise CheckpointError(f"{s_origin}: tensor '{module}.{quant.scale_suffix}' has shape {list(s.shape)} "
                              f"and dtype {s.dtype}, expected {list(expected)} floats for weight {list(w.shape)}")
    return dequantize(w.to(device), s.to(device), quant, torch.float32)


def _accepted(shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """A per-channel scale may also be stored flat ([out]), a per-tensor one as a scalar."""
    if shape == (1,):
        return (1,), ()
    if len(shape) == 2 and shape[1] == 1:
        return shape, shape[:1]
    return (shape,)
