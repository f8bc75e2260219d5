"""PEFT tensor layouts -> `LoRAWeight` / `ExpertLoRAWeight`.

Keys are `base_model.model.<module>.lora_A.weight` / `.lora_B.weight` (the prefix is optional).
Dense modules: A [r, in], B [out, r]. MoE experts come in three layouts:

- per expert (transformers 4 modules, also PEFT `target_parameters` on them):
  `mlp.experts.{e}.{gate,up,down}_proj.lora_A.weight` [r, in] and `.lora_B.weight` [out, r];
- fused (PEFT `target_parameters` on transformers 5's `Qwen3MoeExperts`, whose parameters are
  `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]): one nested `ParamWrapper` per targeted
  parameter on the `mlp.experts` module, the first targeted parameter (in the module's order
  gate_up_proj, down_proj) innermost, so with both targeted `mlp.experts.base_layer.lora_*` is
  gate_up and `mlp.experts.lora_*` is down. A is [E*r, in] with expert e's rows `A.view(E, r, in)[e]`,
  B is [out, E*r] with expert e's columns `B.view(out, r, E)[:, :, e]`; gate_up's out rows are
  [gate (I); up (I)] as in `gate_up_proj`;
- shared outer (the layout SGLang serves with `experts_shared_outer_loras`, exported by
  Megatron-Bridge): the hidden-facing factor shared by all experts under the expert-agnostic names
  `mlp.experts.{gate,up}_proj.lora_A.weight` [1, r, H] and `mlp.experts.down_proj.lora_B.weight`
  [1, H, r], the other factor per expert (`mlp.experts.{e}.…` 2-D). A 3-D factor with E rows in
  the first dimension is read as per expert."""

from __future__ import annotations

import re
from typing import Callable

import torch

from compiled.graphs.config import ModelConfig
from compiled.lora.peft_config import PeftLoraConfig, Target, module_names
from compiled.lora.weights import ExpertLoRAWeight, LoRAWeight

PREFIX = "base_model.model."
_ATTN = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkvo]_proj)")
_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)")
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)")
_SHARED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts((?:\.base_layer)*)")
_NOT_LORA = (("lora_embedding_", "an embedding LoRA"), ("lora_magnitude_vector", "a DoRA magnitude"),
             ("lora_B.bias", "a LoRA bias"), ("trainable_tokens", "trained token embeddings"),
             ("modules_to_save", "a replaced module"), ("original_module", "a replaced module"),
             ("embed_tokens", "embedding weights (an added or resized vocabulary)"),
             ("lm_head", "output head weights (an added or resized vocabulary)"))

Fail = Callable[[str], Exception]
Tensors = dict[str, torch.Tensor]  # file key -> tensor


class Groups:
    """The file's tensors sorted by layout: each leaf is {"A": key, "B": key}."""

    def __init__(self) -> None:
        self.dense: dict[tuple[int, str], dict[str, str]] = {}
        self.expert: dict[tuple[int, str], dict[int, dict[str, str]]] = {}
        self.shared: dict[tuple[int, str], dict[str, str]] = {}
        self.fused: dict[int, dict[int, dict[str, str]]] = {}


