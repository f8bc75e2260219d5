"""tp_shard on the traced graph: each rank's parameters are its share (K/V heads replicated when
the world exceeds them; vocabulary rows padded when the world does not divide them; whole
experts under expert parallelism), an all-reduce follows every row-parallel output and the
embedding, the weight map reads only the rank's slices, and the collectives are the identity
without a group."""

from __future__ import annotations

import torch

from compiled.graphs.config import ModelConfig
from compiled.graphs.trace import meta_model, trace
from compiled.passes.base import GraphPass, is_op
from compiled.passes.calls import call_args
from compiled.passes.manager import DEFAULT_PASSES, passes_for, run_passes
from compiled.passes.variant import BASE, GraphVariant

CFG = dict(architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
           rope_theta=1e4, max_position_embeddings=128, tie_word_embeddings=False, num_experts=4,
           num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0], attention_bias=True)


def _shard(world: int, rank: int, expert_parallel: bool = False, **overrides):
    model = meta_model(ModelConfig(**dict(CFG, **overrides)), torch.float32)
    gm = trace(model)
    variant = GraphVariant(tp_size=world, tp_rank=rank, expert_parallel=expert_parallel)
    result = run_passes(gm, model.checkpoint_map(), passes_for(variant, None), check="each")
    return gm, result


def test_tp_shard_runs_first_and_only_for_a_world_above_1():
    names = [p.name if isinstance(p, GraphPass) else p for p in passes_for(GraphVariant(tp_size=2), None)]
    assert names == ["tp_shard", *DEFAULT_PASSES]
    assert passes_for(BASE.at(1, 0), None) == list(DEFAULT_PASSES)
    assert str(GraphVariant(tp_size=4, tp_rank=3)) == "tp3/4"


def test_each_rank_holds_its_share_and_reduces_row_parallel_outputs():
    gm, result = _shard(2, 1)
    params = dict(gm.named_parameters())
    assert params["model.layers.0.self_attn.qkv_proj.weight"].shape == (2 * 8 + 2 * 8, 32)   # 2 q + 1 k + 1 v head
    assert params["model.layers.0.self_attn.o_proj.weight"].shape == (32, 16)
    assert params["model.layers.0.mlp.w13.weight"].shape == (64, 32)           # [gate; up] of 32 rows each
    assert params["model.layers.1.mlp.w13"].shape == (4, 16, 32)                # 8 of 16 expert rows, twice
    assert params["model.layers.1.mlp.w2"].shape == (4, 32, 8)
    assert params["lm_head.weight"].shape == (32, 32)                           # half the vocabulary
    assert params["model.embed_tokens.weight"].shape == (32, 32)
    reduces = [n for n in gm.graph.nodes if "all_reduce" in str(n.target)]
    assert len(reduces) == 5                                                    # o_proj and the MLP, per layer; the embedding
    describe = result.weights.describe
    assert describe("model.layers.0.self_attn.qkv_proj.weight").endswith(
        "q_proj.weight[16:32], model.layers.0.self_attn.k_proj.weight[8:16], model.layers.0.self_attn.v_proj.weight[8:16])")
    assert describe("model.layers.1.mlp.w2").endswith("down_proj.weight[:, 8:16])")
    # the row-parallel bias is added once, after the sum
    assert "model.layers.0.self_attn.o_proj_bias" in params


