"""Each graph pass, alone and all together: same outputs as the unpassed graph, and the
structure the pass promises. Weights reach the passed graph through its weight map."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from compiled.attention.kv_cache import KVPool, ReqToTokenPool
from compiled.graphs.config import ModelConfig
from compiled.linear.ops import SkinnyLinear
from compiled.graphs.trace import materialize, meta_model, trace
from compiled.passes.base import is_getitem, is_op
from compiled.passes.calls import call_args
from compiled.passes.manager import DEFAULT_PASSES, run_passes
from compiled.runtime.config import EngineConfig
from compiled.runtime.loader import assign_tensors
from compiled.passes.variant import BASE as BASE_GRAPH
from compiled.runtime.model_runner import ModelRunner
from compiled.runtime.request import Request
from compiled.runtime.sampling_params import SamplingParams
from compiled.runtime.scheduler import Scheduler

BASE = dict(architectures=["Qwen3ForCausalLM"], vocab_size=97, hidden_size=48, intermediate_size=80,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=128)
MOE = dict(BASE, architectures=["Qwen3MoeForCausalLM"], num_experts=6, num_experts_per_tok=2,
           moe_intermediate_size=24, norm_topk_prob=True)
CONFIGS = {
    "dense_mqa_bias": dict(BASE, num_key_value_heads=1, attention_bias=True),
    "dense_gqa_tied": dict(BASE, tie_word_embeddings=True),
    "moe_mixed": dict(MOE, mlp_only_layers=[1]),
    "moe_sparse_step2_mqa": dict(MOE, decoder_sparse_step=2, num_key_value_heads=1, norm_topk_prob=False),
}
PASS_SETS = [[p] for p in DEFAULT_PASSES] + [list(DEFAULT_PASSES)]


def _plain(cfg: ModelConfig) -> nn.Module:
    model = materialize(meta_model(cfg, torch.float32), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.normal_(0.0, 0.2, generator=gen)
    return model


def _passed(cfg: ModelConfig, plain: nn.Module, passes: list[str]) -> fx.GraphModule:
    meta = meta_model(cfg, torch.float32)
    result = run_passes(trace(meta), meta.checkpoint_map(), passes)
    gm = materialize(result.gm, torch.device("cpu"))
    tensors = ((("plain", name, t) for name, t in plain.checkpoint_map().extract(plain)))
    assign_tensors(gm, result.weights, tensors, tied_head=cfg.tie_word_embeddings)
    return gm


def _run(module: nn.Module, cfg: ModelConfig, prompts: list[list[int]], decode_tokens: list[int],
         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Hidden states of a prefill of `prompts` followed by one decode step; fresh KV cache."""
    ecfg = EngineConfig(device=torch.device("cpu"), dtype=dtype, max_model_len=128,
                        max_num_seqs=8, max_num_batched_tokens=512)
    kv = KVPool(cfg.num_hidden_layers, 512, cfg.num_key_value_heads, cfg.head_dim, dtype, ecfg.device)
    pool = ReqToTokenPool(8, 128, ecfg.device)
    scheduler = Scheduler(kv, pool, 8, 512)
    runner = ModelRunner({BASE_GRAPH: module}, ecfg, kv, pool)
    requests = [Request(i, None, p, SamplingParams()) for i, p in enumerate(prompts)]
    for r in requests:
        scheduler.add(r)
    prefill = runner.forward(scheduler.schedule()).hidden
    for r, t in zip(requests, decode_tokens):
        r.output_token_ids.append(t)
    decode = runner.forward(scheduler.schedule()).hidden
    return torch.cat([prefill, decode])


@pytest.mark.parametrize("passes", PASS_SETS, ids="+".join)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_passed_graph_matches_unpassed(name, passes):
    cfg = ModelConfig.from_dict(CONFIGS[name])
    plain = _plain(cfg)
    gm = _passed(cfg, plain, passes)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 6, 13)]
    decode = torch.randint(0, cfg.vocab_size, (3,), generator=gen).tolist()
    ref = _run(plain, cfg, prompts, decode)
    out = _run(gm, cfg, prompts, decode)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    _check_structure(gm, cfg, passes)


