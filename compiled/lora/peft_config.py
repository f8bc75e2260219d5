"""A PEFT `adapter_config.json` read and checked: which modules and parameters it targets, the rank
and alpha of each one, and the settings serving refuses.

Module and parameter names are the ones PEFT matches against: the HF model's own names, relative to
the causal-LM (`model.layers.3.self_attn.q_proj`, `model.layers.1.mlp.experts.gate_up_proj`,
`model.layers.0.mlp.gate_proj.weight`). The matching rules follow PEFT's `check_target_module_exists`
(names, suffixes after a dot, a regex for the whole name, `layers_to_transform`, `exclude_modules`),
its parameter targeting (`target_parameters`: the name or a suffix after a dot) and
`get_pattern_key` for `rank_pattern` / `alpha_pattern` (the first key `k` with
`re.match(f"(.*\\.)?({k})$", name)`)."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Callable

from compiled.graphs.config import ModelConfig
from compiled.json_file import read_json_object

ALL_LINEAR = "all-linear"

# LoraConfig fields that turn on a LoRA variant whose forward is not `W x + s * B A x`.
_VARIANTS = {
    "use_dora": "DoRA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "kasa_config": "KaSA",
    "arrow_config": "Arrow routing",
    "use_bdlora": "block-diagonal LoRA",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QALoRA",
    "layer_replication": "layer replication",
}


@dataclass(frozen=True)
class Target:
    """How one module is adapted: through `target_modules` (key = the module name) or through
    `target_parameters` (key = the parameter name), with the rank and alpha its key resolves to."""
    key: str
    via: str            # "target_modules" | "target_parameters"
    r: int
    alpha: float
    r_source: str       # "r" or "rank_pattern['...']", for error messages
    use_rslora: bool

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r


@dataclass(frozen=True)
class PeftLoraConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: frozenset[str] | str | None
    target_parameters: tuple[str, ...]
    exclude_modules: frozenset[str] | str | None
    layers_to_transform: tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    fan_in_fan_out: bool

    # ------------------------------------------------------------------ matching, as PEFT does

    def matches_module(self, key: str) -> bool:
        if self.exclude_modules:
            if isinstance(self.exclude_modules, str):
                if re.fullmatch(self.exclude_modules, key):
                    return False
            elif _named(key, self.exclude_modules):
                return False
        if self.target_modules is None:
            return False
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, key) is not None
        if key in self.target_modules:
            return True
        if not _named(key, self.target_modules):
            return False
        if not self.layers_to_transform:
            return True
        if not self.layers_pattern:
            m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            m = None
            for pattern in self.layers_pattern:
                if m := re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key):
                    break
        return m is not None and int(m.group("idx")) in self.layers_to_transform

    def matches_parameter(self, key: str) -> bool:
        return key in self.target_parameters or _named(key, self.target_parameters)

    def resolve(self, key: str, via: str) -> Target:
        r_key = _pattern_key(self.rank_pattern, key)
        a_key = _pattern_key(self.alpha_pattern, key)
        r = self.rank_pattern[r_key] if r_key is not None else self.r
        alpha = self.alpha_pattern[a_key] if a_key is not None else self.lora_alpha
        source = f"rank_pattern[{r_key!r}]" if r_key is not None else "r"
        return Target(key, via, r, alpha, source, self.use_rslora)

    def target(self, module: str) -> Target | None:
        """The module `module` (a Linear) is adapted, and how; None if the config leaves it alone.
        PEFT injects `target_modules` first, then `target_parameters` (`<module>.weight`)."""
        if self.matches_module(module):
            return self.resolve(module, "target_modules")
        if self.matches_parameter(module + ".weight"):
            return self.resolve(module + ".weight", "target_parameters")
        return None


def _named(key: str, names) -> bool:
    return any(key == n or key.endswith("." + n) for n in names)


def _pattern_key(patterns: dict, key: str) -> str | None:
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return None


# ---------------------------------------------------------------------- the base model's names


def module_names(cfg: ModelConfig) -> dict[str, str]:
    """Every module name PEFT could match on the base model -> its kind: "linear" for the
    projections serving adapts, else what it is. Both the transformers-5 names (experts as one
    module holding fused parameters) and the transformers-4 per-expert Linear names are listed,
    since adapters trained on either are loaded."""
    names = {"model": "model", "model.embed_tokens": "embed_tokens", "lm_head": "lm_head",
             "model.norm": "norm", "model.rotary_emb": "rotary embedding", "model.layers": "layer list"}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}"
        names.update({p: "decoder layer", f"{p}.self_attn": "attention block", f"{p}.mlp": "MLP block",
                      f"{p}.input_layernorm": "norm", f"{p}.post_attention_layernorm": "norm",
                      f"{p}.self_attn.q_norm": "norm", f"{p}.self_attn.k_norm": "norm"})
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[f"{p}.self_attn.{proj}"] = "linear"
        if cfg.is_moe_layer(layer):
            names.update({f"{p}.mlp.gate": "MoE router", f"{p}.mlp.experts": "MoE experts block"})
            for e in range(cfg.num_experts):
                names[f"{p}.mlp.experts.{e}"] = "MoE expert"
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    names[f"{p}.mlp.experts.{e}.{proj}"] = "linear"
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names[f"{p}.mlp.{proj}"] = "linear"
    return names


def parameter_names(cfg: ModelConfig) -> dict[str, str]:
    """Every parameter name `target_parameters` could match -> "linear" / "experts" for the ones
    serving adapts, else what it belongs to."""
    names = {}
    for module, kind in module_names(cfg).items():
        if kind == "linear" or kind in ("embed_tokens", "lm_head", "norm", "MoE router"):
            names[module + ".weight"] = kind
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(layer):
            names[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = "experts"
            names[f"model.layers.{layer}.mlp.experts.down_proj"] = "experts"
    return names


# ---------------------------------------------------------------------- reading and checking


def read_config(file: str, model: ModelConfig, fail: Callable[[str], Exception]) -> PeftLoraConfig:
    """Parse and check `file`; `fail(msg)` builds the error to raise (it names the adapter)."""
    if not os.path.isfile(file):
        raise fail(f"{file} not found")
    f = _Fields(read_json_object(file, fail), file, fail)
    _refuse_variants(f)
    r = f.number("r", 8, int)
    alpha = float(f.number("lora_alpha", 8, positive=False))
    use_rslora, fan_in_fan_out = f.flag("use_rslora"), f.flag("fan_in_fan_out")
    target_modules = f.names("target_modules", True)
    target_parameters = f.names("target_parameters", False) or frozenset()
    exclude_modules = f.names("exclude_modules", True)
    if isinstance(target_modules, str) and target_modules.lower() == ALL_LINEAR:
        target_modules = _all_linear(model)
    if fan_in_fan_out and target_parameters:
        raise f.bad("fan_in_fan_out", "is set together with target_parameters (PEFT refuses it too)")
    layers, pattern = _layer_selection(f)
    cfg = PeftLoraConfig(
        r=r, lora_alpha=alpha, use_rslora=use_rslora, target_modules=target_modules,
        target_parameters=tuple(sorted(target_parameters)), exclude_modules=exclude_modules,
        layers_to_transform=tuple(layers) if layers else None,
        layers_pattern=tuple(pattern) if pattern else None,
        rank_pattern=f.patterns("rank_pattern", int), alpha_pattern=f.patterns("alpha_pattern", (int, float)),
        fan_in_fan_out=fan_in_fan_out,
    )
    _check_targets(cfg, model, f.bad)
    return cfg


class _Fields:
    """Typed reads of an adapter_config.json, each error naming the file and the field."""

    def __init__(self, raw: dict, file: str, fail: Callable[[str], Exception]) -> None:
        self.raw, self.file, self.fail = raw, file, fail

    def bad(self, field: str, why: str) -> Exception:
        return self.fail(f"{self.file}: field {field!r} {why}")

    def number(self, field: str, default, kind=(int, float), positive=True):
        value = self.raw.get(field)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or (
                positive and value <= 0):
            raise self.bad(field, f"must be a {'positive ' if positive else ''}"
                           f"{'integer' if kind is int else 'number'}, got {value!r}")
        return value

    def flag(self, field: str) -> bool:
        value = self.raw.get(field, False) or False
        if not isinstance(value, bool):
            raise self.bad(field, f"must be true or false, got {value!r}")
        return value

    def names(self, field: str, allow_str: bool) -> frozenset[str] | str | None:
        """A list of module names, or (where `allow_str`) one regex."""
        value = self.raw.get(field)
        if value is None:
            return None
        if allow_str and isinstance(value, str):
            self.regex(field, value, "is")
            return value
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.bad(field, f"must be a list of names{' or a regex' if allow_str else ''}, got {value!r}")
        return frozenset(value)

    def regex(self, field: str, value: str, what: str) -> None:
        try:
            re.compile(value)
        except re.error as e:
            raise self.bad(field, f"{what} not a valid regular expression ({e})") from None

    def patterns(self, field: str, kind) -> dict:
        """`rank_pattern` / `alpha_pattern`: regex -> a positive int (ranks) or a number (alphas)."""
        value = self.raw.get(field) or {}
        if not isinstance(value, dict):
            raise self.bad(field, f"must be an object of regex -> value, got {value!r}")
        out = {}
        for key, v in value.items():
            self.regex(field, key, f"key {key!r} is")
            if isinstance(v, bool) or not isinstance(v, kind) or (kind is int and v <= 0):
                raise self.bad(field, f"value for {key!r} must be a {'positive integer' if kind is int else 'number'}, "
                               f"got {v!r}")
            out[key] = v if kind is int else float(v)
        return out


def _refuse_variants(f: _Fields) -> None:
    """LoRA variants and extras this engine does not serve are errors, not adapters run without them."""
    raw, bad = f.raw, f.bad
    peft_type = raw.get("peft_type")
    if not isinstance(peft_type, str):
        raise bad("peft_type", f"must name the adapter type, got {peft_type!r}")
    if peft_type.upper() != "LORA":
        raise bad("peft_type", f"is {peft_type!r}: only LORA adapters are supported")
    for field, what in _VARIANTS.items():
        if raw.get(field):
            raise bad(field, f"is set: {what} adapters are not supported")
    if isinstance(raw.get("init_lora_weights"), str) and raw["init_lora_weights"].lower() == "mica":
        raise bad("init_lora_weights", "is 'mica': MiCA adapters are not supported")
    if raw.get("bias", "none") != "none":
        raise bad("bias", f"is {raw['bias']!r}: only 'none' is supported (no bias terms are trained)")
    if raw.get("lora_bias"):
        raise bad("lora_bias", "is set: LoRA B bias terms are not supported")
    if raw.get("modules_to_save"):
        raise bad("modules_to_save", f"is {raw['modules_to_save']!r}: adapters that replace whole modules "
                  "are not supported")
    if raw.get("trainable_token_indices"):
        raise bad("trainable_token_indices", "is set: adapters that train token embeddings are not supported")


def _layer_selection(f: _Fields) -> tuple[list[int] | None, list[str] | None]:
    """(`layers_to_transform`, `layers_pattern`), each a single value or a list in the file."""
    layers = f.raw.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and (not isinstance(layers, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in layers)):
        raise f.bad("layers_to_transform", f"must be a layer index or a list of them, got {layers!r}")
    pattern = f.raw.get("layers_pattern")
    if isinstance(pattern, str):
        pattern = [pattern]
    if pattern is not None and (not isinstance(pattern, list) or not all(isinstance(p, str) for p in pattern)):
        raise f.bad("layers_pattern", f"must be a name or a list of names, got {pattern!r}")
    return layers, pattern


def _all_linear(model: ModelConfig) -> frozenset[str]:
    """PEFT's "all-linear": every Linear but the output head. On Qwen3-MoE that includes the
    router (a Linear in transformers 4; PEFT 0.21 adds it by name on transformers 5)."""
    out = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    if model.is_moe:
        out.add("gate")
    return frozenset(out)


def _check_targets(cfg: PeftLoraConfig, model: ModelConfig, bad) -> None:
    """Refuse targets serving cannot adapt (embeddings, the output head, norms, the router, whole
    blocks) and a config that targets nothing of the base model."""
    hits = 0
    for name, kind in module_names(model).items():
        if cfg.matches_module(name):
            if kind != "linear":
                raise bad("target_modules", f"reaches {name} ({kind}): only the q/k/v/o and gate/up/down "
                          "projections can be adapted")
            hits += 1
    for name, kind in parameter_names(model).items():
        if cfg.matches_parameter(name):
            if kind not in ("linear", "experts"):
                raise bad("target_parameters", f"reaches {name} ({kind}): only the q/k/v/o and gate/up/down "
                          "projections can be adapted")
            hits += 1
    if not hits:
        field = "target_modules" if cfg.target_modules or not cfg.target_parameters else "target_parameters"
        which = cfg.target_modules if field == "target_modules" else cfg.target_parameters
        which = which if isinstance(which, str) else sorted(which or ())
        raise bad(field, f"targets nothing in the base model ({which!r})")
