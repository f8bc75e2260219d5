"""fuse_qkv: the q, k and v projections of each attention layer become one GEMM + split."""

from __future__ import annotations

from torch import fx

from compiled.passes.base import GraphPass, PassRecord
from compiled.passes.linear_fusion import fuse_sibling_linears
from compiled.graphs.weights import WeightMap


def fuse_qkv(gm: fx.GraphModule, weights: WeightMap, record: PassRecord) -> None:
    """q_proj, k_proj, v_proj reading one input -> qkv_proj (rows [q; k; v]) + split."""
    fuse_sibling_linears(gm, weights, record, ("q_proj", "k_proj", "v_proj"), "qkv_proj")


PASS = GraphPass("fuse_qkv", fuse_qkv)
