"""``decompose``: a traced ``Linear`` (or GPT-2's ``Conv1D``) becomes its matmul without
bias, still called, plus a bias add in its parent's graph; in a graph of ``torch.fx`` or
of ``torch.export`` (whose unflattened modules are ``InterpreterModule``s, and whose
Linears are modules of their own, or their code inlined by ``trace(flatten=True)``)."""

from __future__ import annotations

import functools
import operator
from typing import cast

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from ...combinators import primitive
from ...errors import Problem, ScheduleError
from ...hf import is_conv1d
from ...schedule import Schedule
from ...select import Selection
from ...tree import get_module, join, set_at, split
from ._graph import copy_graph, has_hooks, rebuild

__all__ = ["SeparateBias", "SeparateBiasLinear", "decompose", "separate_bias"]

_CALLED = ("hooks", "checkpoint", "compile")


class SeparateBias(nn.Module):
    """A linear layer whose forward is its matmul alone: the caller adds :attr:`bias` (what
    :func:`decompose` leaves of a called Linear or ``Conv1D``). Mixed into the layer's own
    class (:func:`separate_bias`), it keeps the layer's parameters and their FQNs, and is
    still called, so a layout planned for it (a column) runs its matmul on this rank's
    shard, and the planner reads it as the layer it was."""

    #: Its forward leaves the bias out; whoever calls it adds it (read by a row's layout).
    adds_bias = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's own forward with a zero bias: its product alone, for any forward that
        adds its bias last (``F.linear``, ``Conv1D``'s ``addmm``, a LoRA's sum)."""
        bias = self._parameters.get("bias")
        if bias is None:
            return super().forward(x)  # type: ignore[no-any-return]
        with _reparametrize_module(self, {"bias": torch.zeros_like(bias)}):
            return super().forward(x)  # type: ignore[no-any-return]

    @classmethod
    def of(cls, layer: nn.Module) -> nn.Module:
        """``layer``'s parameters, attributes and mode under :func:`separate_bias` of its
        class (``layer`` is not touched; it has no hooks: :func:`decompose` refuses those)."""
        kind = separate_bias(type(layer))
        new = kind.__new__(kind)
        vars(new).update(vars(layer), _parameters=dict(layer._parameters), _buffers=dict(layer._buffers),
                         _modules=dict(layer._modules))
        return new


class SeparateBiasLinear(SeparateBias, nn.Linear):
    """An ``nn.Linear`` whose forward is its matmul alone (:class:`SeparateBias`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def separate_bias(kind: type[nn.Module]) -> type[nn.Module]:
    """``kind`` with :class:`SeparateBias` mixed in (one class per layer class, so that
    layers of one kind stay of one kind): ``SeparateBiasLinear`` for ``nn.Linear``,
    ``SeparateBiasConv1D`` for Hugging Face's ``Conv1D``."""
    if issubclass(kind, SeparateBias):
        return kind
    return SeparateBiasLinear if kind is nn.Linear else _mixed(cast(type, kind))  # a class hashes as itself


@functools.cache
def _mixed(kind: type) -> type[nn.Module]:
    name = f"SeparateBias{kind.__name__}"
    return type(name, (SeparateBias, kind), {"__module__": __name__, "__qualname__": name,
                                             "__doc__": f"A {kind.__name__} whose forward is its matmul alone."})


#: The linear functions a traced graph calls: fx's ``F.linear``, torch.export's ``aten.linear``.
_LINEAR_FNS: tuple[object, ...] = (F.linear, torch.ops.aten.linear.default)


def _graph_of(module: nn.Module) -> fx.Graph | None:
    """The graph a traced module runs: a ``GraphModule``'s, or an ``InterpreterModule``'s
    (the modules of a ``torch.export`` trace, unflattened), else ``None``."""
    graph = module.__dict__.get("graph") if not isinstance(module, fx.GraphModule) else module.graph
    return graph if isinstance(graph, fx.Graph) else None


def _exported_linear(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` as torch.export leaves it: a traced module
    of its own whose graph is one linear of its input by its ``weight`` (and ``bias``)."""
    graph = _graph_of(module)
    if graph is None or "weight" not in module._parameters:
        return False
    ops = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    return len(ops) == 1 and ops[0].target in _LINEAR_FNS and _weight_of(ops[0]) == "weight"


def _decomposable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module) or _exported_linear(module)


def _weight_of(node: fx.Node) -> str | None:
    """The target of the parameter a linear call ``node`` multiplies by, read by ``get_attr``."""
    w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    return str(w.target) if isinstance(w, fx.Node) and w.op == "get_attr" else None


def _inline_linears(graph: fx.Graph) -> dict[str, fx.Node]:
    """The linears with a bias that a traced graph computes itself (a Linear inlined by
    ``trace(flatten=True)`` through torch.export: ``aten.linear(x, inner.fc.weight,
    inner.fc.bias)``), by the path of the module whose parameters they read."""
    found = {}
    for n in graph.nodes:
        weight = _weight_of(n) if n.op == "call_function" and n.target in _LINEAR_FNS else None
        bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        if weight is not None and weight.endswith(".weight") and isinstance(bias, fx.Node) and bias.op == "get_attr":
            found[weight.removesuffix(".weight")] = n
    return found


def _owner(root: nn.Module, path: str) -> tuple[str, str] | None:
    """The nearest traced ancestor of ``path`` and ``path`` relative to it."""
    tokens = split(path)
    for i in range(len(tokens) - 1, -1, -1):
        if _graph_of(get_module(root, ".".join(tokens[:i]))) is not None:
            return ".".join(tokens[:i]), ".".join(tokens[i:])
    return None


def _sites(module: nn.Module, graph: fx.Graph, under: str = "") -> set[str]:
    """The Linears a traced ``module``'s graph calls (or computes itself), at ``under`` or
    inside it (all of them for ``""``), by their paths relative to ``module``."""
    called = {str(n.target) for n in graph.nodes if n.op == "call_module"
              and _decomposable(get_module(module, str(n.target)))}
    return {t for t in called | set(_inline_linears(graph)) if not under or t == under or t.startswith(under + ".")}


@primitive
def decompose(sch: Schedule, where: Selection) -> Schedule:
    """Split each selected ``nn.Linear`` of a traced module into its matmul followed by
    ``+ bias``, so that the bias add can be matched and fused with what follows
    (``F.gelu(x + b)``, bias + dropout + residual…). Hugging Face's ``Conv1D`` (GPT-2) is
    split the same way.

    ``where`` names Linear modules called from a traced ancestor's graph, or a traced
    module (then every Linear it calls). A called linear layer (``nn.Linear``, a subclass,
    ``Conv1D``, a subclass that keeps its product) stays called for its own forward with
    its bias left out, as its class with :class:`SeparateBias` mixed in
    (:func:`separate_bias`; :class:`SeparateBiasLinear` for ``nn.Linear``) holding the
    same parameters under the same FQNs, so ``shard`` reads it as the layer it was and a
    layout planned for it still applies; the graph adds its bias after the call. A
    Linear inlined by ``torch.export`` (or exported as a module of its own) is computed
    by the graph itself. A layer with hooks or checkpoint/compile annotations is refused
    (its call would no longer be the layer's), and so is one decomposed already. Returns
    a new schedule; the input is unchanged.

    Example:
        >>> import torch.nn as nn, slapo_fn as sf
        >>> sch = sf.trace(sf.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.ReLU())), "")
        >>> sch = sf.decompose(sch, "0")
        >>> [(n.op, str(n.target)) for n in sch.module.graph.nodes][1:4]
        [('call_module', '0'), ('get_attr', '0.bias'), ('call_function', '<built-in function add>')]
    """
    paths = where.modules(sch.module)
    todo: dict[str, set[str]] = {}
    problems: list[Problem] = []
    for path in paths:
        module = get_module(sch.module, path)
        owner = _owner(sch.module, path)
        graph = _graph_of(module)
        # called by its traced ancestor's graph; else, inlined into it (trace(flatten=True)), the
        # module only holds its children, whose code that graph runs
        called = owner is not None and any(n.op == "call_module" and str(n.target) == owner[1]
                                           for n in _graph_of(get_module(sch.module, owner[0])).nodes)  # type: ignore[union-attr]
        if graph is not None and (owner is None or (called and not _exported_linear(module))):
            found = _sites(module, graph)
            if not found:
                problems.append(
                    Problem(path, "its graph calls no nn.Linear or Conv1D", "select a traced module with Linears")
                )
            todo.setdefault(path, set()).update(found)
            continue
        if owner is not None and not called:
            # a module inlined into a traced ancestor's graph (trace(flatten=True) keeps it, as
            # torch.export's InterpreterModule, to hold its children): the Linears under it there
            holder = get_module(sch.module, owner[0])
            inside = _sites(holder, _graph_of(holder), owner[1])  # type: ignore[arg-type]
            if inside:
                todo.setdefault(owner[0], set()).update(inside)
                continue
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
        own = _graph_of(gm)
        assert own is not None
        graph, _ = copy_graph(own)
        calls = {str(n.target): n for n in graph.nodes if n.op == "call_module"}
        inline = _inline_linears(graph)
        for target in sorted(targets):
            full = join(gpath, target)
            linear = get_module(gm, target)
            node = calls.get(target)
            kinds = set(sch.annotations.get(full, {})) & set(_CALLED)
            if node is None and target in inline:  # computed by the graph itself: its bias split off
                inlined = inline[target]
                with graph.inserting_before(inlined):
                    x, weight = inlined.args[0], inlined.args[1] if len(inlined.args) > 1 else inlined.kwargs["weight"]
                    bias = inlined.args[2] if len(inlined.args) > 2 else inlined.kwargs["bias"]
                    out = graph.call_function(inlined.target, (x, weight))  # type: ignore[arg-type]
                    out = graph.call_function(operator.add, (out, bias))
                out.meta = dict(inlined.meta)
                inlined.replace_all_uses_with(out)
                graph.erase_node(inlined)
            elif node is None:
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
            elif isinstance(linear, SeparateBias):
                problems.append(Problem(full, "is decomposed already (its parent adds its bias)", "decompose it once"))
            elif len(node.args) != 1 or node.kwargs:
                problems.append(Problem(full, "is called with more than one input", "leave it as it is"))
            elif isinstance(linear, nn.Linear) or is_conv1d(linear):  # called for its matmul; the bias after it
                gm = set_at(gm, target, SeparateBias.of(linear))  # type: ignore[assignment]
                if linear.bias is not None:
                    with graph.inserting_after(node):
                        bias = graph.get_attr(f"{target}.bias")
                    with graph.inserting_after(bias):
                        out = graph.call_function(operator.add, (node, bias))
                    out.meta = dict(node.meta)
                    node.replace_all_uses_with(out, delete_user_cb=functools.partial(operator.is_not, out))
            else:
                with graph.inserting_before(node):
                    weight = graph.get_attr(f"{target}.weight")
                    out = graph.call_function(F.linear, (node.args[0], weight))
                    if linear._parameters.get("bias") is not None:
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
