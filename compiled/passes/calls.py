"""Op calls by argument name: the passes read and build the graph's custom-op calls through the op's
schema, so that an operand added to an op (a LoRA tensor, a weight scale, a process group) shifts
no other and a call missing an argument fails here, naming it.

The one place in the passes that reads a node's `args` by position: custom ops through their
schema (`call_args`, `build_call`, `update_call`), calls with no schema (Python operators, tensor
methods, modules, whose order is their meaning) through `operands`, and one output of a call that
returns a tuple through `getitem_source` / `getitem_index`."""

from __future__ import annotations

import operator

import torch
from torch import fx


def overload(target) -> torch._ops.OpOverload | None:
    """The op overload a call target names (a packet means its default overload), or None."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.default
    return target if isinstance(target, torch._ops.OpOverload) else None


def call_args(node: fx.Node) -> dict[str, object]:
    """Every argument of the custom-op call `node` by its schema name, in schema order, those the
    call leaves out at their default."""
    op = overload(node.target)
    if node.op != "call_function" or op is None:
        raise TypeError(f"call_args: {node.format_node()} is not a custom-op call")
    arguments = op._schema.arguments
    if len(node.args) > len(arguments):
        raise TypeError(f"call_args: {node.format_node()} has {len(node.args)} arguments, {op} takes "
                        f"{len(arguments)}")
    found = dict(zip((a.name for a in arguments), node.args))
    for arg in arguments[len(node.args):]:
        if arg.name in node.kwargs:
            found[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            found[arg.name] = arg.default_value
        else:
            raise TypeError(f"call_args: {node.format_node()} lacks {op}'s argument {arg.name!r}")
    return found


def call_layout(op, values: dict[str, object]) -> tuple[tuple, dict[str, object]]:
    """(args, kwargs) of a call of `op` with `values` by name: the schema's arguments in order,
    positionally while none in between is left at its default, by keyword after such a gap; those
    at their default left out, so a call without the optional operands reads as it did before
    they existed."""
    op = overload(op)
    arguments = op._schema.arguments
    unknown = set(values) - {a.name for a in arguments}
    if unknown:
        raise TypeError(f"{op} has no argument {sorted(unknown)[0]!r}")
    positional, kwargs, gap = [], {}, False
    for arg in arguments:
        if arg.name not in values and not arg.has_default_value():
            raise TypeError(f"a call of {op} needs its argument {arg.name!r}")
        value = values.get(arg.name, arg.default_value if arg.has_default_value() else None)
        if _at_default(arg, value):
            gap = True
        elif gap or arg.kwarg_only:
            kwargs[arg.name] = value
        else:
            positional.append(value)
    return tuple(positional), kwargs


def _at_default(arg, value) -> bool:
    if not arg.has_default_value():
        return False
    default = arg.default_value
    return value is default if default is None or isinstance(value, fx.Node) else value == default


def build_call(graph: fx.Graph, op, **values) -> fx.Node:
    """A new call of custom op `op` (at the graph's insertion point) with its arguments by name."""
    args, kwargs = call_layout(op, values)
    return graph.call_function(overload(op), args, kwargs)


def update_call(node: fx.Node, **changes) -> None:
    """Set arguments of the custom-op call `node` by name, in place."""
    node.args, node.kwargs = call_layout(node.target, {**call_args(node), **changes})


def operands(node: fx.Node) -> tuple:
    """The positional operands of a call with no schema (a Python operator, a tensor method, a
    module or plain function): their order is their meaning (`a + b`, `x.pow(2)`, `module(x)`)."""
    if overload(node.target) is not None:
        raise TypeError(f"operands: {node.format_node()} is a custom-op call: read it with call_args")
    return tuple(node.args)


def getitem_source(node: fx.Node) -> fx.Node:
    """The node whose tuple `node` (`source[index]`) takes one output of."""
    return _getitem(node)[0]


def getitem_index(node: fx.Node) -> int:
    """Which output of its source's tuple `node` (`source[index]`) takes."""
    return _getitem(node)[1]


def _getitem(node: fx.Node) -> tuple:
    if node.op != "call_function" or node.target is not operator.getitem:
        raise TypeError(f"{node.format_node()} is not a getitem")
    return tuple(node.args)


def output_value(graph: fx.Graph) -> tuple[fx.Node, object]:
    """(the output node, the value the graph returns)."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    return output, tuple(output.args)[0]
