"""`compiled graph` on an FP8 checkpoint shows the fp8_weights pass and the scale operands."""

from __future__ import annotations

from typer.testing import CliRunner

from cli.main import app
from tests.conftest import make_checkpoint
from tests.quant.checkpoints import BLOCK_FP8, quantize_checkpoint


def test_graph_shows_the_fp8_operands(tmp_path):
    src = make_checkpoint(tmp_path / "src", moe=True)
    path, _ = quantize_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", dict(BLOCK_FP8, weight_block_size=[16, 64]))
    result = CliRunner().invoke(app, ["graph", path, "--dump", str(tmp_path / "dump")], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "fp8_weights" in result.output
    (dumped,) = (tmp_path / "dump").glob("*_fp8_weights.py")   # the last pass, whatever its number
    final = dumped.read_text()
    assert "w13_scale = model_layers_0_mlp_w13_scale" in final and "weight_block = [16, 64]" in final
    assert "weight_scale = model_layers_1_self_attn_qkv_proj_weight_scale" in final