def group(tensors: Tensors, cfg: ModelConfig, fail: Fail) -> Groups:
    g = Groups()
    kinds = None
    for key in tensors:
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        m = re.fullmatch(r"(.+)\.lora_([AB])\.weight", name)
        if m is None:
            what = next((w for marker, w in _NOT_LORA if marker in name), None)
            raise fail(f"tensor {key!r} is {what}, which LoRA serving does not support" if what
                       else f"unexpected tensor {key!r} (not a lora_A / lora_B weight)")
        module, side = m.groups()
        if mm := _ATTN.fullmatch(module) or _MLP.fullmatch(module):
            layer, proj = int(mm[1]), mm[2]
            _layer_ok(key, layer, cfg, fail)
            if proj in ("gate_proj", "up_proj", "down_proj") and cfg.is_moe_layer(layer):
                raise fail(f"tensor {key!r}: layer {layer} of the base model is an MoE layer, it has no mlp.{proj}")
            leaf = g.dense.setdefault((layer, proj), {})
        elif mm := _EXPERT.fullmatch(module):
            layer, e, proj = int(mm[1]), int(mm[2]), mm[3]
            _moe_layer_ok(key, layer, cfg, fail)
            if e >= cfg.num_experts:
                raise fail(f"tensor {key!r}: expert {e} but the base model has {cfg.num_experts} experts")
            leaf = g.expert.setdefault((layer, proj), {}).setdefault(e, {})
        elif mm := _SHARED.fullmatch(module):
            layer, proj = int(mm[1]), mm[2]
            _moe_layer_ok(key, layer, cfg, fail)
            leaf = g.shared.setdefault((layer, proj), {})
        elif mm := _FUSED.fullmatch(module):
            layer = int(mm[1])
            _moe_layer_ok(key, layer, cfg, fail)
            leaf = g.fused.setdefault(layer, {}).setdefault(mm[2].count(".base_layer"), {})
        else:
            kinds = kinds or module_names(cfg)
            kind = kinds.get(module)
            raise fail(f"tensor {key!r} adapts {module} ({kind}), which LoRA serving does not support" if kind
                       else f"tensor {key!r} adapts {module}, which is not a module of the base model")
        leaf[side] = key
    return g


def _layer_ok(key: str, layer: int, cfg: ModelConfig, fail: Fail) -> None:
    if layer >= cfg.num_hidden_layers:
        raise fail(f"tensor {key!r}: layer {layer} but the base model has {cfg.num_hidden_layers} layers")


def _moe_layer_ok(key: str, layer: int, cfg: ModelConfig, fail: Fail) -> None:
    _layer_ok(key, layer, cfg, fail)
    if not cfg.is_moe_layer(layer):
        raise fail(f"tensor {key!r}: layer {layer} of the base model is not an MoE layer, it has no experts")


def _pair(leaf: dict[str, str], fail: Fail) -> tuple[str, str]:
    for side, other in (("A", "B"), ("B", "A")):
        if other not in leaf:
            raise fail(f"tensor {leaf[side]!r} has no matching lora_{other} tensor")
    return leaf["A"], leaf["B"]


def _shape(t: torch.Tensor, key: str, want: tuple[int, ...], why: str, fail: Fail) -> None:
    if tuple(t.shape) != want:
        raise fail(f"tensor {key!r} has shape {list(t.shape)}, expected {list(want)} ({why})")


def _target(cfg: PeftLoraConfig, module: str, key: str, fail: Fail) -> Target:
    target = cfg.target(module)
    if target is None:
        raise fail(f"tensor {key!r}: {module} is not targeted by the config's target_modules / target_parameters")
    return target


# ---------------------------------------------------------------------- dense


def dense(g: Groups, tensors: Tensors, cfg: PeftLoraConfig, model: ModelConfig, fail: Fail):
    """(layer, proj) -> (LoRAWeight, key, target) for every dense module in the file."""
    out = {}
    for (layer, proj), leaf in sorted(g.dense.items()):
        ka, kb = _pair(leaf, fail)
        where = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        target = _target(cfg, f"model.layers.{layer}.{where}.{proj}", ka, fail)
        i, o = model.projection_shape(proj)
        why = f"r={target.r} from {target.r_source}, base model {proj} {i} -> {o}"
        _shape(tensors[ka], ka, (target.r, i), why, fail)
        _shape(tensors[kb], kb, (o, target.r), why, fail)
        out[(layer, proj)] = (LoRAWeight(tensors[ka], tensors[kb], target.scaling), ka, target)
    return out


# ---------------------------------------------------------------------- experts


