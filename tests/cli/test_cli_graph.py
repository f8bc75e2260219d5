"""`compiled graph`: the pass table on the demo model and readable dumps."""

from __future__ import annotations

from typer.testing import CliRunner

from cli.main import app

runner = CliRunner()


def test_graph_prints_pass_table_and_dumps(tmp_path):
    result = runner.invoke(app, ["graph", "--dump", str(tmp_path)], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    for name in ("fuse_qkv", "fuse_w13", "silu_and_mul", "skinny_linear", "fuse_qk_norm_rope", "fuse_norm_linear",
                 "fuse_silu_linear", "fuse_moe_norm"):
        assert name in result.output
    assert "qkv_proj.weight = cat(" in result.output
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["00_traced.py", "01_fuse_qkv.py", "02_fuse_w13.py", "03_silu_and_mul.py", "04_skinny_linear.py",
                     "05_fuse_qk_norm_rope.py", "06_fuse_norm_linear.py", "07_fuse_silu_linear.py", "08_fuse_moe_norm.py",
                     "09_fuse_routing.py", "weights.txt"]
    traced = (tmp_path / "00_traced.py").read_text()
    final = (tmp_path / "08_fuse_moe_norm.py").read_text()
    assert "def forward(self, input_ids" in traced and "torch.ops.compiled.attention" in traced
    assert "q_proj" in traced and "q_proj" not in final and "qkv_proj" in final
    assert "compiled.moe_experts" in traced and "compiled.fused_moe" in final
    assert "compiled.silu_and_mul" in (tmp_path / "05_fuse_qk_norm_rope.py").read_text()
    assert "compiled.silu_and_mul" not in final  # inside the down projection's op now
    assert "compiled.linear.default" in final and "compiled.linear" not in traced
    assert ".qkv_proj(" not in final and "qkv_proj_weight)" in final  # the op, reading the module's weight
    assert "rotary_emb(" in traced and "rotary_emb(" not in final and "rotary_emb_cos_sin, 1e-06)" in final
    assert "compiled.add_rms_norm_linear" in final and "compiled.silu_mul_linear" in final
    assert "compiled.moe_add_rms_norm_linear" in final  # the MoE layer's experts with the next input norm
    compile(final, "08_fuse_moe_norm.py", "exec")  # the dump is valid Python


def test_graph_unknown_pass_is_one_line_error():
    result = runner.invoke(app, ["graph", "--passes", "fuse_qkv,bogus"])
    assert result.exit_code == 1 and "unknown pass 'bogus'" in result.output and "Traceback" not in result.output


def test_graph_without_passes():
    result = runner.invoke(app, ["graph", "--passes", "none"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output


def test_graph_cp_shows_the_gathers():
    result = runner.invoke(app, ["graph", "--cp", "2"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "cp_allgather" in result.output
    # the demo MoE model has 4 layers: K and V of each attention together, and the final hidden states
    assert "5 compiled::cp_allgather nodes over 2 processes" in result.output
    assert "-> output" in result.output


def test_graph_cp_below_one_is_a_one_line_error():
    result = runner.invoke(app, ["graph", "--cp", "0"])
    assert result.exit_code == 1 and "--cp 0: expected an int >= 1" in result.output


def test_graph_tp_shows_the_shards_and_all_reduces():
    result = runner.invoke(app, ["graph", "--tp", "2"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "tp_shard" in result.output
    # the demo MoE model has 4 layers: after o_proj and after the MLP or experts of each, and the embedding's
    assert "9 compiled::all_reduce nodes over 2 processes" in result.output
    assert "q_proj.weight[0:128]" in result.output   # rank 0's two of four 64-wide heads
    assert "144 of 288 vocabulary rows a rank" in result.output
    assert "model.embed_tokens.weight = model.embed_tokens.weight[0:144]" in result.output
    assert "lm_head.weight = lm_head.weight[0:144]" in result.output


def test_graph_expert_parallel_shows_whole_experts_per_rank():
    result = runner.invoke(app, ["graph", "--tp", "2", "--enable-expert-parallel"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "expert-parallel: 4 of 8 experts a rank, routed by compiled::topk_route(local_experts=4)" in result.output
    assert "stack over 4 experts of cat(model.layers.1.mlp.experts.0.gate_proj.weight, " in result.output


def test_graph_tp_that_does_not_divide_the_heads_is_a_one_line_error():
    result = runner.invoke(app, ["graph", "--tp", "3"])
    assert result.exit_code == 1 and "tensor_parallel_size=3 does not divide num_attention_heads=4" in result.output


def test_graph_quantized_at_load_shows_the_scale_operands(tmp_path):
    result = runner.invoke(app, ["graph", "--quantization", "fp8", "--dump", str(tmp_path)], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "fp8_weights" in result.output
    last = sorted(tmp_path.glob("*_fp8_weights.py"))[-1].read_text()
    # the demo's linears take their scales (its experts, off the 128 x 128 grid, load dequantized)
    assert "weight_scale = model_layers_0_self_attn_qkv_proj_weight_scale" in last and "weight_block = [128, 128]" in last


def test_graph_unknown_quantization_is_a_one_line_error():
    result = runner.invoke(app, ["graph", "--quantization", "int3"])
    assert result.exit_code == 1 and "quantization='int3'" in result.output and "Traceback" not in result.output
