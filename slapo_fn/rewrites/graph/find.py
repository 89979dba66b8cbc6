"""``find``: a query for subgraphs of a traced module, returning :class:`Match` values.

A pattern is one of

* a **regex** (``str``) matched in full against ``call_module`` targets
  (``r"[qkv]_proj"``);
* a **function or ``nn.Module``** describing a subgraph; it is traced with
  ``torch.fx`` and matched structurally (diamonds, trees, several inputs). Operators
  are compared by name across their spellings: ``x + y``, ``torch.add``,
  ``aten.add.Tensor`` and ``Tensor.add`` are one op, and a functional call matches the
  module that computes it (``F.relu`` matches ``nn.ReLU``). Literal arguments are not
  compared. Inside a pattern, :func:`call_module` stands for a ``call_module`` whose
  target matches a regex;
* a **node predicate**: a function of one parameter named ``node`` (or annotated
  ``torch.fx.Node``), true for the nodes to return, one match each.

Matches come in graph order (so horizontal matches like q, k, v come in call order).
"""

from __future__ import annotations

import difflib
import inspect
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

from ...errors import Problem, ScheduleError, ScheduleTypeError
from ...schedule import Schedule
from ...select import Where, select
from ...tree import get_module, join
from ._graph import graph_module_at

__all__ = ["Match", "Pattern", "call_module", "find", "nodes_of"]

Pattern: TypeAlias = "str | Callable[..., Any] | nn.Module"


@dataclass(frozen=True)
class Match:
    """A matched subgraph of the traced module at ``path``, as a value.

    ``nodes`` are node names in topological order and ``ops`` what each computes (the
    FQN of a called module, else the op's name). ``inputs`` are the names of the nodes
    the subgraph reads, in the order of the pattern's parameters (``input_names``);
    ``outputs`` the nodes whose values leave it, in the pattern's return order.
    ``signature`` pins each node's op and target, so a match that no longer fits the
    graph (it changed since ``find``) is refused rather than misapplied. ``escaping``
    names inner nodes whose values are also read outside the match: ``fuse`` returns
    them as extra outputs, ``replace`` recomputes them outside, so they stay available.
    """

    path: str
    nodes: tuple[str, ...]
    ops: tuple[str, ...]
    inputs: tuple[str, ...]
    input_names: tuple[str, ...]
    outputs: tuple[str, ...]
    signature: tuple[tuple[str, str], ...]
    escaping: tuple[str, ...] = ()

    @property
    def modules(self) -> tuple[str, ...]:
        """FQNs of the modules the subgraph calls."""
        return tuple(op for op, (kind, _) in zip(self.ops, self.signature) if kind == "call_module")

    def __len__(self) -> int:
        return len(self.nodes)

    def __str__(self) -> str:
        return f"Match({self.path!r}: {' -> '.join(self.ops)})"


# -- call_module inside patterns ------------------------------------------------------
def call_module(regex: str, *args: Any, **kwargs: Any) -> Any:
    """In a pattern function: a call of any module whose target matches ``regex``.

    >>> import torch.nn.functional as F
    >>> pattern = lambda x: F.relu(call_module(r"fc[12]", x))
    """
    for value in (*args, *kwargs.values()):
        if isinstance(value, fx.Proxy):
            return value.tracer.create_proxy("call_function", call_module, (regex, *args), kwargs)
    raise TypeError("call_module(regex, ...) only describes a pattern; use it inside a function given to find")


# -- op names -------------------------------------------------------------------------
_ALIASES = {
    "truediv": "div",
    "iadd": "add",
    "isub": "sub",
    "imul": "mul",
    "itruediv": "div",
    "mm": "matmul",
    "bmm": "matmul",
    "t": "transpose",
    "neg": "neg",
}