def experts(g: Groups, tensors: Tensors, cfg: PeftLoraConfig, model: ModelConfig, fail: Fail):
    """(layer, proj) -> (ExpertLoRAWeight, key, target) for every expert projection in the file."""
    out = {}
    for layer, levels in sorted(g.fused.items()):
        for proj, item in _fused(layer, levels, tensors, cfg, model, fail).items():
            other = g.expert.get((layer, proj)) or g.shared.get((layer, proj))
            if other:
                raise fail(f"tensor {_any_key(other)!r}: layer {layer} {proj} also has fused-expert LoRA tensors")
            out[(layer, proj)] = item
    for layer, proj in sorted(set(g.expert) | set(g.shared)):
        out[(layer, proj)] = _modules(layer, proj, g.expert.get((layer, proj), {}),
                                      g.shared.get((layer, proj), {}), tensors, cfg, model, fail)
    return out


def _any_key(leaf) -> str:
    while not isinstance(leaf, str):
        leaf = next(iter(leaf.values()))
    return leaf


def _modules(layer, proj, per: dict[int, dict[str, str]], shared: dict[str, str], tensors, cfg, model, fail):
    """Per-expert and shared-outer layouts: each factor per expert (2-D keys) or shared (one key)."""
    num = model.num_experts
    i, o = model.projection_shape(proj, expert=True)
    base = f"model.layers.{layer}.mlp.experts"
    targets = []
    for e in range(num):
        target = cfg.target(f"{base}.{e}.{proj}")
        if target is None and (e in per or shared):
            key = _any_key(per[e] if e in per else shared)
            raise fail(f"tensor {key!r}: {base}.{e}.{proj} is not targeted by the config's target_modules / "
                       "target_parameters")
        targets.append(target)
    ref = next(t for t in targets if t is not None)
    targets = [t or ref for t in targets]
    factors: dict[str, list] = {}
    for side in ("A", "B"):
        keyed = sorted(e for e in per if side in per[e])
        factors[side] = [None] * num
        if side in shared and keyed:
            raise fail(f"tensor {shared[side]!r}: layer {layer} {proj} lora_{side} is given both shared and per expert")
        if side in shared:
            key, t, r = shared[side], tensors[shared[side]], ref.r
            first = 1 if t.dim() == 3 and t.shape[0] == 1 else num
            want = (first,) + ((r, i) if side == "A" else (o, r))
            _shape(t, key, want, f"one factor per expert ({num}) or one shared, r={r} from {ref.r_source}, "
                   f"base model expert {proj} {i} -> {o}", fail)
            if any(tg.r != r for tg in targets):
                raise fail(f"tensor {key!r} is shared by experts whose ranks differ in the config")
            factors[side] = [t[0]] * num if first == 1 else list(t.unbind(0))
        for e in keyed:
            key, tg = per[e][side], targets[e]
            want = (tg.r, i) if side == "A" else (o, tg.r)
            _shape(tensors[key], key, want, f"r={tg.r} from {tg.r_source}, base model expert {proj} {i} -> {o}", fail)
            factors[side][e] = tensors[key]
    for e in range(num):
        a, b = factors["A"][e], factors["B"][e]
        if (a is None) != (b is None):
            have, missing = ("A", "B") if b is None else ("B", "A")
            key = per[e][have] if e in per and have in per[e] else shared[have]
            raise fail(f"tensor {key!r} has no matching lora_{missing} tensor for expert {e}")
        if a is None:  # an expert the file leaves out: no change
            factors["A"][e], factors["B"][e] = torch.zeros(targets[e].r, i), torch.zeros(o, targets[e].r)
    return _stack(factors["A"], factors["B"], [t.scaling for t in targets]), _any_key(shared or per), ref


