"""What a parent's traced code does with its children's outputs on the way to its own
result: the fields it reads off them (:func:`returned`) and the positions it takes of a
child's tuple (:func:`taken`), for :class:`.flow.Flow`.

A Hugging Face attention returns ``(attn_output, attn_weights)``; its caller unpacks both
and reads the first (``hidden_states, _ = self.self_attn(...)``). What no code reads needs
no layout: a DTensor region (:mod:`.regions`) hands such a position on as it is, where
making it whole would cost a collective that nothing uses.

Example:
    >>> import operator, torch.fx as fx
    >>> g = fx.Graph()
    >>> x = g.placeholder("a0")
    >>> out = g.call_module("inner.attn", (x,))
    >>> first, weights = (g.call_function(operator.getitem, (out, i)) for i in (0, 1))
    >>> _ = g.output((g.call_function(operator.add, (first, x)), weights))
    >>> dict(taken(g, "inner.")["attn"])
    {0: None, 1: 1}
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from types import MappingProxyType

import torch.fx as fx

__all__ = ["returned", "taken"]


def returned(graph: fx.Graph, prefix: str) -> Mapping[str, frozenset[str]]:
    """For each child whose output reaches the graph's result by the parent's own code (not
    through another child: :attr:`.flow.Flow.feeds` says which children it reaches), the fields
    of it read on the way (``getattr(out, "cache")``, ``out["cache"]``), ``""`` standing for
    a use that reads it otherwise (whole, or by position): :attr:`.flow.Flow.returned`."""
    ancestors: set[fx.Node] = set()
    todo = [n for n in graph.nodes if n.op == "output"]
    while todo:
        node = todo.pop()
        if node.op == "call_module" and str(node.target).startswith(prefix):
            continue  # what reaches a child's arguments reaches the result through it
        for a in node.all_input_nodes:
            if a not in ancestors:
                ancestors.add(a)
                todo.append(a)
    out: dict[str, set[str]] = {}
    for node in ancestors:
        if node.op != "call_module" or not str(node.target).startswith(prefix):
            continue
        name = str(node.target)[len(prefix):]
        for user in node.users:
            if user.op == "output":
                out.setdefault(name, set()).add("")
            elif user in ancestors:
                named = (user.op == "call_function" and user.target in (getattr, operator.getitem)
                         and len(user.args) == 2 and isinstance(user.args[1], str))
                out.setdefault(name, set()).add(str(user.args[1]) if named else "")
    return MappingProxyType({name: frozenset(got) for name, got in out.items()})


def _position(node: fx.Node) -> int | None:
    """The constant position ``node`` takes of a tuple (``out[1]``, or an unpacking's item)."""
    if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2 \
            and type(node.args[1]) is int and node.args[1] >= 0:
        return node.args[1]
    return None


def _handed_at(item: fx.Node, result: object) -> int | None:
    """The position of the parent's tuple result that ``item`` is, where that is all the
    parent's code does with it; ``None`` where anything else reads it."""
    users = list(item.users)
    if len(users) != 1 or users[0].op != "output" or not isinstance(result, tuple | list):
        return None
    at = [j for j, v in enumerate(result) if v is item]
    return at[0] if len(at) == 1 else None


def taken(graph: fx.Graph, prefix: str) -> Mapping[str, Mapping[int, int | None]]:
    """For each child whose every output the parent's code only takes apart by constant
    positions, the positions it reads: ``None`` where the code reads it, ``j`` where it only
    hands it on as position ``j`` of its own tuple result. A position absent is read by
    nothing. A child whose output any call reads otherwise (whole, by a slice, by a field)
    is absent: every position of it counts as read (:attr:`.flow.Flow.taken`)."""
    output = next((n for n in graph.nodes if n.op == "output"), None)
    result = output.args[0] if output is not None else None
    found: dict[str, dict[int, int | None]] = {}
    whole: set[str] = set()
    for node in graph.nodes:
        if node.op != "call_module" or not str(node.target).startswith(prefix):
            continue
        name = str(node.target)[len(prefix):]
        positions = found.setdefault(name, {})
        for user in node.users:
            i = _position(user)
            if i is None:
                whole.add(name)
            elif user.users:
                j = _handed_at(user, result)
                positions[i] = j if positions.get(i, j) == j else None
    return MappingProxyType({name: MappingProxyType(p) for name, p in found.items() if name not in whole})
