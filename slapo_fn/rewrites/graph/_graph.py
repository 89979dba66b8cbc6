"""Graph mechanics shared by the graph primitives (no public API here).

* :func:`rebuild` makes a *new* ``GraphModule`` from a graph and the module it came
  from, keeping parameter FQNs, the original child objects, hooks, ``training`` and
  plain attributes; nothing it is given is mutated.
* :func:`copy_graph` copies a graph and returns the node map.
* :func:`contract` replaces a convex set of nodes by one ``call_module``.
* :func:`inline_module` splices a module's traced graph in place of its ``call_module``.
"""

from __future__ import annotations

import heapq
import inspect
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import Argument, map_arg

from ...errors import Problem, ScheduleError
from ...tree import get_module, split

__all__ = [
    "HOOK_ATTRS",
    "contract",
    "copy_graph",
    "graph_module_at",
    "has_hooks",
    "inline_module",
    "input_nodes",
    "rebuild",
    "resolve_attr",
    "unique_name",
]

#: ``nn.Module`` attributes that hold hooks, carried over to a traced module.
HOOK_ATTRS = tuple(name for name, value in vars(nn.Module()).items() if "hook" in name and isinstance(value, dict))


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has Python forward/backward hooks of its own."""
    return any(getattr(module, name, None) for name in HOOK_ATTRS if "forward" in name or "backward" in name)


def resolve_attr(root: nn.Module, target: str) -> Any:
    """The object a ``get_attr``/``call_module`` target names under ``root``."""
    *prefix, last = split(target)
    owner = get_module(root, ".".join(prefix))
    if last in owner._modules:
        return owner._modules[last]
    if last in owner._parameters:
        return owner._parameters[last]
    if last in owner._buffers:
        return owner._buffers[last]
    return getattr(owner, last)


def graph_module_at(root: nn.Module, path: str, what: str) -> fx.GraphModule:
    """The traced module at ``path``, or a :class:`ScheduleError` saying to trace it."""
    module = get_module(root, path)
    if not isinstance(module, fx.GraphModule):
        raise ScheduleError(
            what,
            [
                Problem(
                    path,
                    f"is a {type(module).__name__}, not a traced module (GraphModule)",
                    f"trace it first: sch = sf.trace(sch, {path!r})",
                )
            ],
        )
    return module


def copy_graph(graph: fx.Graph) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """A copy of ``graph`` (same node names, codegen and meta) and ``old -> new`` nodes."""
    new = fx.Graph(tracer_cls=graph._tracer_cls)
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "output":
            out = new.output(map_arg(node.args[0], lambda n: env[n]), type_expr=node.type)
            out.meta = dict(node.meta)
            env[node] = out
        else:
            env[node] = new.node_copy(node, lambda n: env[n])
    new._codegen = graph._codegen
    return new, env


def unique_name(module: nn.Module, base: str) -> str:
    """``base`` or ``base_1``, ``base_2``… whichever is not an attribute of ``module``."""
    name, i = base, 0
    while name in module._modules or name in module._parameters or name in module._buffers or hasattr(module, name):
        i += 1
        name = f"{base}_{i}"
    return name


def _ordered(items: Mapping[str, Any], order: Sequence[str]) -> dict[str, Any]:
    rank = {name: i for i, name in enumerate(order)}
    return dict(sorted(items.items(), key=lambda kv: rank.get(kv[0], len(rank))))


def rebuild(
    like: nn.Module,
    graph: fx.Graph,
    *,
    extra: Mapping[str, Any] | None = None,
    share_children: bool = True,
    keep_unused: bool = True,
    class_name: str | None = None,
) -> fx.GraphModule:
    """A new ``GraphModule`` running ``graph`` whose attributes come from ``like``.

    ``extra`` supplies targets that ``like`` does not have (a new fused module). With
    ``share_children`` the children of ``like`` that the graph reaches into are the same
    objects (so FQNs and identities are kept); with ``keep_unused`` children, parameters
    and buffers the graph does not use stay too. Hooks, ``training`` and plain public
    attributes of ``like`` are carried over; ``like`` is not modified.
    """
    extra = dict(extra or {})
    targets = {str(n.target) for n in graph.nodes if n.op in ("get_attr", "call_module")}
    root = {t: extra[t] if t in extra else resolve_attr(like, t) for t in targets}
    gm = fx.GraphModule(root, graph, class_name or type(like).__name__)
    firsts = {split(t)[0] for t in targets if t not in extra}
    if share_children:
        for first in firsts:
            if first in like._modules:
                gm._modules[first] = like._modules[first]
    if keep_unused:
        for name, child in like._modules.items():
            gm._modules.setdefault(name, child)
        for name, param in like._parameters.items():
            gm._parameters.setdefault(name, param)
        for name, buf in like._buffers.items():
            gm._buffers.setdefault(name, buf)
    for name in like._non_persistent_buffers_set:
        if name in gm._buffers:
            gm._non_persistent_buffers_set.add(name)
    # A buffer the graph reads by ``get_attr`` is registered as a buffer even when the
    # original held a plain tensor attribute: keep what the original had.
    for target in targets:  # (a constant that torch.export lifted out, e.g. ``lifted_tensor_0``)
        if "." not in target and target in gm._buffers and target not in like._buffers and target not in extra:
            gm._non_persistent_buffers_set.add(target)
    gm._modules = _ordered(gm._modules, list(like._modules))  # type: ignore[assignment]
    gm._parameters = _ordered(gm._parameters, list(like._parameters))  # type: ignore[assignment]
    gm._buffers = _ordered(gm._buffers, list(like._buffers))  # type: ignore[assignment]
    gm.training = like.training
    for name in HOOK_ATTRS:
        value = getattr(like, name, None)
        if isinstance(value, dict):
            setattr(gm, name, type(value)(value))
    for key, value in like.__dict__.items():
        if key in gm.__dict__ or key.startswith("__") or key in ("forward",):
            continue
        if key.startswith("_") and key not in ("_slapo_inputs",):
            continue
        if isinstance(value, nn.Module | torch.Tensor):
            continue
        gm.__dict__[key] = value
    return gm


def input_nodes(nodes: Iterable[fx.Node], inside: set[fx.Node]) -> list[fx.Node]:
    """Nodes outside ``inside`` that ``nodes`` read, in first-use order."""
    seen: dict[fx.Node, None] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside:
                seen.setdefault(arg, None)
    return list(seen)


def contract(
    graph: fx.Graph,
    region: set[fx.Node],
    inputs: Sequence[fx.Node],
    outputs: Sequence[fx.Node],
    target: str,
    what: str,
    path: str,
) -> fx.Graph:
    """A new graph in which the nodes of ``region`` are one ``call_module(target)``.

    The call takes ``inputs`` and returns ``outputs`` (one value, or a tuple read by
    ``getitem``). Nodes keep their relative order where dependencies allow. A region
    that is not convex (a path leaves it and comes back) is a :class:`ScheduleError`.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = min(region, key=order.__getitem__)
    # dependencies of each emitted unit (a node, or the region as ``anchor``)
    unit: dict[fx.Node, fx.Node] = {n: (anchor if n in region else n) for n in graph.nodes}
    deps: dict[fx.Node, set[fx.Node]] = {}
    for node in graph.nodes:
        u = unit[node]
        srcs = list(inputs) if node is anchor else node.all_input_nodes
        if node in region and node is not anchor:
            continue
        deps.setdefault(u, set()).update(unit[s] for s in srcs if unit[s] is not u)
    users: dict[fx.Node, set[fx.Node]] = {u: set() for u in deps}
    for u, ds in deps.items():
        for d in ds:
            users[d].add(u)
    pending = {u: len(ds) for u, ds in deps.items()}
    ready = [(order[u], u.name) for u, c in pending.items() if c == 0]
    by_name = {u.name: u for u in deps}
    heapq.heapify(ready)
    emitted: list[fx.Node] = []
    while ready:
        _, name = heapq.heappop(ready)
        u = by_name[name]
        emitted.append(u)
        for v in users[u]:
            pending[v] -= 1
            if pending[v] == 0:
                heapq.heappush(ready, (order[v], v.name))
    if len(emitted) != len(deps):
        raise ScheduleError(
            what,
            [
                Problem(
                    path,
                    "the matched subgraph is not convex: a value leaves it and flows back into it "
                    f"through nodes outside it ({', '.join(sorted(n.name for n in region))})",
                    "match a larger pattern that includes the nodes in between",
                )
            ],
        )
    new = fx.Graph(tracer_cls=graph._tracer_cls)
    new._codegen = graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    for u in emitted:
        if u is anchor:
            call = new.call_module(target, tuple(env[i] for i in inputs))
            call.name = target.replace(".", "_")
            if len(outputs) == 1:
                env[outputs[0]] = call
            else:
                for k, out in enumerate(outputs):
                    env[out] = new.call_function(operator.getitem, (call, k))
                    env[out].meta = dict(out.meta)
        elif u.op == "output":
            new.output(map_arg(u.args[0], lambda n: env[n]), type_expr=u.type)
        else:
            env[u] = new.node_copy(u, lambda n: env[n])
    return new