_MODULE_OPS: dict[type, str] = {
    nn.ReLU: "relu",
    nn.GELU: "gelu",
    nn.SiLU: "silu",
    nn.Tanh: "tanh",
    nn.Sigmoid: "sigmoid",
    nn.Dropout: "dropout",
    nn.LayerNorm: "layer_norm",
    nn.Linear: "linear",
    nn.Softmax: "softmax",
    nn.Embedding: "embedding",
}


def _norm(name: str) -> str:
    name = name.strip("_")
    return _ALIASES.get(name, name)


def op_name(node: fx.Node, root: nn.Module) -> str:
    """What ``node`` computes: a module's FQN (relative), else its op name."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target)
    if node.op == "call_method":
        return _norm(str(node.target))
    target = node.target
    if target is call_module:
        return f"call_module({node.args[0]!r})"
    if isinstance(target, torch._ops.OpOverload):
        return _norm(target.overloadpacket.__name__)
    return _norm(getattr(target, "__name__", str(target)))


@dataclass(frozen=True, eq=False)
class _ModuleKey:
    path: str
    cls: type
    op: str | None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _ModuleKey):
            return self.cls is other.cls or (self.op is not None and self.op == other.op)
        if isinstance(other, str):
            return self.op == other
        if isinstance(other, _Regex):
            return other == self
        return NotImplemented

    __hash__ = object.__hash__


@dataclass(frozen=True, eq=False)
class _Regex:
    regex: str

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _ModuleKey):
            return re.fullmatch(self.regex, other.path) is not None
        return False

    __hash__ = object.__hash__


def _key(node: fx.Node, root: nn.Module) -> object:
    if node.op == "call_module":
        module = get_module(root, str(node.target))
        op = next((name for cls, name in _MODULE_OPS.items() if type(module) is cls), None)
        return _ModuleKey(str(node.target), type(module), op)
    if node.op == "call_function" and node.target is call_module:
        return _Regex(str(node.args[0]))
    return op_name(node, root)


def _inputs(node: fx.Node) -> tuple[fx.Node, ...]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args[1:] if node.target is call_module else node.args, node.kwargs), found.append)
    return tuple(found)


def _canonical(graph: fx.Graph, root: nn.Module, *, pattern: bool) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """A copy of ``graph`` in which every call is ``call_function(key, *node_inputs)``;
    returns it and ``copy -> original``."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    back: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "placeholder" or (pattern and node.op == "get_attr"):
            copied = new.placeholder(node.name)
        elif node.op == "get_attr":
            copied = new.get_attr(str(node.target))
        elif node.op == "output":
            copied = new.output(fx.node.map_arg(node.args[0], lambda n: env[n]))
        else:
            copied = new.create_node(
                "call_function", operator.add, tuple(env[i] for i in _inputs(node)), {}, name=node.name
            )
            copied.target = _key(node, root)  # type: ignore[assignment]
        env[node] = copied
        back[copied] = node
    return new, back


