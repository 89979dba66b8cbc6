"""The data flow among a module's children, traced by need: which children's outputs
reach each child's input in the parent's ``forward`` (not the order the children were
registered in), for the layout planner (:mod:`.plan`).

A parent is traced with ``torch.fx``, its children as leaves (their code is not run),
on a shallow copy (an attribute its forward sets stays off the model). A parent that
fx cannot trace (attention that unpacks shapes into ``*args``, control flow on tensor
values) has no flow: :func:`flow` returns ``None`` and the planner falls back to module
order and its refusals.

Example:
    >>> import torch.nn as nn, torch.nn.functional as F
    >>> class Gated(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.up, self.gate, self.down = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)
    ...     def forward(self, x):
    ...         return self.down(F.silu(self.gate(x)) * self.up(x))
    >>> fl = flow(Gated())
    >>> sorted(fl.feeders("down")), sorted(fl.feeders("up")), sorted(fl.consumers("gate"))
    (['gate', 'up'], ['<input>'], ['down'])
"""

from __future__ import annotations

import copy
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch.fx as fx
from torch import nn

__all__ = ["INPUT", "OUTPUT", "Flow", "flow", "pointwise"]

#: What reaches a child from the parent's own arguments, and where the parent's result goes.
INPUT, OUTPUT = "<input>", "<output>"
_INNER = "inner"


@dataclass(frozen=True)
class Flow:
    """Where data goes among one parent's children.

    ``feeds[child]`` holds the children (or :data:`INPUT`) whose outputs reach ``child``'s
    arguments, through any ops of the parent's code between; ``output`` what reaches the
    parent's result; ``reads`` the children whose parameters or buffers the parent's own
    code reads (``F.linear(x, self.proj.weight)``). Children called in no path of the
    traced forward are absent from ``feeds``.
    """

    feeds: Mapping[str, frozenset[str]]
    output: frozenset[str]
    reads: frozenset[str] = frozenset()
    first: Mapping[str, str] = field(default_factory=dict)  # the value each child is first called on (a node)

    def same_input(self, a: str, b: str) -> bool:
        """Whether children ``a`` and ``b`` are called on the very same tensor (q/k/v on the
        normed hidden states), not merely on values of equal shape."""
        return a in self.first and self.first.get(a) == self.first.get(b)

    def called(self, child: str) -> bool:
        return child in self.feeds

    def feeders(self, child: str, through: Callable[[str], bool] = lambda _: False) -> frozenset[str]:
        """What reaches ``child``, looking through the children ``through`` accepts
        (pointwise modules: an activation, a dropout)."""
        return _close(self.feeds.get(child, frozenset()), self.feeds, through)

    def reaching_output(self, through: Callable[[str], bool] = lambda _: False) -> frozenset[str]:
        """What reaches the parent's result, looking through the children ``through`` accepts."""
        return _close(self.output, self.feeds, through)

    def consumers(self, child: str, through: Callable[[str], bool] = lambda _: False) -> frozenset[str]:
        """The children (and :data:`OUTPUT`) ``child``'s output reaches, looking through
        the children ``through`` accepts."""
        out: set[str] = set()
        todo, seen = [child], {child}
        while todo:
            here = todo.pop()
            users = [q for q, src in self.feeds.items() if here in src]
            if here in self.output:
                users.append(OUTPUT)
            for q in users:
                if q != OUTPUT and through(q):
                    if q not in seen:
                        seen.add(q)
                        todo.append(q)
                else:
                    out.add(q)
        return frozenset(out)


def _close(
    sources: Iterable[str], feeds: Mapping[str, frozenset[str]], through: Callable[[str], bool]
) -> frozenset[str]:
    out: set[str] = set()
    todo, seen = list(sources), set()
    while todo:
        q = todo.pop()
        if q in seen:
            continue
        seen.add(q)
        if q not in (INPUT, OUTPUT) and through(q):
            todo += feeds.get(q, frozenset())
        else:
            out.add(q)
    return frozenset(out)


_NOT_POINTWISE = (nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d, nn.GLU, nn.MultiheadAttention)