def region_graph(
    graph: fx.Graph,
    region: Sequence[fx.Node],
    inputs: Sequence[fx.Node],
    outputs: Sequence[fx.Node],
    names: Sequence[str] | None = None,
) -> fx.Graph:
    """The nodes of ``region`` as a graph of their own: ``inputs`` become placeholders
    (named ``names``), ``outputs`` its return value (a tuple if several)."""
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(inputs):
        name = names[i] if names is not None else node.name
        env[node] = sub.placeholder(name)
        env[node].meta = dict(node.meta)
    for node in region:
        env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    return sub


class _InlineTracer(fx.Tracer):
    """Trace a module through, stopping only at modules with no parameters or buffers."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        own = next(iter(m.parameters()), None) is None and next(iter(m.buffers()), None) is None
        return module_qualified_name != "" and own and super().is_leaf_module(m, module_qualified_name)


def inline_module(
    graph: fx.Graph, node: fx.Node, module: nn.Module, what: str, path: str
) -> tuple[list[fx.Node], fx.Node]:
    """Replace ``call_module`` ``node`` by the traced body of ``module`` (in place on
    ``graph``, which must be a private copy); return the new nodes in order and the one
    that stands for the call's value.

    The body's ``get_attr``/``call_module`` targets are prefixed with the node's target,
    so they name the same parameters (same FQNs) under the owner.
    """
    if has_hooks(module):
        raise ScheduleError(
            what,
            [
                Problem(
                    path,
                    f"module {node.target!r} has hooks, which would no longer run once its body is inlined",
                    "remove the hooks, or leave this module out of the matched subgraph",
                )
            ],
        )
    try:
        body = _InlineTracer().trace(module)
    except Exception as e:  # the tracer's own reason is the message
        raise ScheduleError(
            what,
            [Problem(path, f"cannot inline {node.target!r}: {type(e).__name__}: {e}", "keep it out of the subgraph")],
        ) from None
    placeholders = [n for n in body.nodes if n.op == "placeholder"]
    sig = inspect.signature(module.forward)
    bound = sig.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    env: dict[fx.Node, Argument] = {}
    for ph in placeholders:
        env[ph] = bound.arguments.get(str(ph.target), ph.args[0] if ph.args else None)
    new_nodes: list[fx.Node] = []
    result: Argument = None
    with graph.inserting_before(node):
        for b in body.nodes:
            if b.op == "placeholder":
                continue
            if b.op == "output":
                result = map_arg(b.args[0], lambda n: env[n])  # type: ignore[arg-type,return-value]
                break
            copied = graph.node_copy(b, lambda n: env[n])  # type: ignore[arg-type,return-value]
            if b.op in ("get_attr", "call_module"):
                copied.target = f"{node.target}.{b.target}"
            env[b] = copied
            new_nodes.append(copied)
    if not isinstance(result, fx.Node):
        raise ScheduleError(
            what, [Problem(path, f"module {node.target!r} does not return one tensor", "keep it out of the subgraph")]
        )
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    return new_nodes, result
