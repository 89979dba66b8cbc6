"""``fuse``: a matched subgraph becomes one compiled module."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ...combinators import primitive
from ...errors import Problem, ScheduleError, ScheduleTypeError
from ...schedule import Schedule
from ...select import Selection
from .._common import reject_nested
from ..compile import KIND as COMPILE
from .find import Match
from .outline import outline

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
    attribute name (default ``fused``, made unique). To reproduce eager dropout masks
    bit for bit under inductor, pass ``options={"fallback_random": True}``. Returns a
    new schedule; the input is unchanged.

    Example:
        >>> import torch, torch.nn as nn, torch.nn.functional as F, slapo_fn as sf
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
        >>> sch = sf.decompose(sf.trace(sf.create_schedule(model), ""), "0")
        >>> match, = sf.find(sch, "", lambda x, b: F.gelu(x + b))
        >>> sch = sf.fuse(sch, "", match, compiler=None)
        >>> [n.op for n in sch.module.graph.nodes]
        ['placeholder', 'get_attr', 'call_function', 'get_attr', 'call_module', 'output']
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
    sch, new_path = outline(sch, paths[0], match, "fuse", "fused", lambda o: o.region, name=name)
    if compiler is not None:
        existing = list(sch.annotations.of_kind(COMPILE))
        reject_nested("fuse", [new_path], existing)
        spec: dict[str, Any] = {"backend": compiler}
        if options:
            spec["options"] = dict(options)
        sch = sch.annotate_path(new_path, COMPILE, MappingProxyType(spec))
    return sch
