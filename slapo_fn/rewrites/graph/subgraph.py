"""Partial ``replace`` and ``checkpoint``: act on a matched subgraph of a traced module."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ...errors import Problem, ScheduleError, ScheduleTypeError
from ...schedule import Key, Schedule
from ...tree import join
from .._common import INSTALLED, Installed
from ._graph import graph_module_at
from .find import Match, nodes_of, op_name
from .outline import Outlined, outline

__all__ = ["checkpoint_subgraph", "merge_matches", "replace_subgraph"]

T = TypeVar("T")


class FunctionModule(nn.Module):
    """A function as a module (a replacement given as a plain function)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn
        self.__signature__ = inspect.signature(fn)

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def _positional(fn: Callable[..., Any]) -> tuple[list[str], bool] | None:
    try:
        sig = getattr(fn, "__signature__", None) or inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in sig.parameters.values() if p.kind in kinds]
    return names, any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values())


def _meta(node: fx.Node) -> Any:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), val.dtype)
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return (tuple(tm.shape), tm.dtype)
    return None


def _check(path: str, match: Match, new: nn.Module, o: Outlined) -> list[Problem]:
    problems: list[Problem] = []
    forward = new.fn if isinstance(new, FunctionModule) else new.forward
    pos = _positional(forward)
    wanted = list(match.input_names)
    shown = f"({', '.join(wanted)})"
    if pos is not None:
        names, var = pos
        if not var and len(names) != len(wanted):
            problems.append(
                Problem(
                    path,
                    f"the replacement takes {len(names)} inputs ({', '.join(names)}), the subgraph has "
                    f"{len(wanted)} {shown}",
                    f"write it as forward{shown}",
                )
            )
        elif not var and set(names) == set(wanted) and names != wanted:
            problems.append(
                Problem(
                    path,
                    f"the replacement's inputs ({', '.join(names)}) are the subgraph's {shown} in another order; "
                    "they are passed in the subgraph's order",
                    f"reorder its parameters to forward{shown}",
                )
            )
    if o.declared_inputs != len(o.inputs):
        problems.append(Problem(path, "the subgraph reads values it does not declare", "match a larger pattern"))
    if problems:
        return problems
    metas = [_meta(n) for n in o.inputs]
    outs = [_meta(n) for n in o.outputs]
    if any(m is None for m in metas) or any(m is None for m in outs):
        return problems  # no shapes recorded (trace with example_inputs to check them)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            args = [mode.from_tensor(torch.empty(s, dtype=d)) for s, d in metas]  # type: ignore[misc]
            got = new(*args)
    except Exception as e:
        return [Problem(path, f"the replacement fails on the subgraph's inputs: {type(e).__name__}: {e}", "")]
    got_list = list(got) if isinstance(got, tuple | list) else [got]
    shapes = [(tuple(g.shape), g.dtype) if isinstance(g, torch.Tensor) else None for g in got_list]
    if shapes != outs:
        problems.append(
            Problem(
                path,
                f"the replacement returns {shapes}, the subgraph {outs}",
                "return the subgraph's outputs, in its order",
            )
        )
    return problems


def _cannot_fuse(path: str, reason: str) -> ScheduleError:
    return ScheduleError(
        "replace",
        [
            Problem(
                path,
                f"the matches cannot be replaced by one module: {reason}",
                "pass matches of independent subgraphs of one traced module, e.g. "
                "subgraph=sf.find(sch, path, r'[qkv]_proj')",
            )
        ],
    )


def merge_matches(sch: Schedule, path: str, matches: Sequence[Match]) -> Match:
    """Several matches of the traced module at ``path`` as one (horizontal fusion: q, k
    and v projections that read one input): its inputs are theirs, each once, in order;
    its outputs theirs, concatenated. Overlapping matches, matches from other modules,
    or one match reading another's values are a :class:`ScheduleError`."""
    if not matches:
        raise _cannot_fuse(path, "subgraph=[] lists no match")
    wrong = [type(m).__name__ for m in matches if not isinstance(m, Match)]
    if wrong:
        raise ScheduleTypeError(
            "replace", [Problem(path, f"expected Match values from sf.find, got {', '.join(wrong)}", "")]
        )
    if len(matches) == 1:
        return matches[0]
    elsewhere = sorted({m.path for m in matches if m.path != path})
    if elsewhere:
        raise _cannot_fuse(path, f"some were found in {', '.join(map(repr, elsewhere))}, not here")
    gm = graph_module_at(sch.module, path, "replace")
    regions = [set(nodes_of(gm, m, "replace")[0]) for m in matches]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for i, a in enumerate(regions):
        upstream = _ancestors(a)
        for j, b in enumerate(regions):
            if i == j:
                continue
            if i < j and a & b:
                shared = ", ".join(sorted(n.name for n in a & b))
                raise _cannot_fuse(path, f"matches {i} and {j} share nodes ({shared})")
            if upstream & b:
                raise _cannot_fuse(
                    path, f"match {i} reads values of match {j}, so one module cannot compute both side by side"
                )
    nodes = sorted(set().union(*regions), key=order.__getitem__)
    inputs: dict[str, str] = {}
    for m in matches:
        for node, name in zip(m.inputs, m.input_names, strict=False):
            inputs.setdefault(node, name)
    return Match(
        path=path,
        nodes=tuple(n.name for n in nodes),
        ops=tuple(join(path, str(n.target)) if n.op == "call_module" else op_name(n, gm) for n in nodes),
        inputs=tuple(inputs),
        input_names=tuple(inputs.values()),
        outputs=tuple(o for m in matches for o in m.outputs),
        signature=tuple((n.op, str(n.target)) for n in nodes),
        escaping=tuple(e for m in matches for e in m.escaping),
    )


def _ancestors(region: set[fx.Node]) -> set[fx.Node]:
    """Every node that ``region`` reads, directly or not (outside it)."""
    seen: set[fx.Node] = set()
    stack = [a for n in region for a in n.all_input_nodes if a not in region]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def replace_subgraph(
    sch: Schedule, path: str, new: nn.Module | Callable[..., Any], match: Match | Sequence[Match]
) -> Schedule:
    """``replace(sch, path, new, subgraph=match)``: see :func:`slapo_fn.replace`. A list
    of matches is replaced by one module returning all their outputs, as a tuple."""
    one = match if isinstance(match, Match) else merge_matches(sch, path, match)
    if isinstance(new, nn.Module):
        module = new
    elif callable(new):
        module = FunctionModule(new)
    else:
        raise ScheduleTypeError(
            "replace",
            [Problem(path, f"the replacement must be a module or a function, got {type(new).__name__}", "")],
        )
    problems: list[Problem] = []

    def make(o: Outlined) -> nn.Module:
        problems.extend(_check(path, one, module, o))
        return module

    result, new_path = outline(sch, path, one, "replace", "replaced", make, inline_leaves=False,
                               recompute_escaping=True)
    if problems:
        raise ScheduleError("replace", problems)
    replaced = f"a subgraph of {len(one.ops)} op{'s' if len(one.ops) > 1 else ''} ({', '.join(one.ops[:4])}" \
        f"{', …' if len(one.ops) > 4 else ''})"
    return result.annotate_path(new_path, INSTALLED, Installed(type(module).__name__, replaced))


def checkpoint_subgraph(sch: Schedule, path: str, match: Match, key: Key[T], spec: T) -> Schedule:
    """``checkpoint(sch, path, subgraph=match)``: the subgraph becomes a module, checkpointed."""
    result, new_path = outline(sch, path, match, "checkpoint", "checkpointed", lambda o: o.region)
    return result.annotate_path(new_path, key, spec)
