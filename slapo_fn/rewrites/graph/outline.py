"""Outlining: a matched subgraph becomes one module called from the traced graph."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from ...errors import Problem, ScheduleError
from ...schedule import Schedule
from ...tree import join, set_at, split
from ._graph import (
    contract,
    copy_graph,
    graph_module_at,
    inline_module,
    input_nodes,
    rebuild,
    region_graph,
    resolve_attr,
    unique_name,
)
from .find import Match, nodes_of

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
) -> tuple[Schedule, str]:
    """A new schedule in which ``match`` (in the traced module at ``path``) is one
    ``call_module`` of ``make(outlined)``, registered under ``name`` (default
    ``base_name``, made unique); returns it and the new module's path.

    With ``inline_leaves``, modules with parameters called inside the subgraph are
    inlined first, so the new module holds no parameters and every FQN is kept.
    """
    gm = graph_module_at(sch.module, path, what)
    if match.path != path:
        raise ScheduleError(
            what,
            [Problem(path, f"the match was found in {match.path!r}, not here", f"pass where={match.path!r}")],
        )
    region0, inputs0, outputs0 = nodes_of(gm, match, what)
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
    return sch.with_module(root, replaced=(path,)), join(path, target)
