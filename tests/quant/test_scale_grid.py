"""A tensor-parallel rank's FP8 scales, single-process: the blocks its slices touch, gathered onto
one grid that every slice and fused-member start falls on, dequantize to exactly that rank's
slices of the dequantized weights (odd sizes, slices starting inside blocks, partial edge blocks,
per channel and per tensor)."""

from __future__ import annotations

import pytest
import torch

from compiled.graphs.config import ModelConfig
from compiled.quant.config import QuantConfig
from compiled.quant.dequant import FP8, dequantize, dequantize_blocks, quantize
from compiled.quant.grid import ScaleGrid, local_block
from compiled.runtime.build import build_models
from compiled.runtime.config import EngineConfig
from tests.conftest import assert_same_math, make_checkpoint
from tests.quant.checkpoints import BLOCK_FP8, compressed_tensors, quantize_checkpoint


@pytest.mark.parametrize("block, rows, cols", [
    ((16, 12), (18, 27), (6, 20)),   # starts inside blocks, the slice runs to a partial last block
    ((16, 12), (0, 45), (24, 13)),   # whole rows; columns from a block start into a partial block
    ((32, 40), (21, 3), (0, 37)),    # three rows inside one block
    ((1, 0), (7, 30), (5, 31)),      # per channel: a scale a row, the whole row
    ((0, 0), (10, 11), (3, 9)),      # per tensor
])
def test_a_slice_dequantizes_with_the_blocks_it_touches(block, rows, cols):
    scheme = "block" if all(block) else ("channel" if block[0] else "tensor")
    quant = QuantConfig("fp8", scheme, block if scheme == "block" else None)
    torch.manual_seed(0)
    q, scale = quantize(torch.randn(45, 37), quant)
    fine = local_block(quant.op_block, rows, cols)
    grid = ScaleGrid(quant.op_block, fine, rows, cols)
    local = grid.take(scale)
    assert local.shape == grid.shape
    sliced = q[rows[0]:sum(rows), cols[0]:sum(cols)]
    assert_same_math(dequantize_blocks(sliced, local, fine, torch.float32),
                     dequantize(q, scale, quant)[rows[0]:sum(rows), cols[0]:sum(cols)])


def test_the_grid_reads_only_the_blocks_the_slice_touches():
    grid = ScaleGrid((128, 128), local_block((128, 128), [192, 192], []), (192, 192), (0, 256))
    assert grid.fine == (64, 128) and grid.indices(0) == [1, 2, 2] and grid.indices(1) == [0, 1]
    scale = torch.arange(12.0).reshape(6, 2)
    assert grid.take(scale).tolist() == [[2, 3], [4, 5], [4, 5]]


def _rank_params(path: str, world: int, rank: int, **kwargs):
    cfg = ModelConfig.from_pretrained(path)
    config = EngineConfig.from_kwargs(model=path, device="cpu", dtype="float32", tensor_parallel_size=world,
                                      enforce_eager=True, **kwargs).resolve(cfg.max_position_embeddings)
    models = build_models(cfg, path, config, tp_rank=rank)
    return {n: p.detach() for n, p in models.base.named_parameters()}, models.base


