"""``sync``: state the layout an activation must have at a module boundary.

The collective is derived from the (src, dst) pair over one mesh axis: ``Partial`` →
``Replicate`` is an all-reduce, ``Partial`` → ``Shard`` a reduce-scatter, ``Shard`` →
``Replicate`` an all-gather, ``Replicate`` → ``Shard`` a split (scatter, no traffic).
Slapo's explicit sync ops map onto it:

* all-reduce after a module: ``sync(sch, p, "fwd_post", Replicate(), src=Partial())``;
* all-reduce of an input gradient: ``sync(sch, p, "bwd_post", Replicate(), src=Partial())``;
* all-gather / reduce-scatter / scatter: ``Shard(d)`` as ``src`` or ``layout``.

On a sharded module ``src`` defaults to the module's own output layout (column:
``Shard(-1)``, row / vocab: ``Partial``), so ``sync(sch, "lm_head", "fwd_post", Shard(-1))``
keeps vocab-parallel logits sharded for :func:`~slapo_fn.vocab_parallel_cross_entropy`.

Example:
    >>> import slapo_fn as sf, torch.nn as nn
    >>> from torch.distributed.tensor import Partial, Replicate
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> sch = sf.create_schedule(nn.Sequential(nn.Linear(4, 4)), mesh=fake_mesh(2))
    >>> sch = sf.sync(sch, "0", "fwd_post", Replicate(), src=Partial())
    >>> print(sch["0"].annotations["sync"][0])
    fwd_post P→R@tp (all_reduce)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..combinators import primitive
from ..errors import LayoutError, Problem
from ..schedule import Key, Schedule
from ..select import Selection
from .layout import describe
from .shard import _problem_mesh, _problem_uncalled

__all__ = ["SYNC", "SYNC_MODES", "SyncFn", "SyncSpec", "collective_of", "sync"]

SYNC: Key[tuple[SyncSpec, ...]] = Key("sync")
SYNC_MODES = ("fwd_pre", "fwd_post", "bwd_post")


def collective_of(src: Placement, dst: Placement) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(forward collectives, backward collectives) of converting ``src`` to ``dst``."""
    if src == dst or (isinstance(src, Replicate) and isinstance(dst, Replicate)):
        return (), ()
    if isinstance(src, Partial):
        return (("all_reduce",), ()) if isinstance(dst, Replicate) else (("reduce_scatter",), ("all_gather",))
    if isinstance(src, Replicate):
        return (), ("all_gather",)
    if isinstance(dst, Replicate):
        return ("all_gather",), ()
    return ("all_gather",), ("all_gather",)


#: A user's callable at a module boundary, in the form of PyTorch's module hooks (and of
#: Slapo's ``sync_op_or_fn``): ``fn(module, args)`` before the forward, which returns the
#: new positional arguments (a tuple, or one value for the first) or ``None`` to keep
#: them; ``fn(module, args, output)`` after it, which returns the new output or ``None``,
#: and reads ``args`` as the caller handed them (Slapo's embedding hooks mask the output by
#: the ids the pre-hook shifted: both read the same ids).
SyncFn = Callable[..., Any]


@dataclass(frozen=True)
class SyncSpec:
    """One stated boundary: at ``mode``, the activation goes from ``src`` to ``layout``
    over ``mesh_axis``; by the collective the two imply, or by the user's ``fn``, which
    the user states takes ``src`` and gives ``layout`` (the plan checks the statement
    against the data flow, :mod:`.statements`)."""

    mode: str
    layout: Placement
    src: Placement | None
    mesh_axis: str
    fn: SyncFn | None = None

    def __str__(self) -> str:
        src = "?" if self.src is None else describe(self.src)
        if self.fn is not None:
            name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
            return f"{self.mode} {src}→{describe(self.layout)}@{self.mesh_axis} (by {name})"
        ops = collective_of(self.src or Replicate(), self.layout)[0]
        return f"{self.mode} {src}→{describe(self.layout)}@{self.mesh_axis} ({', '.join(ops) or 'local'})"


