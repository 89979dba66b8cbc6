"""Outlining: a matched subgraph becomes one module called from the traced graph."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from ...errors import Problem, ScheduleError
from ...schedule import Schedule
from ...tree import join, set_at, split
from ..hook import move_hooks
from ._graph import (
    contract,
    copy_graph,
    graph_module_at,
    has_hooks,
    inline_module,
    input_nodes,
    rebuild,
    region_graph,
    resolve_attr,
    unique_name,
)
from .find import Match, nodes_of, op_name

__all__ = ["Outlined", "outline"]


@dataclass(frozen=True)
class Outlined:
    """The pieces of an outlined subgraph: the region as a graph module of its own
    (no parameters: they are passed in), its inputs and outputs."""

    region: fx.GraphModule
    inputs: tuple[fx.Node, ...]
    outputs: tuple[fx.Node, ...]
    declared_inputs: int


def _owns_tensors(module: nn.Module) -> bool:
    return next(iter(module.parameters()), None) is not None or next(iter(module.buffers()), None) is not None


def outline(
    sch: Schedule,
    path: str,
    match: Match,
    what: str,
    base_name: str,
    make: Callable[[Outlined], nn.Module],
    *,
    name: str | None = None,
    inline_leaves: bool = True,
    recompute_escaping: bool = False,
) -> tuple[Schedule, str]:
    """A new schedule in which ``match`` (in the traced module at ``path``) is one
    ``call_module`` of ``make(outlined)``, registered under ``name`` (default
    ``base_name``, made unique); returns it and the new module's path.

    With ``inline_leaves``, modules with parameters called inside the subgraph are
    inlined first, so the new module holds no parameters and every FQN is kept.
    Inner values also read outside the subgraph (``match.escaping``) are extra outputs
    of the new module, or with ``recompute_escaping`` (a user's module that returns only
    the match's outputs) computed again outside it; a random one cannot be and is a
    :class:`ScheduleError`. Schedule hooks of the modules the subgraph calls move to the
    new module (forward-pre, backward-post) or are refused (:func:`move_hooks`), and so
    are hooks registered on those module objects themselves.
    """
    gm = graph_module_at(sch.module, path, what)
    if match.path != path:
        raise ScheduleError(
            what,
            [Problem(path, f"the match was found in {match.path!r}, not here", f"pass where={match.path!r}")],
        )
    region0, inputs0, outputs0 = nodes_of(gm, match, what)
    hooked = [
        Problem(
            join(path, str(n.target)),
            f"has hooks registered on the module object, which would no longer run once {what} folds its call "
            "into a new module",
            "register them with sf.hook(sch, path, mode, fn) instead (forward-pre and backward-post hooks move), "
            "or leave this module out of the matched subgraph",
        )
        for n in region0
        if n.op == "call_module" and has_hooks(resolve_attr(gm, str(n.target)))
    ]
    if hooked:
        raise ScheduleError(what, hooked)
    graph, env = copy_graph(gm.graph)
    region = [env[n] for n in region0]
    inputs = [env[n] for n in inputs0]
    outputs = [env[n] for n in outputs0]
    if inline_leaves:
        expanded: list[fx.Node] = []
        for node in region:
            if node.op == "call_module" and _owns_tensors(resolve_attr(gm, str(node.target))):
                module = resolve_attr(gm, str(node.target))
                was_output = node in outputs
                new_nodes, value = inline_module(graph, node, module, what, path)
                expanded.extend(new_nodes)
                if was_output:
                    outputs[outputs.index(node)] = value
            else:
                expanded.append(node)
        region = expanded
    region = [n for n in region if n.op != "get_attr"]
    if recompute_escaping:
        _recompute_escaping(graph, region, outputs, gm, what, path)
    inside = set(region)
    extra = [n for n in input_nodes(region, inside) if n not in inputs]
    all_inputs = [*inputs, *extra]
    escaping = [n for n in region if n not in outputs and any(u not in inside for u in n.users)]
    all_outputs = [*outputs, *escaping]
    if not region or not all_outputs:
        raise ScheduleError(what, [Problem(path, "the matched subgraph computes nothing", "match at least one op")])
    names = [*match.input_names[: len(inputs)], *(n.name for n in extra)]
    seen: set[str] = set()
    for i, n in enumerate(names):
        if n in seen or not n.isidentifier():
            names[i] = f"{n if n.isidentifier() else 'arg'}_{i}"
        seen.add(names[i])
    sub = region_graph(graph, region, all_inputs, all_outputs, names)
    targets = {str(n.target) for n in sub.nodes if n.op in ("call_module", "get_attr")}
    region_gm = fx.GraphModule({t: resolve_attr(gm, t) for t in targets}, sub, "Subgraph")
    region_gm.training = gm.training
    made = make(Outlined(region_gm, tuple(all_inputs), tuple(all_outputs), len(inputs)))
    if name is not None and (not name.isidentifier() or unique_name(gm, name) != name):
        raise ScheduleError(
            what, [Problem(join(path, name), f"{name!r} is taken or not an identifier", "choose another name=")]
        )
    target = name if name is not None else unique_name(gm, base_name)
    new_graph = contract(graph, inside, all_inputs, all_outputs, target, what, path)
    new_gm = rebuild(gm, new_graph, extra={target: made})
    if not inline_leaves:  # modules the subgraph called and nothing calls any more leave with it
        used = {split(str(n.target))[0] for n in new_graph.nodes if n.op in ("call_module", "get_attr")}
        called = {split(str(n.target))[0] for n in region0 if n.op == "call_module"}
        for gone in called - used:
            new_gm._modules.pop(gone, None)
    root = set_at(sch.module, path, new_gm)
    folded = [join(path, str(n.target)) for n in region0 if n.op == "call_module"]
    moved = move_hooks(sch, folded, join(path, target), what)
    return moved.with_module(root, replaced=(path,)), join(path, target)


_RANDOM = ("dropout", "rand", "bernoulli", "multinomial", "normal")


def _recompute_escaping(
    graph: fx.Graph, region: list[fx.Node], outputs: list[fx.Node], gm: fx.GraphModule, what: str, path: str
) -> None:
    """Give the outside readers of inner values of ``region`` copies of those values,
    computed outside it from the region's inputs (in place; ``graph`` is ours)."""
    inside = set(region)
    for node in region:
        readers = [u for u in node.users if u not in inside]
        if node in outputs or not readers:
            continue
        cone: set[fx.Node] = set()
        stack = [node]
        while stack:
            cur = stack.pop()
            if cur in inside and cur not in cone:
                cone.add(cur)
                stack.extend(cur.all_input_nodes)
        ordered = [n for n in region if n in cone]
        random = [n for n in ordered if any(r in op_name(n, gm).lower() for r in _RANDOM) or _is_dropout(n, gm)]
        if random:
            raise ScheduleError(
                what,
                [
                    Problem(
                        path,
                        f"the inner value {node.name!r} is also read outside the subgraph, and computing it again "
                        f"would draw new random numbers ({', '.join(n.name for n in random)})",
                        "match a pattern that returns it too, and return it from the replacement",
                    )
                ],
            )
        env: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(node):
            for inner in ordered:
                env[inner] = graph.node_copy(inner, lambda n, e=env: e.get(n, n))  # type: ignore[misc]
        for reader in readers:
            reader.replace_input_with(node, env[node])


def _is_dropout(node: fx.Node, gm: fx.GraphModule) -> bool:
    return node.op == "call_module" and isinstance(resolve_attr(gm, str(node.target)), nn.Dropout)
