"""Operands of a child's output: the parameters of a child that its parent's code reads
only to combine them, element by element, with that child's output (the bias
:func:`~slapo_fn.decompose` adds after a Linear's matmul, handed to ``fuse``'s
``gelu(x + bias)``). Such a read does not bypass the child: on the child's local output
the parent combines this rank's share of the operand (the runtime hands it so), and a
module combining one activation with operands alone passes its layout on.

One reason to change: what counts as an operand of a child's output in a traced graph.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch.fx as fx

from .features import elementwise_op, metadata, nodes_in

__all__ = ["combiners", "operand_of", "read_of_a_child"]


def read_of_a_child(node: fx.Node, prefix: str, children: Collection[str]) -> bool:
    """Whether ``node`` reads a parameter (or buffer) of one of ``children``, the paths of a
    parent's modules, whose graph names them under ``prefix``."""
    target = str(node.target)
    return (node.op == "get_attr" and target.startswith(prefix)
            and target[len(prefix):].rpartition(".")[0] in children)


def operand_of(read: fx.Node, child: str, combining: Callable[[fx.Node], bool]) -> bool:
    """Whether the value ``read`` (a parameter of the module the graph calls as ``child``)
    is only combined, element by element, with that module's output: each of its uses is
    an elementwise op, or a call ``combining`` accepts (an elementwise module), and is
    handed that output itself too."""
    uses = [u for u in read.users if not metadata(u)]

    def meets(use: fx.Node) -> bool:
        handed = any(a.op == "call_module" and str(a.target) == child for a in nodes_in((use.args, use.kwargs)))
        return handed and (combining(use) if use.op == "call_module" else elementwise_op(use))

    return bool(uses) and all(meets(u) for u in uses)


def combiners(graph: fx.Graph, prefix: str, combining: Callable[[fx.Node], bool]) -> set[str]:
    """The children (names under ``prefix``) every call of which ``combining`` accepts."""
    calls: dict[str, bool] = {}
    for node in graph.nodes:
        if node.op == "call_module" and str(node.target).startswith(prefix):
            name = str(node.target)[len(prefix):]
            calls[name] = calls.get(name, True) and combining(node)
    return {name for name, ok in calls.items() if ok}
