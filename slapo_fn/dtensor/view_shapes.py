"""The shape a traced ``view``/``reshape``/``expand``/``permute`` is given, read off the
traced values rather than the spelling: sizes one by one, a tuple, or a tuple built from a
shape by slices and concatenations (``x.size()[:-1] + (h, d)``, ALBERT's and GPT-2's)
all give one answer (:func:`view_shape`), which :mod:`.features` and :mod:`.flow` read.

Example:
    >>> import torch, torch.fx as fx
    >>> def f(x):
    ...     return x.view(x.size()[:-1] + (2, 4))
    >>> g = fx.symbolic_trace(f).graph
    >>> view = next(n for n in g.nodes if n.target == "view")
    >>> view_shape(view, lambda t: 3)[-2:]
    (2, 4)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

__all__ = ["SizeOf", "op_name", "shape_given", "view_shape", "whole_shape"]


def op_name(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))


def whole_shape(d: Any) -> Any:
    """The tensor whose whole shape ``d`` is (``y.shape``, ``y.size()``), else ``None``."""
    if not isinstance(d, fx.Node):
        return None
    if (d.op == "call_function" and op_name(d) == "getattr" and d.args[1] == "shape") or (
            d.op == "call_method" and op_name(d) == "size" and len(d.args) == 1):
        return d.args[0]
    return None


@dataclass(frozen=True)
class SizeOf:
    """One size of a traced tensor that the trace holds no node for: an item of a shape
    taken apart by Python's tuple ops, which plain fx records as calls
    (``x.size()[:-1] + (h, d)``, ALBERT's and GPT-2's ``view``): ``of``'s size ``dim``."""

    of: fx.Node
    dim: int


def _no_rank(_: fx.Node) -> int | None:
    return None


def view_shape(use: fx.Node, rank_of: Callable[[fx.Node], int | None] = _no_rank) -> tuple[Any, ...]:
    """The shape a ``view``/``reshape``/``expand``/``permute`` call ``use`` is given, one item
    per dimension of its result: an ``int``, a node (a size the code computes, or reads:
    ``x.size(1)``) or a :class:`SizeOf`, however the code spelled it: sizes one by one, a
    tuple, a tuple built from a shape by slices and concatenations (``x.size()[:-1] + (h,
    d)``: its items evaluated, a whole shape by ``rank_of``, the number of dimensions of a
    traced value where known). A whole shape alone (``view(y.shape)``) stays one item, as
    written. Read off the traced values, so every spelling of one shape gives one answer."""
    rest = use.args[1:]
    shape = tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], tuple | list) else tuple(rest)
    if len(shape) == 1 and whole_shape(shape[0]) is None and (
            found := _shape_value(shape[0], rank_of)) is not None:
        return found
    return tuple(_size_value(d, rank_of) for d in shape)


def _shape_value(arg: Any, rank_of: Callable[[fx.Node], int | None], depth: int = 0) -> tuple[Any, ...] | None:
    """The items of a traced tuple of sizes (see :func:`view_shape`), or ``None`` where
    ``arg`` is no such tuple or its length is not known."""
    if isinstance(arg, tuple | list):
        return tuple(_size_value(d, rank_of, depth + 1) for d in arg)
    if not isinstance(arg, fx.Node) or depth > 32 or arg.op != "call_function":
        if isinstance(arg, fx.Node) and (whole := whole_shape(arg)) is not None:
            rank = rank_of(whole)
            return None if rank is None else tuple(SizeOf(whole, i) for i in range(rank))
        return None
    name = op_name(arg)
    if (whole := whole_shape(arg)) is not None:
        rank = rank_of(whole)
        return None if rank is None else tuple(SizeOf(whole, i) for i in range(rank))
    if name == "getitem" and len(arg.args) == 2 and isinstance(index := arg.args[1], slice) and all(
            b is None or (isinstance(b, int) and not isinstance(b, bool))
            for b in (index.start, index.stop, index.step)):
        inner = _shape_value(arg.args[0], rank_of, depth + 1)
        return None if inner is None else inner[index]
    if name == "add" and len(arg.args) == 2:
        left, right = (_shape_value(a, rank_of, depth + 1) for a in arg.args)
        return None if left is None or right is None else left + right
    return None


def _size_value(d: Any, rank_of: Callable[[fx.Node], int | None], depth: int = 0) -> Any:
    """One size of a shape as :func:`view_shape` gives it: an item taken by index of a
    tuple built from a shape (``(x.size()[:-1])[0]``) is that size; anything else as given."""
    if (isinstance(d, fx.Node) and d.op == "call_function" and op_name(d) == "getitem" and len(d.args) == 2
            and isinstance(i := d.args[1], int) and not isinstance(i, bool) and whole_shape(d.args[0]) is None):
        inner = _shape_value(d.args[0], rank_of, depth + 1)
        if inner is not None and -len(inner) <= i < len(inner):
            return inner[i]
    return d


def shape_given(use: fx.Node, rank: int | None = None) -> tuple[Any, ...]:
    """:func:`view_shape` of ``use``, whose first argument has ``rank`` dimensions (where known)."""
    value = use.args[0] if use.args else None
    return view_shape(use, lambda t: rank if t is value else None)