@primitive
def sync(
    sch: Schedule,
    where: Selection,
    mode: str,
    layout: Placement,
    *,
    src: Placement | None = None,
    mesh_axis: str = "tp",
    fn: SyncFn | None = None,
) -> Schedule:
    """Make an activation at the selected modules' boundary have ``layout`` over ``mesh_axis``.

    ``mode``: ``"fwd_pre"`` (the module's first tensor input), ``"fwd_post"`` (its
    output), ``"bwd_post"`` (the gradient of its first tensor input: ``src`` is then the
    gradient's layout, e.g. ``Partial()``). ``src`` defaults to the module's own layout
    at that boundary (``Replicate()`` for an unsharded module). A boundary stated with
    ``sync`` is *explicit*: ``build(strict=True)`` accepts it. Returns a new schedule; the
    input is unchanged.

    ``fn``: the user's own code at the boundary in place of the collective (Slapo's
    ``sync_op_or_fn=<fn>``: an embedding's masking, ``broadcast_input``), called as
    PyTorch's module hooks are (:data:`SyncFn`). The user states the layout it takes,
    ``src`` (required), and gives, ``layout``; the plan trusts the statement only where
    the data flow agrees (what arrives at a ``fwd_pre``, what the module gives at a
    ``fwd_post``), else build refuses it. A module with such a sync runs its own forward
    on this rank's shards of its parameters: the callables are its tensor-parallel code.

    >>> import torch.nn as nn, slapo_fn as sf
    >>> from torch.distributed.tensor import Shard
    >>> from slapo_fn.dtensor.testing import fake_mesh
    >>> sch = sf.shard(sf.create_schedule(nn.Sequential(nn.Linear(8, 8)), mesh=fake_mesh(2)), "0", axis=0)
    >>> sch = sf.sync(sch, "0", "fwd_post", Shard(-1))     # keep the output sharded (no all-gather)
    >>> sf.dtensor.plan(sch).counts()
    {'forward': {}, 'backward': {'all_reduce': 1}}
    """
    paths = where.modules(sch.module)
    problems = [p for p in (_problem_mesh(sch, path, mesh_axis) for path in paths) if p is not None]
    problems += [p for p in (_problem_uncalled(sch, path) for path in paths) if p is not None]
    if mode not in SYNC_MODES:
        problems += [Problem(p, f"unknown sync mode {mode!r}", f"use one of {', '.join(SYNC_MODES)}") for p in paths]
    if not isinstance(layout, Shard | Replicate):
        problems += [
            Problem(p, f"cannot make an activation {layout!r}", "use Replicate() or Shard(d) as the target layout")
            for p in paths
        ]
    if mode == "bwd_post" and src is None:
        problems += [Problem(p, "bwd_post needs src= (the gradient's layout)", "pass src=Partial()") for p in paths]
    elif mode == "bwd_post" and src is not None and not (
        isinstance(layout, Replicate) and isinstance(src, Partial | Replicate)
    ):
        # an input gradient keeps the input's shape: it can only be summed (Partial → Replicate)
        problems += [
            Problem(p, f"an input gradient cannot go {describe(src)}→{describe(layout)}: it keeps the input's shape",
                    "state bwd_post as Replicate() from src=Partial() (an all-reduce of the gradient)")
            for p in paths
        ]
    if fn is not None:
        if not callable(fn):
            problems += [Problem(p, f"fn={fn!r} is not callable", "pass a function fn(module, args[, output])")
                         for p in paths]
        elif mode == "bwd_post":
            problems += [Problem(p, "a callable runs in the forward pass (as a module hook), not on a gradient",
                                 "state it as fwd_pre or fwd_post, or drop fn= for the all-reduce of bwd_post")
                         for p in paths]
        elif src is None:
            problems += [Problem(p, "a callable sync needs src= (the layout its fn takes; layout is what it gives)",
                                 "state src=, e.g. src=Partial() for a fn that all-reduces")
                         for p in paths]
    if problems:
        raise LayoutError("sync", problems, src=src, dst=layout)
    spec = SyncSpec(mode, layout, src, mesh_axis, fn)
    for path in paths:
        sch = sch.annotate_path(path, SYNC, (*sch.annotations.get(path, SYNC, ()), spec))
    return sch