def pointwise(module: nn.Module) -> bool:
    """Whether ``module`` works element by element with no parameters (an activation, a
    dropout, ``Identity``): a layout passes through it unchanged."""
    if any(True for _ in module.parameters()) or isinstance(module, _NOT_POINTWISE):
        return False
    if isinstance(module, nn.Identity | nn.modules.dropout._DropoutNd):
        return True
    kind = type(module)
    return kind.__module__ in ("torch.nn.modules.activation", "transformers.activations")


class _Caller(nn.Module):
    """Calls ``inner`` with its ``n`` required positional arguments (fx cannot trace a root
    taking ``*args``/``**kwargs``, as Hugging Face decoder layers do)."""

    def __init__(self, inner: nn.Module, n: int) -> None:
        super().__init__()
        self.inner = inner
        self.n = n

    def forward(self, a0: Any, a1: Any = None, a2: Any = None, a3: Any = None) -> Any:
        return self.inner(*(a0, a1, a2, a3)[: self.n])


class _Leaves(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name.startswith(_INNER + ".")


def _required(module: nn.Module) -> int | None:
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in params if p.kind in positional and p.default is inspect.Parameter.empty)


#: Traced flows by parent module (weakly: a module no schedule holds any more drops out),
#: with what they were traced from: its children and its plain attributes (a changed one
#: traces again).
_TRACED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, ...], Flow | None]] = weakref.WeakKeyDictionary()


def flow(parent: nn.Module) -> Flow | None:
    """The data flow among ``parent``'s children, or ``None`` where fx cannot trace its
    forward (the planner then reads module order). Traced once per module."""
    plain = (int, float, str, bool, type(None))
    key = (
        type(parent).forward,
        tuple((k, id(m)) for k, m in parent._modules.items()),
        tuple((k, v) for k, v in vars(parent).items() if isinstance(v, plain)),
    )
    known = _TRACED.get(parent)
    if known is not None and known[0] == key:
        return known[1]
    found = _trace(parent)
    _TRACED[parent] = (key, found)
    return found


def _trace(parent: nn.Module) -> Flow | None:
    n = _required(parent)
    if n is None or n > 4 or not parent._modules:
        return None
    shell = copy.copy(parent)  # attributes the traced forward sets land on the copy
    n = max(n, 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = _Leaves().trace(_Caller(shell, n), concrete_args={f"a{i}": None for i in range(n, 4)})
    except Exception:  # any failure of symbolic tracing: no flow, module order instead
        return None
    prefix = _INNER + "."
    sources: dict[fx.Node, frozenset[str]] = {}
    feeds: dict[str, frozenset[str]] = {}
    reads: set[str] = set()
    first: dict[str, str] = {}
    output: frozenset[str] = frozenset()
    for node in graph.nodes:
        upstream: frozenset[str] = frozenset().union(*(sources.get(a, frozenset()) for a in node.all_input_nodes))
        if node.op == "placeholder":
            sources[node] = frozenset({INPUT})
        elif node.op == "get_attr":
            target = str(node.target)
            used = any(not _metadata(user) for user in node.users)  # self.wo.weight.dtype is no read
            if target.startswith(prefix) and used:
                name = target[len(prefix) :].rsplit(".", 1)[0]
                if name in _child_paths(parent):
                    reads.add(name)
            sources[node] = frozenset()
        elif node.op == "call_module" and str(node.target).startswith(prefix):
            name = str(node.target)[len(prefix) :]
            feeds[name] = feeds.get(name, frozenset()) | upstream
            arg = next(iter([*node.args, *node.kwargs.values()]), None)
            if name not in first and isinstance(arg, fx.Node):
                first[name] = arg.name
            sources[node] = frozenset({name})
        elif node.op == "output":
            output = upstream
        elif _metadata(node):
            sources[node] = frozenset()  # a shape or dtype carries no data: x.size() to view by
        else:
            sources[node] = upstream
    return Flow(MappingProxyType(feeds), output, frozenset(reads), MappingProxyType(first))


_METADATA_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement", "get_device", "element_size"})
_METADATA_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad"})


def _metadata(node: fx.Node) -> bool:
    """Whether ``node`` reads a tensor's metadata (its shape, dtype, device), not its values."""
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    return (node.op == "call_function" and node.target is getattr and len(node.args) > 1
            and node.args[1] in _METADATA_ATTRS)


def _child_paths(parent: nn.Module) -> set[str]:
    return {name for name, _ in parent.named_modules() if name}
