"""PEFT LoRA adapters loaded by compiled/lora: every supported layout normalises to one set of
weights whose merge reproduces PEFT's forward, the layouts of the same weights normalise to
identical tensors, and every bad input is a one-line LoRAError naming the culprit. CPU, seconds."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

peft = pytest.importorskip("peft")

from safetensors.torch import load_file, save_file  # noqa: E402

from compiled import demo  # noqa: E402
from compiled.graphs.config import ModelConfig  # noqa: E402
from compiled.lora import Adapter, LoRAError, load_adapter  # noqa: E402
from compiled.lora.merge import merge_into, merged_state_dict  # noqa: E402
from tests.conftest import MOE, hf_model, make_checkpoint  # noqa: E402

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
PREFIX = "base_model.model."


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Random HF checkpoints: dense Qwen3, Qwen3-MoE with every layer MoE, and one with layer 0
    dense and layer 1 MoE (like the demo model)."""
    root = tmp_path_factory.mktemp("bases")
    return {"dense": make_checkpoint(root / "dense"), "moe": make_checkpoint(root / "moe", moe=True),
            "mixed": make_checkpoint(root / "mixed", moe=True, decoder_sparse_step=2)}


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 120, (2, 11), generator=torch.Generator().manual_seed(seed))


def make_peft_adapter(base: str, out, seed: int = 1, **config) -> str:
    """A PEFT adapter made by PEFT itself (get_peft_model + save_pretrained) with random,
    non-zero A and B."""
    pm = peft.get_peft_model(hf_model(base), peft.LoraConfig(lora_dropout=0.0, **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    pm.save_pretrained(str(out))
    return str(out)


def write_adapter(out, tensors: dict, **config) -> str:
    """An adapter folder written by hand (for layouts PEFT 0.21 does not save on transformers 5)."""
    os.makedirs(out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(dict({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "bias": "none"}, **config), f)
    return str(out)


@torch.no_grad()
def peft_logits(base: str, adapter_dir: str, ids: torch.Tensor, fix=None) -> torch.Tensor:
    pm = peft.PeftModel.from_pretrained(hf_model(base), adapter_dir).eval()
    if fix:
        fix(pm)
    return pm(ids).logits


@torch.no_grad()
def merged_logits(base: str, adapter: Adapter, ids: torch.Tensor) -> torch.Tensor:
    return merge_into(hf_model(base), adapter)(ids).logits


def _close(ours, ref):
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert (ours - ref).abs().max() < 1e-5


def _cfg(base: str) -> ModelConfig:
    return ModelConfig.from_pretrained(base)


def per_expert_tensors(cfg: ModelConfig, r: int, seed: int) -> dict:
    """transformers-4 keys `...mlp.experts.{e}.{gate,up,down}_proj.lora_{A,B}.weight`, random."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    for layer in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(layer):
            continue
        for e in range(cfg.num_experts):
            for proj, (i, o) in {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}.items():
                key = f"{PREFIX}model.layers.{layer}.mlp.experts.{e}.{proj}"
                out[f"{key}.lora_A.weight"] = torch.randn(r, i, generator=g) * 0.1
                out[f"{key}.lora_B.weight"] = torch.randn(o, r, generator=g) * 0.1
    return out


def assert_same_weights(x: Adapter, y: Adapter) -> None:
    assert x.dense.keys() == y.dense.keys() and x.experts.keys() == y.experts.keys()
    for k in x.dense:
        assert torch.equal(x.dense[k].a, y.dense[k].a) and torch.equal(x.dense[k].b, y.dense[k].b), k
        assert x.dense[k].scaling == y.dense[k].scaling, k
    for k in x.experts:
        assert torch.equal(x.experts[k].a, y.experts[k].a) and torch.equal(x.experts[k].b, y.experts[k].b), k
        assert x.experts[k].scaling == y.experts[k].scaling, k
    assert x.rank == y.rank


# ---------------------------------------------------------------- merge == PEFT forward

CASES = {
    "dense attention-only r8": ("dense", dict(r=8, lora_alpha=16, target_modules=ATTN)),
    "dense all targets r16 rsLoRA": ("dense", dict(r=16, lora_alpha=8, use_rslora=True, target_modules=ATTN + MLP)),
    "dense r64 rank/alpha patterns": ("dense", dict(
        r=64, lora_alpha=32, target_modules=ATTN + MLP,
        rank_pattern={"q_proj": 8, r"layers\.1\.mlp\.down_proj": 4},
        alpha_pattern={"o_proj": 3, r"model\.layers\.0\.self_attn\.k_proj": 7})),
    "dense regex target_modules": ("dense", dict(r=8, lora_alpha=16, target_modules=r".*\.(q|v)_proj")),
    "dense layers_to_transform": ("dense", dict(r=8, lora_alpha=16, target_modules=["q_proj", "down_proj"],
                                                layers_to_transform=[1])),
    "moe all targets r8 (fused experts)": ("moe", dict(r=8, lora_alpha=16, target_modules=ATTN + MLP)),
    "moe all targets r16 rsLoRA + pattern": ("moe", dict(r=16, lora_alpha=8, use_rslora=True,
                                                          target_modules=ATTN + MLP, rank_pattern={"q_proj": 4})),
    "moe experts down_proj only": ("moe", dict(r=8, lora_alpha=16, target_modules=[],
                                               target_parameters=["mlp.experts.down_proj"])),
    "moe experts gate_up_proj only": ("moe", dict(r=8, lora_alpha=16, target_modules=["k_proj"],
                                                  target_parameters=["gate_up_proj"])),
    "mixed dense+moe rsLoRA (demo-like)": ("mixed", dict(
        r=8, lora_alpha=16, use_rslora=True, target_modules=ATTN + MLP,
        target_parameters=["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_merge_matches_peft_forward(case, bases, tmp_path):
    which, config = CASES[case]
    base = bases[which]
    path = make_peft_adapter(base, tmp_path / "a", **config)
    adapter = load_adapter("a", path, _cfg(base), max_lora_rank=64)
    ids = _ids()
    _close(merged_logits(base, adapter, ids), peft_logits(base, path, ids))
    assert adapter.rank == max(w.rank for w in [*adapter.dense.values(), *adapter.experts.values()])
    for w in adapter.dense.values():
        assert w.a.dtype == w.b.dtype == torch.float32 and w.b.abs().sum() > 0


def test_normalised_shapes_and_scales(bases, tmp_path):
    base = bases["moe"]
    cfg = _cfg(base)
    path = make_peft_adapter(base, tmp_path / "a", r=4, lora_alpha=8, use_rslora=True, target_modules=ATTN + MLP)
    a = load_adapter("a", path, cfg, max_lora_rank=8)
    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert set(a.experts) == {(layer, p) for layer in range(2) for p in MLP}
    # PEFT fused gate/up with r and alpha doubled: rank 8, scale 16 / sqrt(8); down r 4, 8 / sqrt(4)
    gate, up, down = a.experts[(0, "gate_proj")], a.experts[(0, "up_proj")], a.experts[(0, "down_proj")]
    assert gate.a.shape == up.a.shape == (e, 8, h) and gate.b.shape == up.b.shape == (e, inter, 8)
    assert down.a.shape == (e, 4, inter) and down.b.shape == (e, h, 4)
    assert gate.scaling == pytest.approx(16 / math.sqrt(8)) and down.scaling == pytest.approx(8 / math.sqrt(4))
    q = a.dense[(1, "q_proj")]
    assert q.a.shape == (4, h) and q.b.shape == (cfg.q_size, 4) and q.scaling == pytest.approx(4.0)
    # the raw file: gate_up is the inner ParamWrapper; expert e's B columns are e, e+E, ...
    raw = load_file(os.path.join(path, "adapter_model.safetensors"))
    A = raw[f"{PREFIX}model.layers.0.mlp.experts.base_layer.lora_A.weight"]
    B = raw[f"{PREFIX}model.layers.0.mlp.experts.base_layer.lora_B.weight"]
    assert A.shape == (e * 8, h) and B.shape == (2 * inter, e * 8)
    for x in range(e):
        assert torch.equal(gate.a[x], A[x * 8:(x + 1) * 8])
        assert torch.equal(gate.b[x], B[:inter, x::e]) and torch.equal(up.b[x], B[inter:, x::e])


def test_merge_understands_every_naming(bases, tmp_path):
    """merged_state_dict folds the same deltas into transformers 5's fused expert parameters, the
    checkpoint's per-expert weights and this package's stacked gate/up/down parameters."""
    base = bases["mixed"]
    cfg = _cfg(base)
    path = make_peft_adapter(base, tmp_path / "a", r=4, lora_alpha=8, target_modules=ATTN + MLP,
                             target_parameters=["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"])
    adapter = load_adapter("a", path, cfg, 8)
    fused = merged_state_dict(adapter, hf_model(base).state_dict())
    ckpt = load_file(os.path.join(base, "model.safetensors"))
    per = merged_state_dict(adapter, ckpt)
    inter, layer = cfg.moe_intermediate_size, 1
    stacked = {k: v for k, v in ckpt.items() if ".experts." not in k}
    for proj in MLP:
        stacked[f"model.layers.{layer}.mlp.experts.{proj}"] = torch.stack(
            [ckpt[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] for e in range(cfg.num_experts)])
    ours = merged_state_dict(adapter, stacked)
    for e in range(cfg.num_experts):
        gu = fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e]
        for proj, want in (("gate_proj", gu[:inter]), ("up_proj", gu[inter:]),
                           ("down_proj", fused[f"model.layers.{layer}.mlp.experts.down_proj"][e])):
            assert torch.equal(per[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"], want)
            assert torch.equal(ours[f"model.layers.{layer}.mlp.experts.{proj}"][e], want)
            assert not torch.equal(ckpt[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"], want)
    for k in ("model.layers.0.mlp.gate_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        assert torch.equal(per[k], fused[k]) and torch.equal(ours[k], fused[k]) and not torch.equal(per[k], ckpt[k])
    assert per["model.norm.weight"] is ckpt["model.norm.weight"]
    with pytest.raises(LoRAError) as err:
        merged_state_dict(adapter, {k: v for k, v in ckpt.items() if "q_proj" not in k})
    assert "q_proj.weight" in _one_line(err)


# ---------------------------------------------------------------- expert layouts agree


def test_per_expert_and_peft_fused_layouts_agree(bases, tmp_path):
    """A transformers-4 per-expert adapter, and the fused adapter PEFT 0.21 turns it into
    (block-diagonal B, r and alpha doubled), normalise to the same tensors, and both merges
    match PEFT's forward."""
    base = bases["moe"]
    cfg = _cfg(base)
    per = write_adapter(tmp_path / "per", per_expert_tensors(cfg, r=4, seed=3), r=4, lora_alpha=8,
                        target_modules=MLP)
    pm = peft.PeftModel.from_pretrained(hf_model(base), per)
    pm.save_pretrained(str(tmp_path / "fused"))
    fused = str(tmp_path / "fused")
    raw = load_file(os.path.join(fused, "adapter_model.safetensors"))
    assert f"{PREFIX}model.layers.0.mlp.experts.base_layer.lora_A.weight" in raw
    a_per, a_fused = load_adapter("p", per, cfg, 4), load_adapter("f", fused, cfg, 4)
    assert_same_weights(a_per, a_fused)
    assert a_per.rank == 4
    ids = _ids(1)
    _close(merged_logits(base, a_per, ids), peft_logits(base, per, ids))
    _close(merged_logits(base, a_fused, ids), peft_logits(base, fused, ids))


def test_fused_and_per_expert_layouts_agree(bases, tmp_path):
    """The other way: a fused adapter trained as such (gate and up share A, rank 2r) written out
    per expert normalises to the same tensors."""
    base = bases["moe"]
    cfg = _cfg(base)
    fused = make_peft_adapter(base, tmp_path / "fused", r=4, lora_alpha=8, target_modules=MLP)
    raw = load_file(os.path.join(fused, "adapter_model.safetensors"))
    e, inter = cfg.num_experts, cfg.moe_intermediate_size
    per = {}
    for layer in range(cfg.num_hidden_layers):
        p = f"{PREFIX}model.layers.{layer}.mlp.experts"
        gu_a = raw[f"{p}.base_layer.lora_A.weight"].view(e, 8, -1)
        gu_b = raw[f"{p}.base_layer.lora_B.weight"].view(2 * inter, 8, e)
        d_a = raw[f"{p}.lora_A.weight"].view(e, 4, -1)
        d_b = raw[f"{p}.lora_B.weight"].view(-1, 4, e)
        for x in range(e):
            per[f"{p}.{x}.gate_proj.lora_A.weight"] = per[f"{p}.{x}.up_proj.lora_A.weight"] = gu_a[x]
            per[f"{p}.{x}.gate_proj.lora_B.weight"] = gu_b[:inter, :, x]
            per[f"{p}.{x}.up_proj.lora_B.weight"] = gu_b[inter:, :, x]
            per[f"{p}.{x}.down_proj.lora_A.weight"] = d_a[x]
            per[f"{p}.{x}.down_proj.lora_B.weight"] = d_b[:, :, x]
    per_dir = write_adapter(tmp_path / "per", {k: v.clone() for k, v in per.items()}, r=4, lora_alpha=8,
                            target_modules=MLP, rank_pattern={"gate_proj": 8, "up_proj": 8},
                            alpha_pattern={"gate_proj": 16, "up_proj": 16})
    a_fused, a_per = load_adapter("f", fused, cfg, 8), load_adapter("p", per_dir, cfg, 8)
    assert_same_weights(a_fused, a_per)
    assert a_fused.rank == 8
    ids = _ids(2)
    _close(merged_logits(base, a_per, ids), peft_logits(base, fused, ids))


def test_shared_outer_layout(bases, tmp_path):
    """The shared-outer layout (gate/up lora_A and down lora_B shared by all experts, as
    Megatron-Bridge exports for SGLang) normalises to the same tensors as the per-expert file that
    repeats the shared factors, keeps them as broadcast views, and merges to PEFT's forward on that
    per-expert file."""
    base = bases["moe"]
    cfg = _cfg(base)
    g = torch.Generator().manual_seed(5)
    e, h, inter, r = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, 4
    shared, per = {}, {}
    for layer in range(cfg.num_hidden_layers):
        p = f"{PREFIX}model.layers.{layer}.mlp.experts"
        a_in = torch.randn(1, r, h, generator=g) * 0.1      # one A for gate and up of every expert
        b_out = torch.randn(1, h, r, generator=g) * 0.1     # one B for down of every expert
        shared[f"{p}.gate_proj.lora_A.weight"] = shared[f"{p}.up_proj.lora_A.weight"] = a_in
        shared[f"{p}.down_proj.lora_B.weight"] = b_out
        for x in range(e):
            inner = {f"{p}.{x}.gate_proj.lora_B.weight": torch.randn(inter, r, generator=g) * 0.1,
                     f"{p}.{x}.up_proj.lora_B.weight": torch.randn(inter, r, generator=g) * 0.1,
                     f"{p}.{x}.down_proj.lora_A.weight": torch.randn(r, inter, generator=g) * 0.1}
            shared.update(inner)
            per.update(inner)
            per[f"{p}.{x}.gate_proj.lora_A.weight"] = a_in[0]
            per[f"{p}.{x}.up_proj.lora_A.weight"] = a_in[0]
            per[f"{p}.{x}.down_proj.lora_B.weight"] = b_out[0]
    so = write_adapter(tmp_path / "so", {k: v.clone() for k, v in shared.items()}, r=r, lora_alpha=8,
                       target_modules=MLP)
    pe = write_adapter(tmp_path / "pe", {k: v.clone() for k, v in per.items()}, r=r, lora_alpha=8,
                       target_modules=MLP)
    a_so, a_pe = load_adapter("so", so, cfg, 8), load_adapter("pe", pe, cfg, 8)
    assert_same_weights(a_so, a_pe)
    w = a_so.experts[(1, "gate_proj")]
    assert w.shares_a and not w.shares_b and a_so.experts[(1, "down_proj")].shares_b
    assert not a_pe.experts[(1, "gate_proj")].shares_a
    ids = _ids(3)
    _close(merged_logits(base, a_so, ids), peft_logits(base, pe, ids))


def test_per_expert_rslora_keeps_its_own_scale(bases, tmp_path):
    """Under rsLoRA a per-expert adapter's gate/up scale is alpha / sqrt(r). PEFT 0.21 loads it on
    transformers 5 by fusing gate and up with r and alpha doubled, which makes that
    2 alpha / sqrt(2 r), sqrt(2) too large; we keep the adapter's own scale (checked against a merge
    written out here), and PEFT's forward agrees once its fused scale is set back."""
    base = bases["moe"]
    cfg = _cfg(base)
    r, alpha = 4, 8
    tensors = per_expert_tensors(cfg, r=r, seed=7)
    path = write_adapter(tmp_path / "a", tensors, r=r, lora_alpha=alpha, use_rslora=True, target_modules=MLP)
    adapter = load_adapter("a", path, cfg, 8)
    scale = alpha / math.sqrt(r)
    assert all(w.scaling == pytest.approx(scale) for w in adapter.experts.values())
    model = hf_model(base)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    inter = cfg.moe_intermediate_size
    for layer in range(cfg.num_hidden_layers):
        for x in range(cfg.num_experts):
            k = f"{PREFIX}model.layers.{layer}.mlp.experts.{x}"
            d = {p: scale * tensors[f"{k}.{p}.lora_B.weight"] @ tensors[f"{k}.{p}.lora_A.weight"] for p in MLP}
            sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"][x] += torch.cat([d["gate_proj"], d["up_proj"]])
            sd[f"model.layers.{layer}.mlp.experts.down_proj"][x] += d["down_proj"]
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].shape[1] == 2 * inter
    ours = merged_state_dict(adapter, model.state_dict())
    for k in sd:
        torch.testing.assert_close(ours[k], sd[k], atol=1e-6, rtol=1e-6)

    def fix(pm):
        for name, module in pm.named_modules():
            if getattr(module, "parameter_name", None) == "gate_up_proj":
                assert module.scaling["default"] == pytest.approx(2 * alpha / math.sqrt(2 * r))
                module.scaling["default"] = scale
    ids = _ids(4)
    _close(merged_logits(base, adapter, ids), peft_logits(base, path, ids, fix=fix))


def test_expert_count_is_checked_exactly(bases, tmp_path):
    """An adapter for 8 experts does not load on a base with 4 or 16 experts, even where its rows
    divide evenly by that count."""
    base = bases["moe"]
    path = make_peft_adapter(base, tmp_path / "a", r=4, lora_alpha=8, target_modules=MLP)
    for experts in (4, 16):
        cfg = ModelConfig.from_dict(dict(MOE, architectures=["Qwen3MoeForCausalLM"], num_experts=experts))
        with pytest.raises(LoRAError) as err:
            load_adapter("a", path, cfg, 64)
        msg = _one_line(err)
        assert "mlp.experts" in msg and f"{experts} experts x r=" in msg and "holds LoRA for 8 experts" in msg
    # A consistent with the base but B not: the B check alone catches it
    raw = load_file(os.path.join(path, "adapter_model.safetensors"))
    key = f"{PREFIX}model.layers.1.mlp.experts.lora_B.weight"
    raw[key] = torch.cat([raw[key], raw[key]], dim=1)
    bad = write_adapter(tmp_path / "b", raw, **_config(path))
    with pytest.raises(LoRAError) as err:
        load_adapter("b", bad, _cfg(base), 64)
    assert key in _one_line(err)


# ---------------------------------------------------------------- bad input


def _config(path: str) -> dict:
    with open(os.path.join(path, "adapter_config.json")) as f:
        return json.load(f)


def _one_line(err) -> str:
    msg = str(err.value)
    assert isinstance(err.value, LoRAError) and "\n" not in msg and msg.strip() == msg
    return msg


def _set(**fields):
    def edit(path, tensors, config):
        config.update(fields)
    return edit


def _tensors(fn):
    def edit(path, tensors, config):
        fn(tensors)
    return edit


def _file(name, data: bytes | None):
    def edit(path, tensors, config):
        file = os.path.join(path, name)
        if data is None:
            os.remove(file)
        else:
            with open(file, "wb") as f:
                f.write(data)
    return edit


def _truncate(path, tensors, config):
    file = os.path.join(path, "adapter_model.safetensors")
    data = open(file, "rb").read()
    open(file, "wb").write(data[: len(data) // 2])


Q = f"{PREFIX}model.layers.0.self_attn.q_proj"
BAD = {
    "no folder": (lambda p, t, c: shutil.rmtree(p), ["not found"]),
    "no adapter_config.json": (_file("adapter_config.json", None), ["adapter_config.json not found"]),
    "malformed config": (_file("adapter_config.json", b"{ r: 8"), ["adapter_config.json", "malformed JSON"]),
    "config not an object": (_file("adapter_config.json", b"[1, 2]"), ["expected a JSON object"]),
    "r a string": (_set(r="8"), ["field 'r'", "'8'"]),
    "r zero": (_set(r=0), ["field 'r'"]),
    "rank_pattern bad value": (_set(rank_pattern={"q_proj": -2}), ["rank_pattern", "q_proj"]),
    "alpha_pattern bad regex": (_set(alpha_pattern={"q_proj(": 4}), ["alpha_pattern", "q_proj("]),
    "other peft type": (_set(peft_type="LOHA"), ["peft_type", "LOHA"]),
    "DoRA": (_set(use_dora=True), ["use_dora", "DoRA"]),
    "bias all": (_set(bias="all"), ["field 'bias'", "'all'"]),
    "lora_bias": (_set(lora_bias=True), ["lora_bias"]),
    "modules_to_save": (_set(modules_to_save=["lm_head"]), ["modules_to_save", "lm_head"]),
    "trainable tokens": (_set(trainable_token_indices=[5, 6]), ["trainable_token_indices"]),
    "target embed_tokens": (_set(target_modules=["q_proj", "embed_tokens"]), ["target_modules", "model.embed_tokens"]),
    "target lm_head": (_set(target_modules=["q_proj", "lm_head"]), ["target_modules", "lm_head"]),
    "target a norm": (_set(target_modules=["q_proj", "input_layernorm"]), ["input_layernorm"]),
    "target_parameters embed": (_set(target_parameters=["embed_tokens.weight"]), ["target_parameters", "embed_tokens"]),
    "targets nothing": (_set(target_modules=["c_attn"]), ["targets nothing", "c_attn"]),
    "fan_in_fan_out with target_parameters": (_set(fan_in_fan_out=True, target_parameters=["mlp.down_proj.weight"]),
                                              ["fan_in_fan_out"]),
    "no safetensors": (_file("adapter_model.safetensors", None), ["adapter_model.safetensors not found"]),
    "truncated safetensors": (_truncate, ["adapter_model.safetensors", "cannot read"]),
    "garbage safetensors": (_file("adapter_model.safetensors", b"\x05\x00\x00\x00\x00\x00\x00\x00{"),
                            ["adapter_model.safetensors", "cannot read"]),
    "rank_pattern disagrees with tensors": (_set(rank_pattern={"q_proj": 4}),
                                            [f"{Q}.lora_A.weight", "expected [4, 64]", "rank_pattern['q_proj']"]),
    "lora_A without lora_B": (_tensors(lambda t: t.pop(f"{Q}.lora_B.weight")), [f"{Q}.lora_A.weight", "lora_B"]),
    "B of the wrong size": (_tensors(lambda t: t.update({f"{Q}.lora_B.weight": torch.zeros(32, 8)})),
                            [f"{Q}.lora_B.weight", "[32, 8]", "expected [64, 8]"]),
    "layer beyond the model": (_tensors(lambda t: t.update({
        f"{PREFIX}model.layers.5.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64),
        f"{PREFIX}model.layers.5.self_attn.q_proj.lora_B.weight": torch.zeros(64, 8)})), ["layer 5", "2 layers"]),
    "embedding LoRA tensor": (_tensors(lambda t: t.update({
        f"{PREFIX}model.embed_tokens.lora_embedding_A": torch.zeros(8, 123)})), ["lora_embedding_A", "embedding"]),
    "resized embeddings saved": (_tensors(lambda t: t.update({
        f"{PREFIX}model.embed_tokens.weight": torch.zeros(130, 64)})), ["embed_tokens.weight", "vocabulary"]),
    "added tokens": (_file("added_tokens.json", b'{"<x>": 5, "<new>": 123}'),
                     ["added_tokens.json", "<new>", "123"]),
    "DoRA magnitude tensor": (_tensors(lambda t: t.update({f"{Q}.lora_magnitude_vector": torch.zeros(64)})),
                              ["lora_magnitude_vector", "DoRA"]),
    "integer tensor": (_tensors(lambda t: t.update({f"{Q}.lora_A.weight": torch.zeros(8, 64, dtype=torch.int32)})),
                       ["lora_A.weight", "dtype"]),
    "untargeted tensor": (_set(target_modules=["k_proj", "v_proj", "o_proj"]), [f"{Q}.lora_A.weight", "not targeted"]),
}


@pytest.fixture(scope="module")
def good_dense(bases, tmp_path_factory):
    return make_peft_adapter(bases["dense"], tmp_path_factory.mktemp("good") / "a", r=8, lora_alpha=16,
                             target_modules=ATTN)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line(case, bases, good_dense, tmp_path):
    path = str(tmp_path / "bad")
    shutil.copytree(good_dense, path)
    tensors, config = load_file(os.path.join(path, "adapter_model.safetensors")), _config(path)
    edit, wants = BAD[case]
    edit(path, tensors, config)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "adapter_model.safetensors")) and case not in (
                "truncated safetensors", "garbage safetensors"):
            save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        if os.path.exists(os.path.join(path, "adapter_config.json")) and "config" not in case:
            with open(os.path.join(path, "adapter_config.json"), "w") as f:
                json.dump(config, f)
    with pytest.raises(LoRAError) as err:
        load_adapter("bad", path, _cfg(bases["dense"]), max_lora_rank=64)
    msg = _one_line(err)
    assert msg.startswith(f"adapter 'bad' ({path}): ")
    for want in wants:
        assert want in msg, (want, msg)


def test_rank_above_max_and_wrong_base(bases, good_dense):
    with pytest.raises(LoRAError) as err:
        load_adapter("big", good_dense, _cfg(bases["dense"]), max_lora_rank=4)
    msg = _one_line(err)
    assert "rank 8" in msg and "max_lora_rank 4" in msg and "lora_A.weight" in msg
    with pytest.raises(LoRAError) as err:
        load_adapter("big", good_dense, _cfg(bases["dense"]), max_lora_rank=0)
    assert "max_lora_rank" in _one_line(err)
    wider = ModelConfig.from_dict(dict(_raw_config(bases["dense"]), hidden_size=128))
    with pytest.raises(LoRAError) as err:
        load_adapter("big", good_dense, wider, max_lora_rank=64)
    msg = _one_line(err)
    assert "self_attn" in msg and "expected [8, 128]" in msg


def test_fan_in_fan_out_on_linear_modules_is_ignored_as_peft_does(bases, good_dense, tmp_path):
    """PEFT resets fan_in_fan_out to False for nn.Linear targets (the weights keep the usual
    layout), so such an adapter loads the same; with target_parameters both refuse it."""
    path = str(tmp_path / "f")
    shutil.copytree(good_dense, path)
    config = dict(_config(path), fan_in_fan_out=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    cfg = _cfg(bases["dense"])
    adapter = load_adapter("f", path, cfg, 8)
    assert_same_weights(adapter, load_adapter("g", good_dense, cfg, 8))
    ids = _ids(6)
    _close(merged_logits(bases["dense"], adapter, ids), peft_logits(bases["dense"], path, ids))


def _raw_config(base: str) -> dict:
    with open(os.path.join(base, "config.json")) as f:
        return json.load(f)


def _moe_cfg() -> ModelConfig:
    return ModelConfig.from_dict(dict(MOE, architectures=["Qwen3MoeForCausalLM"]))


def _shared_outer_of_wrong_shape(t: dict) -> None:
    t.clear()
    t.update({k: v for k, v in per_expert_tensors(_moe_cfg(), 4, 0).items() if "down_proj.lora_B" not in k})
    t[f"{PREFIX}model.layers.0.mlp.experts.down_proj.lora_B.weight"] = torch.zeros(2, 64, 4)


def _swap_levels(t: dict) -> dict:
    out = {}
    for k, v in list(t.items()):
        if ".mlp.experts.base_layer." in k:
            out[k.replace(".base_layer.", ".")] = v
            del t[k]
        elif ".mlp.experts.lora_" in k:
            out[k.replace(".experts.", ".experts.base_layer.")] = v
            del t[k]
    return out


MOE_BAD = {
    "expert index beyond the model": (
        lambda t: t.update({f"{PREFIX}model.layers.0.mlp.experts.8.down_proj.lora_A.weight": torch.zeros(4, 32),
                            f"{PREFIX}model.layers.0.mlp.experts.8.down_proj.lora_B.weight": torch.zeros(64, 4)}),
        None, ["experts.8.down_proj", "expert 8", "8 experts"]),
    "dense MLP tensor in an MoE layer": (
        lambda t: t.update({f"{PREFIX}model.layers.1.mlp.down_proj.lora_A.weight": torch.zeros(4, 96),
                            f"{PREFIX}model.layers.1.mlp.down_proj.lora_B.weight": torch.zeros(64, 4)}),
        None, ["layers.1.mlp.down_proj", "MoE layer"]),
    "router LoRA tensor": (
        lambda t: t.update({f"{PREFIX}model.layers.1.mlp.gate.lora_A.weight": torch.zeros(4, 64),
                            f"{PREFIX}model.layers.1.mlp.gate.lora_B.weight": torch.zeros(8, 4)}),
        None, ["layers.1.mlp.gate", "MoE router"]),
    "all-linear reaches the router": (None, dict(target_modules="all-linear"), ["MoE router", "mlp.gate"]),
    "a wrapper PEFT would not nest there": (None, dict(target_parameters=["down_proj"]), ["nesting depth"]),
    "gate_up LoRA where PEFT keeps down": (lambda t: t.update(_swap_levels(t)), None,
                                           ["laid out as gate_up_proj", "keeps down_proj"]),
    "shared-outer factor of the wrong shape": (_shared_outer_of_wrong_shape, dict(target_modules=ATTN + MLP),
                                               ["experts.down_proj.lora_B.weight", "[2, 64, 4]", "one shared"]),
    "per-expert and fused tensors for one projection": (
        lambda t: t.update({k: v for k, v in per_expert_tensors(_moe_cfg(), 4, 0).items() if "layers.1." in k}),
        None, ["layer 1", "also has fused-expert LoRA tensors"]),
}


@pytest.fixture(scope="module")
def good_moe(bases, tmp_path_factory):
    return make_peft_adapter(bases["moe"], tmp_path_factory.mktemp("good_moe") / "a", r=4, lora_alpha=8,
                             target_modules=ATTN + MLP)


@pytest.mark.parametrize("case", sorted(MOE_BAD))
def test_bad_moe_input_is_one_line(case, bases, good_moe, tmp_path):
    edit_tensors, fields, wants = MOE_BAD[case]
    tensors = load_file(os.path.join(good_moe, "adapter_model.safetensors"))
    config = _config(good_moe)
    if edit_tensors:
        edit_tensors(tensors)
    if fields:
        config.update(fields)
    path = write_adapter(tmp_path / "bad", tensors, **config)
    with pytest.raises(LoRAError) as err:
        load_adapter("bad", path, _cfg(bases["moe"]), max_lora_rank=64)
    msg = _one_line(err)
    for want in wants:
        assert want in msg, (want, msg)


# ---------------------------------------------------------------- the shipped demo adapters


@pytest.mark.parametrize("which", ["moe", "dense"])
def test_demo_adapters_load(which):
    model, adapters = (demo.MOE_MODEL, demo.MOE_ADAPTERS) if which == "moe" else (demo.DENSE_MODEL, demo.DENSE_ADAPTERS)
    cfg = _cfg(model)
    upper, first = (load_adapter(n, adapters[n], cfg, max_lora_rank=16) for n in ("upper", "first"))
    assert first.projections == set(ATTN) and not first.experts and first.rank == 8
    assert first.dense[(0, "q_proj")].a.shape == (8, 128) and first.dense[(0, "q_proj")].b.shape == (256, 8)
    assert upper.projections == set(MLP)
    assert all(w.scaling == 2.0 for w in [*upper.dense.values(), *upper.experts.values(), *first.dense.values()])
    if which == "moe":  # layers 0, 2 dense MLP; 1, 3 experts (gate/up fused in the file with r 16)
        assert set(upper.dense) == {(layer, p) for layer in (0, 2) for p in MLP}
        assert set(upper.experts) == {(layer, p) for layer in (1, 3) for p in MLP}
        assert upper.experts[(1, "gate_proj")].a.shape == (8, 16, 128)
        assert upper.experts[(1, "up_proj")].b.shape == (8, 32, 16)
        assert upper.experts[(3, "down_proj")].a.shape == (8, 8, 32)
        assert upper.experts[(3, "down_proj")].b.shape == (8, 128, 8)
        assert upper.rank == 16
    else:
        assert set(upper.dense) == {(layer, p) for layer in range(3) for p in MLP} and upper.rank == 8


@pytest.mark.parametrize("which,name", [("moe", "upper"), ("moe", "first"), ("dense", "upper"), ("dense", "first")])
def test_demo_merged_greedy_matches_peft_generate(which, name):
    from transformers import AutoTokenizer

    model, adapters = (demo.MOE_MODEL, demo.MOE_ADAPTERS) if which == "moe" else (demo.DENSE_MODEL, demo.DENSE_ADAPTERS)
    tok = AutoTokenizer.from_pretrained(model)
    ids = torch.tensor([tok.encode("copy Bird wax:", add_special_tokens=False)])
    adapter = load_adapter(name, adapters[name], _cfg(model), max_lora_rank=16)
    with torch.no_grad():
        pm = peft.PeftModel.from_pretrained(hf_model(model), adapters[name]).eval()
        want = pm.generate(ids, max_new_tokens=12, do_sample=False)
        got = merge_into(hf_model(model), adapter).generate(ids, max_new_tokens=12, do_sample=False)
    assert got.tolist() == want.tolist()
    text = tok.decode(got[0, ids.shape[1]:], skip_special_tokens=True)
    assert text == (" BIRD WAX" if name == "upper" else " Bird")


def test_a_packed_adapter_travels_to_another_process_unlocked():
    import pickle

    import torch
    from compiled.lora.host import pack
    from compiled.lora.weights import Adapter, LoRAWeight
    gen = torch.Generator().manual_seed(1)
    packed = pack(Adapter("x", "<x>", 4, {(0, "q_proj"): LoRAWeight(torch.randn(4, 24, generator=gen),
                                                                  torch.randn(40, 4, generator=gen), 2.0)}),
                  torch.bfloat16)
    packed.host.locked = True   # as on a GPU machine (the CPU cannot lock)
    copy = pickle.loads(pickle.dumps(packed))
    assert packed.host.locked and not copy.host.locked   # the other process locks its own copy, if it wants one
    assert torch.equal(copy.dense[(0, "q_proj")].b, packed.dense[(0, "q_proj")].b)
    packed.host.locked = False


def test_a_packed_adapter_keeps_shared_factors_shared():
    import torch
    from compiled.lora.host import pack
    from compiled.lora.weights import Adapter, ExpertLoRAWeight, LoRAWeight
    gen = torch.Generator().manual_seed(0)
    a_shared = torch.randn(1, 4, 24, generator=gen).expand(6, 4, 24)
    adapter = Adapter("x", "<x>", 4,
                      {(0, "q_proj"): LoRAWeight(torch.randn(4, 24, generator=gen), torch.randn(40, 4, generator=gen), 2.0)},
                      {(1, "up_proj"): ExpertLoRAWeight(a_shared, torch.randn(6, 16, 4, generator=gen), 0.5)})
    half = pack(adapter, torch.bfloat16)
    expert = half.experts[(1, "up_proj")]
    assert expert.shares_a and half.host.data.numel() == 3 * 512 + 1024   # the shared A as one 512-byte row
    assert all(f.untyped_storage().data_ptr() == half.host.data.data_ptr() for f in half.factors())
    assert expert.a.dtype == expert.b.dtype == half.dense[(0, "q_proj")].b.dtype == torch.bfloat16
    assert torch.equal(expert.a.float(), a_shared.to(torch.bfloat16).float()) and expert.scaling == 0.5
    assert torch.equal(half.dense[(0, "q_proj")].a, adapter.dense[(0, "q_proj")].a.to(torch.bfloat16))