def test_kv_heads_are_replicated_past_their_count():
    for rank, head in ((0, 0), (1, 0), (2, 1), (3, 1)):
        gm, result = _shard(4, rank)
        assert dict(gm.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"].shape == (3 * 8, 32)
        assert f"k_proj.weight[{8 * head}:{8 * head + 8}]" in result.weights.describe(
            "model.layers.0.self_attn.qkv_proj.weight")


def test_all_reduce_is_the_identity_without_a_group():
    import compiled.parallel.ops  # noqa: F401
    x = torch.randn(3, 5)
    y = torch.ops.compiled.all_reduce(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()


def test_the_vocabulary_is_padded_when_the_world_does_not_divide_it():
    for rank, (start, rows) in ((0, (0, 32)), (1, (32, 31))):
        gm, result = _shard(2, rank, vocab_size=63)
        assert dict(gm.named_parameters())["model.embed_tokens.weight"].shape == (32, 32)
        assert result.weights.describe("lm_head.weight") == f"lm_head.weight = lm_head.weight[{start}:{start + rows}]"
        assert gm.lm_head.out_features == 63 and gm.lm_head.weight.shape == (32, 32)
    gm, _ = _shard(2, 1, vocab_size=63, tie_word_embeddings=True)   # a tied head shares the embedding's shard
    assert gm.lm_head.weight is gm.get_submodule("model.embed_tokens").weight


def test_expert_parallel_ranks_hold_whole_experts_and_skip_the_others():
    gm, result = _shard(2, 1, expert_parallel=True)
    params = dict(gm.named_parameters())
    assert params["model.layers.1.mlp.w13"].shape == (2, 32, 32)                # 2 of 4 experts, whole
    assert params["model.layers.1.mlp.w2"].shape == (2, 32, 16)
    assert params["model.layers.0.mlp.w13.weight"].shape == (64, 32)           # the dense layer stays TP
    pieces = result.weights.pieces["model.layers.1.mlp.w2"]
    assert [(p.source, p.expert) for p in pieces] == [("model.layers.1.mlp.experts.2.down_proj.weight", 0),
                                                     ("model.layers.1.mlp.experts.3.down_proj.weight", 1)]
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in result.weights.skipped
    assert not any(".experts.2." in s or ".experts.3." in s for s in result.weights.skipped)
    # the routing keeps the rank's pairs itself: no node added; the experts route (fuse_routing) with it
    experts = _expert_calls(gm)
    assert experts and all(call_args(n)["local_experts"] == 2 and call_args(n)["topk_ids"] is None for n in experts)
    assert not any(is_op(n, torch.ops.compiled.topk_route) for n in gm.graph.nodes)
    plain, _ = _shard(2, 1)   # without expert parallelism the experts route over all experts
    assert [call_args(n)["local_experts"] for n in _expert_calls(plain)] == [None] * len(experts)
    assert len(plain.graph.nodes) == len(gm.graph.nodes)


def _expert_calls(gm) -> list:
    ops = (torch.ops.compiled.fused_moe, torch.ops.compiled.moe_add_rms_norm_linear)
    return [n for n in gm.graph.nodes if any(is_op(n, op) for op in ops)]


def test_expert_parallel_routing_keeps_the_ranks_pairs():
    """topk_route(local_experts=2) on 4 experts, rank 0 and 1 of 2, against the mapping by hand."""
    import compiled.moe.routing  # noqa: F401
    from compiled.parallel.tensor import TPGroup, set_tp_group
    # top-2 of token 0: experts 3 (0.4) and 2 (0.3); of token 1: experts 0 (0.4) and 2 (0.3)
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.1, 0.3, 0.2]]).log()
    whole_w, whole_ids = torch.ops.compiled.topk_route(logits, 2, True)
    assert whole_ids.tolist() == [[3, 2], [0, 2]]
    torch.testing.assert_close(whole_w, torch.tensor([[4 / 7, 3 / 7], [4 / 7, 3 / 7]]))
    expected = {0: ([[0.0, 0.0], [4 / 7, 0.0]], [[-1, -1], [0, -1]]),    # only expert 0 is rank 0's
                1: ([[4 / 7, 3 / 7], [0.0, 3 / 7]], [[1, 0], [-1, 0]])}  # 3 -> local 1, 2 -> local 0
    for rank, (weights, ids) in expected.items():
        set_tp_group(TPGroup(None, 2, rank))   # no collective runs below
        try:
            w, e = torch.ops.compiled.topk_route(logits, 2, True, local_experts=2)
            unnormalised, _ = torch.ops.compiled.topk_route(logits, 2, False, local_experts=2)
        finally:
            set_tp_group(None)
        torch.testing.assert_close(w, torch.tensor(weights))
        assert e.tolist() == ids and e.dtype == torch.int64
        torch.testing.assert_close(unnormalised, torch.tensor(weights) * 0.7)


def test_the_vocab_and_expert_ops_follow_the_rank():
    import compiled.parallel.vocab  # noqa: F401
    from compiled.parallel.tensor import TPGroup, set_tp_group
    weight = torch.randn(4, 3)
    ids = torch.tensor([0, 3, 4, 7, 8])
    gathered = torch.ops.compiled.all_gather(weight)
    assert torch.equal(gathered, weight) and gathered.data_ptr() != weight.data_ptr()
    set_tp_group(TPGroup(None, 2, 1))   # rank 1 of 2 (no collective runs below)
    try:
        rows = torch.ops.compiled.vocab_embedding(ids, weight)
    finally:
        set_tp_group(None)
    assert torch.equal(rows, torch.stack([torch.zeros(3), torch.zeros(3), weight[0], weight[3], torch.zeros(3)]))