CASES = {
    # w13 of 48 a rank: the up slice starts inside a 32 block; o_proj/down columns inside 40 blocks
    "moe-block32x40-tp2": (True, dict(BLOCK_FP8, weight_block_size=[32, 40]), 2, False),
    # 24-wide MLP slices and one-head q/k/v slices (K/V replicated) inside 128 blocks
    "dense-block128-tp4": (False, BLOCK_FP8, 4, False),
    "moe-channel-tp2": (True, compressed_tensors(), 2, False),
    # quantization="fp8" at TP=3 (3 heads of 16, 3 K/V heads, 405 MLP rows): each rank quantizes
    # only the 128 blocks its 135-row slice touches (rank 1's [135, 270): the 256 rows [128, 384))
    "dense-at-load-tp3": (False, BLOCK_FP8, 3, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_holds_the_dequantized_slices_of_its_weights(tmp_path, case, monkeypatch):
    """Rank r of an FP8 checkpoint (or of its source quantized at load), its FP8 parameters
    dequantized at the graph's weight_block, equals rank r of the dequantized checkpoint; every
    rank has the same shapes and block."""
    moe, quant_config, world, at_load = CASES[case]
    sizes = dict(num_attention_heads=3, num_key_value_heads=3, intermediate_size=405) if at_load else {}
    src = make_checkpoint(tmp_path / "src", moe=moe, moe_intermediate_size=48, num_hidden_layers=2,
                          mlp_only_layers=[1] if moe else [], **sizes)
    path, reference = quantize_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", quant_config)
    quantized = _recording_quantize(monkeypatch)
    shapes = None
    for rank in range(world):
        params, gm = _rank_params(src, world, rank, quantization="fp8") if at_load else _rank_params(path, world, rank)
        want, _ = _rank_params(reference, world, rank)
        fp8 = sorted(n for n, p in params.items() if p.dtype == FP8)
        assert len(fp8) == 8, fp8   # qkv, o_proj, w13 and w2 / down of both layers stay FP8
        blocks = {tuple(n.kwargs["weight_block"]) for n in gm.graph.nodes if n.kwargs.get("weight_block")}
        assert len(blocks) == 1
        block = blocks.pop()
        for name in fp8:
            assert_same_math(dequantize_blocks(params[name], params[f"{name}_scale"], block, torch.float32), want[name])
        rank_shapes = ({n: tuple(p.shape) for n, p in params.items()}, block)
        assert shapes in (None, rank_shapes)
        shapes = rank_shapes
    if at_load:   # the MLP's 405 rows / columns: [0, 256), [0, 256), [256, 405); q/k/v/o: 48, one block
        assert {s[0] for s in quantized if s[1] == 64} == {256, 149, 48}   # gate, up (and q, k, v) rows
        assert {s[1] for s in quantized if s[0] == 64} == {256, 149, 48}   # down's (and o_proj's) columns


def _recording_quantize(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the tensors quantized at load, from here on."""
    import compiled.quant.loading as loading
    shapes, quantize_at_load = [], loading.quantize

    def recording(weight, *args, **kwargs):
        shapes.append(tuple(weight.shape))
        return quantize_at_load(weight, *args, **kwargs)
    monkeypatch.setattr(loading, "quantize", recording)
    return shapes


def test_qwen3_30b_at_tp_4_shares_one_64x64_grid(tmp_path):
    """192 expert rows a rank (768 / 4) start inside 128 blocks: rows and columns refine to 64."""
    from compiled.graphs.trace import meta_model, trace
    from compiled.passes.manager import run_passes
    from compiled.passes.tp_shard import tp_shard_pass
    from compiled.quant.recipes import scale_recipes
    from tests.conftest import reduced_real_config
    meta = meta_model(ModelConfig.from_pretrained(reduced_real_config(tmp_path, layers=1)))
    weights = run_passes(trace(meta), meta.checkpoint_map(), [tp_shard_pass(4, 1), "fuse_qkv", "fuse_w13"],
                         check="none").weights
    recipes = scale_recipes(weights, QuantConfig("fp8", "block", (128, 128)))
    assert recipes.block == (64, 64) and not recipes.dequantized
    assert recipes.shapes["model.layers.0.mlp.w13_scale"] == (128, 6, 32)   # 2 x 192 rows, 2048 columns
    assert recipes.shapes["model.layers.0.mlp.w2_scale"] == (128, 32, 3)
    assert recipes.shapes["model.layers.0.self_attn.qkv_proj.weight_scale"] == (20, 32)   # 8 + 1 + 1 heads of 128
    gate = recipes.scales.pieces["model.layers.0.mlp.w13_scale"][0].grid
    assert gate.indices(0) == [1, 2, 2] and gate.indices(1) == [i // 2 for i in range(32)]


@pytest.mark.parametrize("broken", ["missing", "mis-shaped"])
def test_a_bad_scale_on_a_rank_is_one_line_naming_it(tmp_path, broken):
    from safetensors.torch import load_file, save_file
    from compiled.errors import CheckpointError
    path, _ = quantize_checkpoint(make_checkpoint(tmp_path / "src"), tmp_path / "fp8", tmp_path / "ref",
                                  dict(BLOCK_FP8, weight_block_size=[32, 32]))
    name, file = "model.layers.1.mlp.up_proj.weight_scale_inv", str(tmp_path / "fp8" / "model.safetensors")
    tensors = load_file(file)
    if broken == "missing":
        tensors.pop(name)
    else:
        tensors[name] = torch.ones(2, 2)
    save_file(tensors, file)
    with pytest.raises(CheckpointError) as e:
        _rank_params(path, 2, 1)
    assert "\n" not in str(e.value) and name in str(e.value)
    assert ("missing" if broken == "missing" else "has shape [2, 2], expected [3, 2]") in str(e.value)