# the ops that apply a linear's weight (after skinny_linear), with the weight's place in their args
LINEAR_OPS = {torch.ops.compiled.linear: 1, torch.ops.compiled.add_rms_norm_linear: 4,
              torch.ops.compiled.silu_mul_linear: 1, torch.ops.compiled.moe_add_rms_norm_linear: 8}
# the ops that add + RMSNorm the residual stream before their linear: (norm weight, eps, keep_normed) places
NORM_OPS = {torch.ops.compiled.add_rms_norm_linear: (2, 3, 5), torch.ops.compiled.moe_add_rms_norm_linear: (6, 7, 9)}


def _is_linear_op(n: fx.Node) -> bool:
    return any(is_op(n, op) for op in LINEAR_OPS)


def _linear_calls(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """Module path -> the node applying that linear: a call_module, or (after skinny_linear)
    one of LINEAR_OPS on the module's weight."""
    calls = {}
    for n in gm.graph.nodes:
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear):
            calls[n.target] = n
        for op, at in LINEAR_OPS.items():
            if is_op(n, op):
                calls[n.args[at].target.removesuffix(".weight")] = n
    return calls


def _linears_under(gm: fx.GraphModule, prefix: str, exclude: str) -> list[str]:
    return [t for t in _linear_calls(gm) if t.startswith(prefix) and not t.endswith(exclude)]


