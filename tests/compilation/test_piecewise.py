"""The split at attention orders every piece's inputs and outputs as torch.fx's split_module does:
piece keys (and so saved artifacts) depend on that order."""

from __future__ import annotations

import dataclasses

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from compiled.demo import MOE_MODEL
from compiled.graphs.config import ModelConfig
from compiled.graphs.trace import meta_model, trace
from compiled.passes.base import is_op
from compiled.passes.manager import run_passes
from compiled.compilation.split import flatten, split_graph


def _structure(gm: fx.GraphModule) -> list[tuple]:
    """Each node's op, target and arguments, with nodes as positions: the graph up to names."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    pos = lambda v: repr(fx.node.map_arg(v, lambda n: index[n]))
    return [(n.op, None if n.op == "placeholder" else n.target, pos(n.args), pos(n.kwargs)) for n in gm.graph.nodes]


def test_split_matches_split_module():
    cfg = dataclasses.replace(ModelConfig.from_pretrained(MOE_MODEL), num_hidden_layers=4, mlp_only_layers=(2,))
    meta = meta_model(cfg)
    gm = run_passes(trace(meta), meta.checkpoint_map(), check="end").gm
    split = split_graph(gm)

    flat = fx.GraphModule(gm, flatten(gm))
    part, counter = {}, 0
    for node in flat.graph.nodes:
        attention = is_op(node, torch.ops.compiled.attention)
        part[node] = counter + 1 if attention else counter
        counter += 2 if attention else 0
    reference = split_module(flat, flat, part.__getitem__, keep_original_order=True)

    assert split.top.code == reference.code
    calls = [n.target for n in split.top.graph.nodes if n.op == "call_module"]
    assert len(calls) == 9 and [p.name for p in split.pieces] == calls[::2]
    for name in calls:
        assert _structure(getattr(split.top, name)) == _structure(getattr(reference, name)), name
    assert len(split.unique) == 4  # first, MoE layer, dense layer, last


def test_inline_references_replaces_silu_and_mul_with_its_reference():
    import compiled.linear.activation  # noqa: F401  (registers compiled::silu_and_mul)
    from compiled.linear.activation import silu_and_mul_ref
    from compiled.passes.inline_references import inline_references
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    act = graph.call_function(torch.ops.compiled.silu_and_mul.default, (x,))
    graph.output(graph.call_function(torch.mul, (act, 2)))
    gm = torch.fx.GraphModule({}, graph)
    inline_references(gm)
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.compiled.silu_and_mul.default]
    h = torch.randn(5, 14)
    torch.testing.assert_close(gm(h), silu_and_mul_ref(h) * 2, rtol=0, atol=0)


def test_warm_up_once_runs_each_compiled_function_once_per_shape():
    from compiled.compilation.inductor import CompiledPiece
    from compiled.compilation.warm_up import warm_up_once
    calls = []

    def fn(x, w):
        calls.append(x.shape[0])
        return x @ w

    layers = [CompiledPiece(fn, "k", True, [False, True]) for _ in range(3)]
    x, w = torch.randn(4, 3), torch.randn(3, 3)
    with warm_up_once():
        outs = [layer(x, w + i) for i, layer in enumerate(layers)]
        outs.append(layers[0](torch.randn(5, 3), w))
    assert calls == [4, 5] and outs[1] is outs[0] and outs[2] is outs[0]
    torch.testing.assert_close(layers[2](x, w + 2), x @ (w + 2))  # outside: every call runs
    assert calls == [4, 5, 4]


def test_warm_up_once_runs_attention_once_per_shape():
    from compiled.compilation.inductor import EagerSplitOp
    from compiled.compilation.warm_up import warm_up_once
    calls = []

    class Layer(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.i = i

        def forward(self, q):
            calls.append((self.i, q.shape[0]))
            return q + self.i

    layers = [EagerSplitOp(Layer(i)) for i in range(3)]
    q = torch.randn(4, 2)
    with warm_up_once():
        outs = [layer(q) for layer in layers] + [layers[2](torch.randn(6, 2))]
    assert calls == [(0, 4), (2, 6)] and outs[1] is outs[0] and outs[2] is outs[0]
    torch.testing.assert_close(layers[1](q), q + 1)
    assert calls[-1] == (1, 4)


def test_eager_attention_calls_the_ops_body_and_the_split_keeps_the_op():
    """Between the pieces the attention submodule calls `attention_body` past the dispatcher; the
    split's own submodule, which it was given, still calls the op."""
    from compiled.attention.ops import attention_body
    from compiled.compilation.inductor import EagerSplitOp
    cfg = dataclasses.replace(ModelConfig.from_pretrained(MOE_MODEL), num_hidden_layers=2)
    meta = meta_model(cfg)
    split = split_graph(run_passes(trace(meta), meta.checkpoint_map(), check="end").gm)
    names = {p.name for p in split.pieces}
    eager = [m for n, m in split.top.named_children() if n.startswith("submod_") and n not in names]
    assert len(eager) == 2
    for module in eager:
        wrapped = EagerSplitOp(module)
        targets = [n.target for n in wrapped.module.graph.nodes if n.op == "call_function"]
        assert attention_body in targets and not any(is_op(n, torch.ops.compiled.attention)
                                                     for n in wrapped.module.graph.nodes)
        assert sum(is_op(n, torch.ops.compiled.attention) for n in module.graph.nodes) == 1
    other = fx.GraphModule({}, fx.Graph())
    assert EagerSplitOp(other).module is other


def test_unowned_view_shares_memory_without_keeping_it():
    from torch.multiprocessing.reductions import StorageWeakRef

    from compiled.compilation.piecewise_graphs import unowned_view
    base = torch.randn(7, 12)
    x = base[1:, 3:8]   # a strided view with a storage offset, like q/k/v of a fused qkv
    view = unowned_view(x)
    assert view.data_ptr() == x.data_ptr() and view.stride() == x.stride() and torch.equal(view, x)
    x.add_(1)
    assert torch.equal(view, x)
    ref = StorageWeakRef(base.untyped_storage())
    del base, x
    assert ref.expired()  # the view did not keep the memory allocated


def test_piece_keys_hash_the_schemas_of_the_ops_they_call(monkeypatch):
    """A piece's key (which finds its compiled code in an artifact, and joins Inductor's cache key
    through `compile_piece`) changes with the schema of a project op it calls, which its code does
    not show: code compiled for an op's old arguments is never found for the new ones."""
    from compiled.compilation import inductor, split as split_module_
    cfg = dataclasses.replace(ModelConfig.from_pretrained(MOE_MODEL), num_hidden_layers=2)
    meta = meta_model(cfg)
    gm = run_passes(trace(meta), meta.checkpoint_map(), check="end").gm
    piece = split_graph(gm).pieces[1]
    schemas = split_module_._op_schemas(piece.graph.graph)
    assert "compiled::add_rms_norm_linear(Tensor x, Tensor delta, Tensor norm_weight" in schemas
    monkeypatch.setattr(split_module_, "_op_schemas", lambda graph: schemas + " (other arguments)")
    assert split_graph(gm).pieces[1].key != piece.key
    seen = {}

    def standalone_compile(graph, inputs, dynamic_shapes):
        seen["uuid"] = torch._inductor.config.post_grad_custom_post_pass.uuid()
    monkeypatch.setattr(torch._inductor, "standalone_compile", standalone_compile)
    inductor.compile_piece(piece.graph, [], piece.key)
    assert seen["uuid"] == piece.key
