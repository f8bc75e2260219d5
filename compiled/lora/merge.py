"""Folding an adapter into base weights (`W + scaling * B @ A`), for oracles: tests compare a
merged model with the served one where PEFT cannot run.

Understands the weight names of an HF transformers Qwen3 / Qwen3-MoE model in memory
(transformers 5: `mlp.experts.gate_up_proj` [E, 2I, H] with gate rows first, `mlp.experts.down_proj`
[E, H, I]), of an HF checkpoint (`mlp.experts.{e}.gate_proj.weight` [I, H], ...) and of this
package's model (`mlp.experts.gate_proj` [E, I, H], `up_proj`, `down_proj` [E, H, I])."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from compiled.lora.weights import Adapter, LoRAError


def _updates(adapter: Adapter, names) -> dict[str, list[tuple[slice | int | None, torch.Tensor]]]:
    """Weight name -> [(index into it or None for the whole tensor, delta to add there)]."""
    names = set(names)
    out: dict[str, list] = {}

    def need(name: str, what: str) -> str:
        if name not in names:
            raise LoRAError(f"adapter {adapter.name!r}: no weight {name!r} to merge {what} into")
        return name

    for (layer, proj), w in adapter.dense.items():
        where = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        name = need(f"model.layers.{layer}.{where}.{proj}.weight", f"{proj} LoRA")
        out.setdefault(name, []).append((None, w.delta()))
    for (layer, proj), w in adapter.experts.items():
        base = f"model.layers.{layer}.mlp.experts"
        delta = w.delta()                               # [E, out, in]
        inter = delta.shape[1] if proj != "down_proj" else delta.shape[2]
        if f"{base}.gate_up_proj" in names and proj != "down_proj":
            rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
            out.setdefault(f"{base}.gate_up_proj", []).append(((slice(None), rows), delta))
        elif f"{base}.{proj}" in names:
            out.setdefault(f"{base}.{proj}", []).append((None, delta))
        else:
            for e in range(delta.shape[0]):
                name = need(f"{base}.{e}.{proj}.weight", f"expert {proj} LoRA")
                out.setdefault(name, []).append((None, delta[e]))
    return out


def merged_state_dict(adapter: Adapter, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of `state_dict` (HF names, see the module docstring) with `adapter` folded in; the
    weights it changes are new tensors (added in float32, stored in their own dtype), the others
    are the same objects."""
    out = dict(state_dict)
    for name, parts in _updates(adapter, state_dict.keys()).items():
        w = state_dict[name].detach().to(torch.float32).clone()
        for index, delta in parts:
            if index is None:
                w += delta
            else:
                w[index] += delta
        if w.shape != state_dict[name].shape:
            raise LoRAError(f"adapter {adapter.name!r}: shape mismatch merging into {name!r}")
        out[name] = w.to(state_dict[name].dtype)
    return out


@torch.no_grad()
def merge_into(model: nn.Module, adapter: Adapter) -> nn.Module:
    """Fold `adapter` into `model`'s weights in place (an HF Qwen3 / Qwen3-MoE causal LM, or this
    package's model); returns `model`."""
    state = model.state_dict(keep_vars=True)
    plain = {k: v.detach() for k, v in state.items()}
    changed = _updates(adapter, plain.keys())
    merged = merged_state_dict(adapter, plain)
    for name in changed:
        state[name].data.copy_(merged[name])
    return model
