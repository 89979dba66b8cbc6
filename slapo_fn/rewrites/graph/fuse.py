"""``fuse``: a matched subgraph becomes one compiled module."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ...combinators import primitive
from ...errors import Problem, ScheduleError, ScheduleTypeError
from ...kernels.dropout import CounterDropout, counter_dropout
from ...schedule import Schedule
from ...select import Selection
from .._common import reject_nested
from ..compile import COMPILE
from .find import Match
from .outline import Outlined, outline

__all__ = ["fuse"]


@primitive
def fuse(
    sch: Schedule,
    where: Selection,
    match: Match,
    *,
    compiler: str | None = "inductor",
    name: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Schedule:
    """Make the subgraph ``match`` of the traced module at ``where`` one module,
    compiled with ``torch.compile(backend=compiler, options=options)`` when built.

    The new module is called from the graph where the subgraph was; it takes the
    subgraph's inputs (parameters included: modules with parameters inside the
    subgraph are inlined, so every parameter keeps its FQN) and returns its outputs.
    ``compiler=None`` leaves it eager (a plain ``GraphModule``). ``name`` is its
    attribute name (default ``fused``, made unique).

    Dropout inside a region compiled with inductor draws its masks with
    :func:`slapo_fn.kernels.counter_dropout` (on CPU a counter-based hash that inductor
    vectorises, about twice as fast as eager dropout where inductor's own CPU dropout is
    slower than eager; ``F.dropout`` elsewhere). Like inductor's fused dropout, its masks
    are not eager's: to reproduce eager masks bit for bit, pass
    ``options={"fallback_random": True}`` (dropout is then left as it is). Returns a new
    schedule; the input is unchanged.

    Example:
        >>> import torch, torch.nn as nn, torch.nn.functional as F, slapo_fn as sf
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
        >>> sch = sf.decompose(sf.trace(sf.create_schedule(model), ""), "0")
        >>> match, = sf.find(sch, "", lambda x, b: F.gelu(x + b))
        >>> sch = sf.fuse(sch, "", match, compiler=None)
        >>> [n.op for n in sch.module.graph.nodes]
        ['placeholder', 'call_module', 'get_attr', 'call_module', 'output']
        >>> report = sf.verify(sch, torch.randn(2, 4))
    """
    paths = where.modules(sch.module)
    if len(paths) != 1:
        raise ScheduleError(
            "fuse", [Problem(p, f"a match lives in one module; {len(paths)} selected", "select one") for p in paths]
        )
    if compiler is not None and not isinstance(compiler, str):
        raise ScheduleTypeError(
            "fuse", [Problem(paths[0], f"compiler must be a backend name or None, got {compiler!r}", "'inductor'")]
        )
    counter = compiler == "inductor" and not (options or {}).get("fallback_random", False)
    make = _with_counter_dropout if counter else _region
    sch, new_path = outline(sch, paths[0], match, "fuse", "fused", make, name=name)
    if compiler is not None:
        existing = list(sch.annotations.of_kind(COMPILE))
        reject_nested("fuse", [new_path], existing)
        spec: dict[str, Any] = {"backend": compiler}
        if options:
            spec["options"] = dict(options)
        sch = sch.annotate_path(new_path, COMPILE, MappingProxyType(spec))
    return sch


def _region(outlined: Outlined) -> nn.Module:
    return outlined.region


_DROPOUT_FUNCTIONS = (F.dropout, torch.dropout, torch.ops.aten.dropout.default)


def _with_counter_dropout(outlined: Outlined) -> nn.Module:
    """The region with each dropout (``nn.Dropout`` call, ``F.dropout``,
    ``torch.dropout`` or ``aten.dropout``) drawing counter-based masks. The region is
    this rewrite's own new module: its ``nn.Dropout`` entries are replaced by new
    :class:`CounterDropout` modules, the originals are untouched."""
    region = outlined.region
    for node in region.graph.nodes:
        if node.op == "call_module":
            module = region.get_submodule(str(node.target))
            if type(module) is nn.Dropout:
                swapped = CounterDropout(module.p, module.inplace).train(module.training)
                region.set_submodule(str(node.target), swapped)
        elif node.op == "call_function" and node.target in _DROPOUT_FUNCTIONS:
            node.args, node.kwargs = _dropout_arguments(node), {}
            node.target = counter_dropout
    region.recompile()
    return region


def _dropout_arguments(node: fx.Node) -> tuple[Any, ...]:
    """``(input, p, training, inplace)`` of a dropout call in any of its spellings
    (``F.dropout(input, p, training, inplace)``; ``torch.dropout`` and ``aten.dropout``
    take ``(input, p, train)``)."""
    names = ("input", "p", "training", "inplace")
    keywords = {"training" if k == "train" else k: v for k, v in node.kwargs.items()}
    bound = {"p": 0.5, "training": True, "inplace": False, **dict(zip(names, node.args)), **keywords}
    return tuple(bound[n] for n in names)