def _moe_weights(n: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(w13, w2) read by a fused MoE, alone or inside moe_add_rms_norm_linear; else None."""
    if is_op(n, torch.ops.compiled.fused_moe):
        return n.args[3], n.args[4]
    if is_op(n, torch.ops.compiled.moe_add_rms_norm_linear):
        return n.args[4], n.args[5]
    return None


def _check_structure(gm: fx.GraphModule, cfg: ModelConfig, passes: list[str]) -> None:
    nodes = list(gm.graph.nodes)
    for i in range(cfg.num_hidden_layers):
        layer = f"model.layers.{i}."
        qkv = _linears_under(gm, layer + "self_attn", "o_proj")
        assert len(qkv) == (1 if "fuse_qkv" in passes else 3)
        if cfg.is_moe_layer(i):
            fused = [args for args in map(_moe_weights, nodes) if args and args[0].target == layer + "mlp.w13"]
            if "fuse_w13" in passes:
                assert len(fused) == 1 and fused[0][1].target == layer + "mlp.w2"
                assert not any(n.op == "get_attr" and ".experts." in n.target and n.target.startswith(layer)
                               for n in nodes)
            else:
                assert not fused
        else:
            assert len(_linears_under(gm, layer + "mlp", "down_proj")) == (1 if "fuse_w13" in passes else 2)
    silu = [n for n in nodes if n.op == "call_function" and n.target is torch.nn.functional.silu]
    fused_act = [n for n in nodes if is_op(n, torch.ops.compiled.silu_and_mul)]
    dense_layers = sum(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    if "fuse_w13" in passes and "silu_and_mul" in passes:
        downs = [n for t, n in _linear_calls(gm).items() if t.endswith("mlp.down_proj")]
        assert not silu and len(downs) == dense_layers
        if {"skinny_linear", "fuse_silu_linear"} <= set(passes):  # the activation goes into the down GEMM
            assert not fused_act and all(is_op(n, torch.ops.compiled.silu_mul_linear) for n in downs)
        else:
            assert len(fused_act) == dense_layers
            assert all(is_op(n.args[0], torch.ops.compiled.silu_and_mul) for n in downs)
    else:
        assert len(silu) == dense_layers and not fused_act  # silu_and_mul alone needs a fused w13
    assert not any(is_op(n, torch.ops.compiled.moe_experts) for n in nodes) or "fuse_w13" not in passes
    _check_skinny(gm, cfg, "skinny_linear" in passes)
    _check_qk_norm_rope(gm, cfg, "fuse_qk_norm_rope" in passes)
    _check_norm_linear(gm, cfg, passes)
    _check_routing(gm, cfg, {"fuse_w13", "fuse_routing"} <= set(passes))


def _check_routing(gm: fx.GraphModule, cfg: ModelConfig, applied: bool) -> None:
    """With fuse_routing each MoE layer's experts op routes its tokens (the router's logits as its
    operand) and no routing op is left; without it each layer keeps its routing op."""
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    routes = [n for n in gm.graph.nodes if is_op(n, torch.ops.compiled.topk_route)]
    experts = [call_args(n) for n in gm.graph.nodes if is_op(n, torch.ops.compiled.fused_moe)
               or is_op(n, torch.ops.compiled.moe_add_rms_norm_linear)]
    assert len(routes) == (0 if applied else moe_layers)
    if applied:
        assert len(experts) == moe_layers
        assert all(e["topk_ids"] is None and e["router_logits"] is not None and e["top_k"] == cfg.num_experts_per_tok
                   and e["renormalize"] == cfg.norm_topk_prob for e in experts)


def _check_norm_linear(gm: fx.GraphModule, cfg: ModelConfig, passes: list[str]) -> None:
    """With fuse_norm_linear (on skinny_linear's ops) every residual add + RMSNorm in front of a
    bias-free linear goes into it: each layer's post-attention norm and, where qkv has no bias,
    every input norm but the first (which reads the embedding). The normalised rows are kept
    where something else reads them too (the MoE experts, unfused projections)."""
    fused = [(n, NORM_OPS[op]) for n in gm.graph.nodes for op in NORM_OPS if is_op(n, op)]
    L = cfg.num_hidden_layers
    expected = L + (0 if cfg.attention_bias else L - 1) if {"skinny_linear", "fuse_norm_linear"} <= set(passes) else 0
    assert len(fused) == expected
    norms_left = 2 * L + 1 - expected + (0 if "fuse_qk_norm_rope" in passes else 2 * L)
    assert sum(n.op == "call_function" and n.target is torch.rsqrt for n in gm.graph.nodes) == norms_left
    for n, (w, eps, keep) in fused:
        layer = n.args[w].target.split(".")[2]
        post = n.args[w].target.endswith("post_attention_layernorm.weight")
        shared = (cfg.is_moe_layer(int(layer)) or "fuse_w13" not in passes) if post else "fuse_qkv" not in passes
        assert n.args[eps] == cfg.rms_norm_eps and n.args[keep] == shared, n.format_node()
    _check_moe_norm(gm, cfg, passes, expected > 0)


def _check_moe_norm(gm: fx.GraphModule, cfg: ModelConfig, passes: list[str], norms_fused: bool) -> None:
    """With fuse_moe_norm every fused MoE whose output goes into the next layer's fused input norm
    is inside it: each MoE layer but the last (whose output goes to the final norm)."""
    fused = [n for n in gm.graph.nodes if is_op(n, torch.ops.compiled.moe_add_rms_norm_linear)]
    applies = norms_fused and not cfg.attention_bias and {"fuse_w13", "fuse_moe_norm"} <= set(passes)
    L = cfg.num_hidden_layers
    assert len(fused) == (sum(cfg.is_moe_layer(i) for i in range(L - 1)) if applies else 0)
    for n in fused:
        layer = int(n.args[4].target.split(".")[2])
        assert n.args[6].target == f"model.layers.{layer + 1}.input_layernorm.weight", n.format_node()


def _check_qk_norm_rope(gm: fx.GraphModule, cfg: ModelConfig, applied: bool) -> None:
    """With fuse_qk_norm_rope every attention op reads its layer's raw q/k, both norm weights,
    the positions and the RoPE table; no rotary call or per-head norm is left in the graph."""
    attention = [n for n in gm.graph.nodes if is_op(n, torch.ops.compiled.attention)]
    assert len(attention) == cfg.num_hidden_layers
    rope_calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.endswith("rotary_emb")]
    norm_reads = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.endswith(("q_norm.weight", "k_norm.weight"))]
    if not applied:
        assert all(len(n.args) == 5 for n in attention) and len(rope_calls) == cfg.num_hidden_layers
        return
    assert not rope_calls and len(norm_reads) == 2 * cfg.num_hidden_layers
    for n in attention:
        layer = f"model.layers.{n.args[3]}.self_attn."
        assert [a.target for a in n.args[5:7]] == [layer + "q_norm.weight", layer + "k_norm.weight"]
        assert n.args[7].op == "placeholder" and n.args[8].target == "model.rotary_emb.cos_sin"
        assert n.args[9] == cfg.rms_norm_eps


def _check_skinny(gm: fx.GraphModule, cfg: ModelConfig, applied: bool) -> None:
    """With skinny_linear every bias-free linear (attention, dense MLP, MoE router, LM head)
    goes through compiled::linear and biased ones stay modules; without it nothing does."""
    calls = _linear_calls(gm)
    biased = {t for t in calls if gm.get_submodule(t).bias is not None}
    through_op = {t for t, n in calls.items() if _is_linear_op(n)}
    assert through_op == (set(calls) - biased if applied else set())
    attention = {t for t in calls if ".self_attn." in t}
    assert biased == (attention if cfg.attention_bias else set())
    routers = {f"model.layers.{i}.mlp.gate" for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)}
    assert routers <= set(calls)
    assert isinstance(gm.lm_head, SkinnyLinear) == applied
    if cfg.tie_word_embeddings:
        assert gm.lm_head.weight is gm.get_submodule("model.embed_tokens").weight


def test_dead_node_sweep_matches_fx_dead_code_elimination(monkeypatch):
    """The manager's sweep erases what fx's eliminate_dead_code erases: dead chains go in one walk,
    a dead call with a side effect stays; and the passed graph of a model is the same either way."""
    import compiled.passes.manager as manager
    from compiled.passes.base import sweep_dead_nodes

    def build() -> fx.Graph:
        g = fx.Graph()
        x = g.placeholder("x")
        fed = g.call_function(torch.mul, (g.call_function(torch.add, (x, 1)), 2))   # read by the assert
        g.call_function(torch._assert, (g.call_function(torch.gt, (fed, -1)), "kept: a side effect"))
        g.call_function(torch.neg, (x,))   # dead
        g.call_function(torch.sub, (g.call_function(torch.exp, (x,)), 1))   # a dead chain of two
        g.output(g.call_function(torch.mul, (x, 3)))
        return g

    ours, theirs = build(), build()
    assert sweep_dead_nodes(ours) == 3
    theirs.eliminate_dead_code()
    assert [(n.op, n.target) for n in ours.nodes] == [(n.op, n.target) for n in theirs.nodes]

    cfg = ModelConfig.from_pretrained("compiled/demo/qwen3-moe")

    def passed_code() -> str:
        model = meta_model(cfg)
        weights = model.checkpoint_map()
        gm = trace(model)
        run_passes(gm, weights, check="none")
        return gm.code
    code = passed_code()
    monkeypatch.setattr(manager, "sweep_dead_nodes", lambda graph: graph.eliminate_dead_code())
    assert passed_code() == code


def _lora_set(n: torch.fx.Node, operand: str = "lora_a") -> bool:
    """Whether the op call `n` has its LoRA operands (the first of them: `operand`) set."""
    return call_args(n)[operand] is not None


def test_with_lora_the_moe_norm_fusion_takes_the_expert_lora_moe_and_the_qkv_lora():
    """With lora_delta, each MoE layer but the last (whose output goes to the final norm) runs as
    moe_add_rms_norm_linear with its layer's expert-LoRA buffers and the next layer's qkv
    LoRA buffers (the norm's kernel runs the qkv's shrink); none is left as a fused_moe with
    expert LoRA beside a norm op of its own, and no shrink or expand is left; each keeps its
    routing op."""
    from compiled.passes.lora_delta import lora_delta_pass
    from compiled.passes.manager import with_lora
    cfg = ModelConfig.from_dict(dict(MOE, num_hidden_layers=3))
    meta = meta_model(cfg, torch.float32)
    gm = run_passes(trace(meta), meta.checkpoint_map(), with_lora(None, lora_delta_pass(2, 4))).gm
    moe_norms = [n for n in gm.graph.nodes if is_op(n, torch.ops.compiled.moe_add_rms_norm_linear)]
    fused = [n for n in moe_norms if _lora_set(n)]
    alone = [n for n in gm.graph.nodes if is_op(n, torch.ops.compiled.fused_moe) and _lora_set(n, "lora_a13")]
    assert len(fused) == 2 and len(alone) == 1
    slots = call_args(alone[0])["lora_slot"]   # the token slots, as the last layer's MoE reads them
    for n in fused:
        args = call_args(n)
        layer = int(args["w13"].target.split(".")[2])
        qkv = f"model.layers.{layer + 1}.self_attn.qkv_proj"
        assert args["weight"].target == f"{qkv}.weight" and args["keep_normed"] is False
        assert [args[f"lora_{t}"].target for t in ("a", "b", "scale")] == [f"{qkv}.lora_{t}" for t in ("a", "b", "scale")]
        assert args["lora_slot"] is slots and args["lora_slices"] == [64, 32, 32]
        assert [args[f"moe_{b}"].target for b in ("lora_a13", "lora_b13", "lora_a2", "lora_b2", "lora_scale")] == \
            [f"model.layers.{layer}.mlp.{b}" for b in ("lora_a13", "lora_b13", "lora_a2", "lora_b2", "lora_scale")]
    assert not [n for n in gm.graph.nodes if is_op(n, torch.ops.compiled.lora_shrink)
                or is_op(n, torch.ops.compiled.lora_expand) or n in moe_norms and not _lora_set(n)]
    # the experts with LoRA keep their routing op (fuse_routing leaves them alone)
    assert all(call_args(n)["topk_ids"] is not None and call_args(n)["router_logits"] is None for n in fused + alone)
    assert len([n for n in gm.graph.nodes if is_op(n, torch.ops.compiled.topk_route)]) == 3


def _lora_passed(config: dict):
    from compiled.passes.lora_delta import lora_delta_pass
    from compiled.passes.manager import with_lora
    cfg = ModelConfig.from_dict(config)
    meta = meta_model(cfg, torch.float32)
    return cfg, run_passes(trace(meta), meta.checkpoint_map(), with_lora(None, lora_delta_pass(2, 4))).gm


def test_with_lora_each_dense_projection_is_one_op_with_its_shrink_and_expand():
    """fuse_lora_linear and the prologue fusions after it: in a dense model every LoRA'd linear is
    one op holding its shrink and expand (o_proj and the first qkv a linear with LoRA, the other
    qkv and every gate/up an add_rms_norm_linear with LoRA, every down a silu_mul_linear with
    LoRA), each with its own projection's LoRA buffers; no shrink or expand is left on its own."""
    cfg, gm = _lora_passed(BASE)
    ops = (torch.ops.compiled.linear, torch.ops.compiled.add_rms_norm_linear, torch.ops.compiled.silu_mul_linear)
    found = {}
    for n in gm.graph.nodes:
        for op in ops:
            if is_op(n, op) and _lora_set(n):
                args = call_args(n)
                owner = args["weight"].target.removesuffix(".weight")
                assert [args[f"lora_{t}"].target for t in ("a", "b", "scale")] == \
                    [f"{owner}.lora_{t}" for t in ("a", "b", "scale")]
                found[owner] = op
    layers = range(cfg.num_hidden_layers)
    assert found == {**{f"model.layers.{i}.self_attn.o_proj": torch.ops.compiled.linear for i in layers},
                     **{f"model.layers.{i}.mlp.down_proj": torch.ops.compiled.silu_mul_linear for i in layers},
                     **{f"model.layers.{i}.mlp.w13": torch.ops.compiled.add_rms_norm_linear for i in layers},
                     **{f"model.layers.{i}.self_attn.qkv_proj": torch.ops.compiled.add_rms_norm_linear
                        for i in layers[1:]},
                     "model.layers.0.self_attn.qkv_proj": torch.ops.compiled.linear}
    assert not [n for n in gm.graph.nodes if is_op(n, torch.ops.compiled.lora_shrink)
                or is_op(n, torch.ops.compiled.lora_expand)]


def test_with_lora_a_qkv_after_a_moe_layer_joins_the_moe_norm_fusion():
    """The qkv reading the norm of a MoE layer's output is a moe_add_rms_norm_linear with LoRA (the
    expert sum and the qkv's shrink in the norm's kernel); the qkv after a dense MLP layer takes its
    delta inside an add_rms_norm_linear with LoRA."""
    cfg, gm = _lora_passed(dict(MOE, num_hidden_layers=3, mlp_only_layers=[1]))
    moe_norm = [call_args(n)["weight"].target for n in gm.graph.nodes
                if is_op(n, torch.ops.compiled.moe_add_rms_norm_linear) and _lora_set(n)]
    assert moe_norm == ["model.layers.1.self_attn.qkv_proj.weight"]
    norm_lora = [call_args(n)["weight"].target for n in gm.graph.nodes
                 if is_op(n, torch.ops.compiled.add_rms_norm_linear) and _lora_set(n)]
    assert norm_lora == ["model.layers.1.mlp.w13.weight", "model.layers.2.self_attn.qkv_proj.weight"]
    assert not [n for n in gm.graph.nodes if is_op(n, torch.ops.compiled.lora_expand)]


def test_with_lora_a_moe_layers_o_proj_delta_goes_into_the_post_attention_norm():
    """Each MoE layer's o_proj and its post-attention norm + router are one add_rms_norm_linear
    holding o_proj's weight and LoRA buffers (`delta_*`) and the residual; a dense layer's o_proj
    (before gate/up's add_rms_norm_linear with LoRA) stays a linear with LoRA."""
    cfg, gm = _lora_passed(dict(MOE, num_hidden_layers=3, mlp_only_layers=[1]))
    fused = [n for n in gm.graph.nodes if is_op(n, torch.ops.compiled.add_rms_norm_linear)
             and call_args(n)["delta_weight"] is not None]
    assert [call_args(n)["delta_weight"].target for n in fused] == \
        [f"model.layers.{i}.self_attn.o_proj.weight" for i in (0, 2)]
    for n in fused:
        args = call_args(n)
        owner = args["delta_weight"].target.removesuffix(".weight")
        assert [args[f"delta_lora_{t}"].target for t in ("a", "b", "scale")] == \
            [f"{owner}.lora_{t}" for t in ("a", "b", "scale")]
        layer = owner.split(".")[2]
        assert args["norm_weight"].target == f"model.layers.{layer}.post_attention_layernorm.weight"
        assert args["weight"].target == f"model.layers.{layer}.mlp.gate.weight" and args["keep_normed"] is True
        assert args["lora_a"] is None
    plain = [call_args(n)["weight"].target for n in gm.graph.nodes
             if is_op(n, torch.ops.compiled.linear) and _lora_set(n)]
    assert "model.layers.1.self_attn.o_proj.weight" in plain
    assert not any(isinstance(a, torch.fx.Node) and is_op(a, torch.ops.compiled.linear) and _lora_set(a)
                   for n in gm.graph.nodes
                   if is_op(n, torch.ops.compiled.add_rms_norm_linear) and not _lora_set(n)
                   for a in call_args(n).values())