# -- find -----------------------------------------------------------------------------
def _is_predicate(fn: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and (params[0].name == "node" or params[0].annotation in (fx.Node, "fx.Node", "Node"))


def _signature(nodes: list[fx.Node]) -> tuple[tuple[str, str], ...]:
    return tuple((n.op, str(n.target)) for n in nodes)


def _single(path: str, gm: fx.GraphModule, node: fx.Node) -> Match:
    inputs = [n for n in node.all_input_nodes]
    return Match(
        path=path,
        nodes=(node.name,),
        ops=(join(path, str(node.target)) if node.op == "call_module" else op_name(node, gm),),
        inputs=tuple(n.name for n in inputs),
        input_names=tuple(n.name for n in inputs),
        outputs=(node.name,),
        signature=_signature([node]),
    )


def _trace_pattern(pattern: Callable[..., Any] | nn.Module, path: str) -> tuple[fx.Graph, nn.Module]:
    try:
        traced = fx.symbolic_trace(pattern)
    except Exception as e:
        raise ScheduleError(
            "find",
            [Problem(path, f"the pattern cannot be traced by torch.fx: {type(e).__name__}: {e}", "simplify it")],
        ) from None
    return traced.graph, traced


class _EscapingMatcher(SubgraphMatcher):
    """torch.fx's matcher, also accepting matches whose inner values are read outside
    them (a diamond whose middle value escapes): the outliner returns or recomputes them."""

    def _is_contained(self, nodes_map: dict[fx.Node, fx.Node]) -> bool:
        return True


def _convex(region: set[fx.Node], order: dict[fx.Node, int]) -> bool:
    """Whether no path leaves ``region`` and comes back into it."""
    last = max(order[n] for n in region)
    stack = [u for n in region for u in n.users if u not in region and order[u] < last]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user in region:
                return False
            if order[user] < last:
                stack.append(user)
    return True


def _matcher(pattern: fx.Graph) -> SubgraphMatcher:
    return _EscapingMatcher(pattern, match_output=False, match_placeholder=False, remove_overlapping_matches=True)


def _structural(path: str, gm: fx.GraphModule, pattern: Callable[..., Any] | nn.Module) -> list[Match]:
    canon_p, canon_g, back = _canonical_pair(path, gm, pattern)
    names = [n.name for n in canon_p.nodes if n.op == "placeholder"]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    matches: list[Match] = []
    for m in _matcher(canon_p).match(canon_g):
        inner = [back[gn] for pn, gn in m.nodes_map.items() if pn.op == "call_function"]
        inner.sort(key=order.__getitem__)
        inputs = [back[n] for n in m.placeholder_nodes]
        outputs = [back[n] for n in m.returning_nodes]
        inside = set(inner)
        if not _convex(inside, order):
            continue  # an escaping value flows back in: not one subgraph
        escaping = [n for n in inner if n not in outputs and any(u not in inside for u in n.users)]
        matches.append(
            Match(
                path=path,
                nodes=tuple(n.name for n in inner),
                ops=tuple(join(path, str(n.target)) if n.op == "call_module" else op_name(n, gm) for n in inner),
                inputs=tuple(n.name for n in inputs),
                input_names=tuple(names),
                outputs=tuple(n.name for n in outputs),
                signature=_signature(inner),
                escaping=tuple(n.name for n in escaping),
            )
        )
    first = {n.name: order[n] for n in gm.graph.nodes}
    return sorted(matches, key=lambda m: (min(first[n] for n in m.nodes), m.nodes))


def _canonical_pair(
    path: str, gm: fx.GraphModule, pattern: Callable[..., Any] | nn.Module
) -> tuple[fx.Graph, fx.Graph, dict[fx.Node, fx.Node]]:
    """The canonical pattern graph, the canonical graph of ``gm`` and ``copy -> node``."""
    pgraph, proot = _trace_pattern(pattern, path)
    canon_p, _ = _canonical(pgraph, proot, pattern=True)
    if not any(n.op == "call_function" for n in canon_p.nodes):
        raise ScheduleError("find", [Problem(path, "the pattern computes nothing", "describe at least one op")])
    canon_g, back = _canonical(gm.graph, gm, pattern=False)
    return canon_p, canon_g, back


def _key_names(key: object) -> list[str]:
    """How a canonical node's key reads to a user (an op name, a module path…)."""
    if isinstance(key, _ModuleKey):
        return [n for n in (key.op, key.path, key.cls.__name__) if n]
    if isinstance(key, _Regex):
        return [f"call_module({key.regex!r})"]
    return [str(key)]


def _graph_ops(gm: fx.GraphModule) -> tuple[list[str], list[str]]:
    """The op names and the module targets called in ``gm``'s graph, each once, in order."""
    ops: dict[str, None] = {}
    modules: dict[str, None] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            modules.setdefault(str(node.target), None)
            key = _key(node, gm)
            if isinstance(key, _ModuleKey) and key.op:
                ops.setdefault(key.op, None)
        elif node.op in ("call_function", "call_method"):
            ops.setdefault(op_name(node, gm), None)
    return list(ops), list(modules)


def _shown(names: list[str], limit: int = 12) -> str:
    more = f" … ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _split_reuses(pattern: fx.Graph) -> fx.Graph | None:
    """A copy of the canonical ``pattern`` in which every extra use of a parameter read
    more than once reads a new parameter of its own; ``None`` if none is reused."""
    graph = _copy(pattern)
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    changed = False
    for ph in [n for n in graph.nodes if n.op == "placeholder"]:
        uses = [(user, i) for user in list(ph.users) for i, a in enumerate(user.args) if a is ph]
        for user, i in uses[1:]:
            with graph.inserting_before(first_op):
                fresh = graph.placeholder(f"{ph.name}_use{i}")
            args = list(user.args)
            args[i] = fresh
            user.args = tuple(args)
            changed = True
    return graph if changed else None


def _copy(graph: fx.Graph) -> fx.Graph:
    """A copy of a canonical graph (whose call targets are keys, not callables)."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "call_function":
            args = fx.node.map_arg(node.args, lambda n: env[n])
            env[node] = new.create_node("call_function", operator.add, args, {}, name=node.name)  # type: ignore[arg-type]
            env[node].target = node.target
        else:
            env[node] = new.node_copy(node, lambda n: env[n])
    return new


def _no_match(path: str, gm: fx.GraphModule, pattern: Pattern) -> Problem:
    """Why ``pattern`` matches nothing in ``gm``: what the graph has, nearest to it."""
    ops, modules = _graph_ops(gm)
    has = f"the graph calls modules [{_shown(modules)}] and ops [{_shown(ops)}]"
    if isinstance(pattern, str):
        near = difflib.get_close_matches(pattern, modules, n=3, cutoff=0.5)
        near_ops = difflib.get_close_matches(_norm(pattern), ops, n=3, cutoff=0.5)
        reason = f"no module call's target matches the regex {pattern!r}"
        fix = f"nearest module targets: {', '.join(near)}" if near else has
        if near_ops and not near:
            fix = f"nearest ops: {', '.join(near_ops)}; describe an op with a pattern function (lambda x: F.relu(x))"
        if pattern in ops or _norm(pattern) in ops:
            reason += f"; {pattern!r} is an op of the graph, not a module target"
            fix = f"describe the op with a pattern function, e.g. sf.find(sch, {path!r}, lambda x: F.{pattern}(x))"
        return Problem(path, f"{reason} ({has})", fix)
    if not isinstance(pattern, nn.Module) and _is_predicate(pattern):
        return Problem(path, f"the node predicate is true for no node ({has})", "check the predicate")
    canon_p, canon_g, _ = _canonical_pair(path, gm, pattern)
    missing: list[str] = []
    for node in canon_p.nodes:
        if node.op != "call_function":
            continue
        names = _key_names(node.target)
        if not any(n in ops or n in modules for n in names) and not any(
            node.target == g.target for g in canon_g.nodes if g.op == "call_function"
        ):
            probe = node.target.regex if isinstance(node.target, _Regex) else names[0]
            near = difflib.get_close_matches(probe, ops + modules, n=3, cutoff=0.5)
            label = names[0] if isinstance(node.target, _Regex) else repr(names[0])
            missing.append(label + (f" (nearest: {', '.join(near)})" if near else ""))
    if missing:
        reason = f"the pattern's op(s) {', '.join(missing)} are not in the graph ({has})"
    else:
        reason = f"the pattern's ops are all in the graph, but not connected as in the pattern ({has})"
    split = _split_reuses(canon_p)
    if split is not None and _matcher(split).match(canon_g):
        reason += (
            "; the pattern reads one parameter in several places, and the graph has the shape of the pattern "
            "where those places read different values"
        )
        return Problem(path, reason, "give each use its own parameter, e.g. lambda x, y: F.relu(x) + y")
    return Problem(path, reason, "print(sch[path].module.graph) to see the graph, and write the pattern from it")


def find(sch: Schedule, where: Where, pattern: Pattern, *, allow_empty: bool = False) -> list[Match]:
    """Subgraphs of the traced module(s) at ``where`` that match ``pattern``.

    A query: nothing is rewritten. See the module docstring for the pattern forms.
    Matches are frozen values, in graph order; pass one to :func:`fuse`, or as
    ``subgraph=`` to ``replace`` / ``checkpoint``. The module must be traced first.
    A match may have inner values that are also read outside it (``Match.escaping``).
    No match at all is a :class:`ScheduleError` saying what the graph contains (its
    modules and ops, the nearest to the pattern's, and whether the pattern reuses a
    parameter where the graph reads different values); ``allow_empty=True`` returns
    ``[]`` instead.

    Example:
        >>> import torch, torch.nn as nn, torch.nn.functional as F, slapo_fn as sf
        >>> class Res(nn.Module):
        ...     def forward(self, x):
        ...         return F.relu(x) + x
        >>> sch = sf.trace(sf.create_schedule(nn.Sequential(Res())), "0")
        >>> [m.ops for m in sf.find(sch, "0", lambda x: F.relu(x) + x)]
        [('relu', 'add')]
        >>> [m.ops for m in sf.find(sch, "0", lambda node: node.op == "call_function")]
        [('relu',), ('add',)]
    """
    if not isinstance(sch, Schedule):
        raise ScheduleTypeError("find", [Problem("", f"expected a Schedule, got {type(sch).__name__}", "")])
    paths = select(where).modules(sch.module)
    results: list[Match] = []
    searched: list[tuple[str, fx.GraphModule]] = []
    for path in paths:
        gm = graph_module_at(sch.module, path, "find")
        searched.append((path, gm))
        if isinstance(pattern, str):
            try:
                regex = re.compile(pattern)
            except re.error as e:
                raise ScheduleError("find", [Problem(path, f"bad regex {pattern!r}: {e}", "")]) from None
            results += [
                _single(path, gm, n) for n in gm.graph.nodes if n.op == "call_module" and regex.fullmatch(str(n.target))
            ]
        elif isinstance(pattern, nn.Module) or (callable(pattern) and not _is_predicate(pattern)):
            results += _structural(path, gm, pattern)
        elif callable(pattern):
            results += [
                _single(path, gm, n) for n in gm.graph.nodes if n.op not in ("placeholder", "output") and pattern(n)
            ]
        else:
            raise ScheduleTypeError(
                "find",
                [
                    Problem(
                        path,
                        "a pattern is a regex, a function / nn.Module, or fn(node) -> bool; "
                        f"got {type(pattern).__name__}",
                        "e.g. sf.find(sch, path, lambda x, b: F.gelu(x + b))",
                    )
                ],
            )
    if not results and not allow_empty:
        raise ScheduleError("find", [_no_match(path, gm, pattern) for path, gm in searched])
    return results


def nodes_of(gm: fx.GraphModule, match: Match, what: str) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node]]:
    """The (region, inputs, outputs) nodes of ``match`` in ``gm``'s graph; a match that no
    longer fits the graph is a :class:`ScheduleError`."""
    if not isinstance(match, Match):
        raise ScheduleTypeError(
            what,
            [Problem(getattr(match, "path", ""), f"expected a Match from sf.find, got {type(match).__name__}", "")],
        )
    by_name = {n.name: n for n in gm.graph.nodes}
    missing = [n for n in (*match.nodes, *match.inputs, *match.outputs) if n not in by_name]
    region = [by_name[n] for n in match.nodes if n in by_name]
    if missing or _signature(region) != match.signature:
        raise ScheduleError(
            what,
            [
                Problem(
                    match.path,
                    "the match no longer fits the graph (it was found on another version of this module)",
                    f"find it again on the current schedule: sf.find(sch, {match.path!r}, pattern)",
                )
            ],
        )
    return region, [by_name[n] for n in match.inputs], [by_name[n] for n in match.outputs]