def _stack(a: list[torch.Tensor], b: list[torch.Tensor], scalings: list[float]) -> ExpertLoRAWeight:
    """One ExpertLoRAWeight from per-expert factors. A factor that is the same tensor for every
    expert stays one tensor (a broadcast view). Experts of different rank are zero-padded and
    experts of different scaling get it folded into their B (scaling 1)."""
    rank = max(t.shape[0] for t in a)
    if any(t.shape[0] != rank for t in a):
        a = [torch.nn.functional.pad(t, (0, 0, 0, rank - t.shape[0])) for t in a]
        b = [torch.nn.functional.pad(t, (0, rank - t.shape[1])) for t in b]
    scaling = scalings[0]
    if any(s != scaling for s in scalings):
        b = [t * s for t, s in zip(b, scalings)]
        scaling = 1.0

    def stack(ts: list[torch.Tensor]) -> torch.Tensor:
        if all(t is ts[0] for t in ts):
            return ts[0].unsqueeze(0).expand(len(ts), *ts[0].shape)
        return torch.stack(ts)
    return ExpertLoRAWeight(stack(a), stack(b), scaling)


def _fused(layer: int, levels: dict[int, dict[str, str]], tensors, cfg, model, fail):
    """PEFT ParamWrapper LoRA on transformers 5's fused expert parameters."""
    num, h, inter = model.num_experts, model.hidden_size, model.moe_intermediate_size
    base = f"model.layers.{layer}.mlp.experts"
    targeted = [p for p in ("gate_up_proj", "down_proj") if cfg.matches_parameter(f"{base}.{p}")]
    shapes = {"gate_up_proj": (h, 2 * inter), "down_proj": (inter, h)}
    out = {}
    for depth, leaf in sorted(levels.items()):
        ka, kb = _pair(leaf, fail)
        a, b = tensors[ka], tensors[kb]
        if depth >= len(targeted):
            raise fail(f"tensor {ka!r}: the config's target_parameters reach {targeted or 'no parameter'} of "
                       f"layer {layer}'s experts, so PEFT has no LoRA at this nesting depth")
        param = targeted[len(targeted) - 1 - depth]  # the last one wrapped is the outermost
        i, o = shapes[param]
        held = [p for p, (pi, po) in shapes.items()
                if a.dim() == 2 and b.dim() == 2 and a.shape[1] == pi and b.shape[0] == po]
        if held and held[0] != param:
            raise fail(f"tensor {ka!r} is laid out as {held[0]} LoRA, but with target_parameters {targeted} "
                       f"PEFT keeps {param} LoRA at this nesting depth")
        target = cfg.resolve(f"{base}.{param}", "target_parameters")
        r = target.r
        why = f"{num} experts x r={r} from {target.r_source}, base model {param} {i} -> {o}"
        for key, t, want, rows in ((ka, a, (num * r, i), 0), (kb, b, (o, num * r), 1)):
            if tuple(t.shape) != want and t.dim() == 2 and t.shape[rows] % r == 0 and t.shape[rows] != num * r:
                why += f"; it holds LoRA for {t.shape[rows] // r} experts"
            _shape(t, key, want, why, fail)
        a3 = a.reshape(num, r, i)                          # [E, r, in]
        b3 = b.reshape(o, r, num).permute(2, 0, 1)         # [E, out, r]
        if param == "down_proj":
            out["down_proj"] = (ExpertLoRAWeight(a3.contiguous(), b3.contiguous(), target.scaling), ka, target)
            continue
        gate, up = b3[:, :inter], b3[:, inter:]
        half = r // 2
        if r % 2 == 0 and not gate[..., half:].any() and not up[..., :half].any():
            # block-diagonal B, as PEFT builds when it fuses separate gate / up LoRA (each r/2):
            # each projection only uses its own half of the rank
            parts = {"gate_proj": (a3[:, :half], gate[..., :half]), "up_proj": (a3[:, half:], up[..., half:])}
        else:
            shared_a = a3.contiguous()
            parts = {"gate_proj": (shared_a, gate), "up_proj": (shared_a, up)}
        for proj, (pa, pb) in parts.items():
            out[proj] = (ExpertLoRAWeight(pa.contiguous(), pb.contiguous(), target.scaling), ka, target)
    return out
