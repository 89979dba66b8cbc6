"""``decompose``: a traced ``Linear`` (or GPT-2's ``Conv1D``) becomes a matmul without
bias, plus a bias add."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ...combinators import primitive
from ...errors import Problem, ScheduleError
from ...hf import is_conv1d
from ...schedule import Schedule
from ...select import Selection
from ...tree import get_module, join, set_at, split
from ._graph import copy_graph, has_hooks, rebuild

__all__ = ["decompose"]

_CALLED = ("hooks", "checkpoint", "compile")


def _decomposable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _owner(root: nn.Module, path: str) -> tuple[str, str] | None:
    """The nearest traced ancestor of ``path`` and ``path`` relative to it."""
    tokens = split(path)
    for i in range(len(tokens) - 1, -1, -1):
        if isinstance(get_module(root, ".".join(tokens[:i])), fx.GraphModule):
            return ".".join(tokens[:i]), ".".join(tokens[i:])
    return None


@primitive
def decompose(sch: Schedule, where: Selection) -> Schedule:
    """Split each selected ``nn.Linear`` of a traced module into ``F.linear(x, weight)``
    followed by ``+ bias``, so that the bias add can be matched and fused with what
    follows (``F.gelu(x + b)``, bias + dropout + residual…). Hugging Face's ``Conv1D``
    (GPT-2) becomes ``torch.matmul(x, weight) + bias`` the same way.

    ``where`` names Linear modules called from a traced ancestor's graph, or a traced
    module (then every Linear it calls). The Linear modules stay in the tree, holding
    their parameters under the same FQNs; they are no longer called, so one with hooks
    or checkpoint/compile annotations is refused. Returns a new schedule; the input is
    unchanged.

    Example:
        >>> import torch.nn as nn, slapo_fn as sf
        >>> sch = sf.trace(sf.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.ReLU())), "")
        >>> sch = sf.decompose(sch, "0")
        >>> [str(n.target) for n in sch.module.graph.nodes if n.op == "get_attr"]
        ['0.weight', '0.bias']
    """
    paths = where.modules(sch.module)
    todo: dict[str, set[str]] = {}
    problems: list[Problem] = []
    for path in paths:
        module = get_module(sch.module, path)
        if isinstance(module, fx.GraphModule):
            found = {
                str(n.target)
                for n in module.graph.nodes
                if n.op == "call_module" and _decomposable(get_module(module, str(n.target)))
            }
            if not found:
                problems.append(
                    Problem(path, "its graph calls no nn.Linear or Conv1D", "select a traced module with Linears")
                )
            todo.setdefault(path, set()).update(found)
            continue
        owner = _owner(sch.module, path)
        if not _decomposable(module) or owner is None:
            problems.append(
                Problem(
                    path,
                    f"is a {type(module).__name__}"
                    + ("" if owner else " with no traced ancestor")
                    + "; decompose splits an nn.Linear (or Conv1D) called from a traced graph",
                    "trace its parent first (sf.trace(sch, parent)) and select the Linear",
                )
            )
            continue
        todo.setdefault(owner[0], set()).add(owner[1])
    root = sch.module
    rewritten: list[tuple[str, fx.GraphModule]] = []
    for gpath, targets in todo.items():
        gm = get_module(root, gpath)
        assert isinstance(gm, fx.GraphModule)
        graph, _ = copy_graph(gm.graph)
        calls = {str(n.target): n for n in graph.nodes if n.op == "call_module"}
        for target in sorted(targets):
            full = join(gpath, target)
            linear = get_module(gm, target)
            node = calls.get(target)
            kinds = set(sch.annotations.get(full, {})) & set(_CALLED)
            if node is None:
                problems.append(Problem(full, f"is not called by the graph of {gpath!r}", "select a called Linear"))
            elif has_hooks(linear) or kinds:
                problems.append(
                    Problem(
                        full,
                        f"has {'hooks' if has_hooks(linear) else ', '.join(sorted(kinds))}, which need the module "
                        "to be called; decomposed, it would not be",
                        "decompose before adding them, or leave this Linear as it is",
                    )
                )
            elif len(node.args) != 1 or node.kwargs:
                problems.append(Problem(full, "is called with more than one input", "leave it as it is"))
            else:
                with graph.inserting_before(node):
                    weight = graph.get_attr(f"{target}.weight")
                    matmul = torch.matmul if is_conv1d(linear) else F.linear
                    out = graph.call_function(matmul, (node.args[0], weight))
                    if linear.bias is not None:
                        out = graph.call_function(operator.add, (out, graph.get_attr(f"{target}.bias")))
                out.meta = dict(node.meta)
                node.replace_all_uses_with(out)
                graph.erase_node(node)
        rewritten.append((gpath, rebuild(gm, graph)))
    if problems:
        raise ScheduleError("decompose", problems)
    for gpath, new in rewritten:
        root = set_at(root, gpath, new)
    return sch.with_module(root, replaced=tuple(p for p, _ in rewritten))
