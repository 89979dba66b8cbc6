"""The build on DTensor activations: where the plan cannot prove a model right on local
shards (:attr:`.plan.Plan.on_dtensors`), every planned module's forward inside the region
(:mod:`.regions`: the smallest subtree entered and left whole, else the whole model) is
installed to run on DTensors (:mod:`.region`), with each sync and sequence-parallel
boundary moving the DTensor it acts on to the layout it states."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..errors import LayoutError, Problem
from ..rewrites._common import within
from ..rewrites.checkpoint import CHECKPOINT
from ..schedule import Schedule
from ..tree import get_module, join, parent_path, relative, split, uncalled, walk
from .arriving import stated_model_output
from .chains import chain_entries_given_split
from .lookups import _run_order, read_positions
from .planned import ModulePlan, Plan
from .region import (
    Activations,
    island,
    map_first_output,
    map_input,
    normalized,
    region,
    relayout,
    role_on_dtensors,
)
from .rng import forked
from .sequence import SEQ, SeqSpec

__all__ = ["install_on_dtensors"]


def install_on_dtensors(model: nn.Module, sch: Schedule, p: Plan, acts: Activations, rank_of: Callable[[str], int],
                        experts: Callable[[Activations, nn.Module, ModulePlan, Callable[..., Any]], Callable[..., Any]],
                        root: str = "") -> list[torch.Tensor]:
    """The subtree at ``root`` (the whole model by default) as one DTensor region
    (:mod:`.region`, :mod:`.regions`): every planned module's forward inside it on DTensor
    activations, ``root`` entered and left with whole (replicated) values. The parameters
    are DTensors already; ``rank_of(axis)`` is this rank's index on a mesh axis,
    ``experts`` installs an experts module's forward. Returns the region's parameters,
    whose gradients the build puts in their placements
    (:func:`.region.reduce_partial_grads`, once for all regions and the modules beside)."""
    given = chain_entries_given_split(sch)
    inside = {q: mp for q, mp in p.modules.items() if within(root, q)}
    for path, mp in inside.items():
        m = get_module(model, path)
        forward: Callable[..., Any] = m.forward
        role = mp.role
        if mp.experts is not None:
            forward = experts(acts, m, mp, forward)
        elif role is not None and not role.own_forward:
            stated = next((s.layout for s in mp.syncs if s.mode == "fwd_post"), None)
            # in a chain, a partial sum goes on as this rank's tokens (a reduce-scatter)
            in_chain = mp.seq is not None and mp.seq.mesh_axis == role.mesh_axis and isinstance(role.gives(3), Partial)
            out = stated if stated is not None else Shard(mp.seq.seq_axis) if in_chain and mp.seq else None
            forward = role_on_dtensors(acts, m, role, out)
        forward = _boundaries_on_dtensors(acts, mp, forward, given.get(path))
        if mp.rng is not None:
            forward = forked(forward, rank_of(mp.rng.mesh_axis))
        m.forward = forward  # type: ignore[method-assign]
    top = get_module(model, root)
    on_the_way = {join(*split(q)[:i]) for q in inside for i in range(len(split(root)), len(split(q)) + 1)}
    # by module, not path: a module registered at two paths is on the way at both, and one
    # island is wrapped once
    islands: set[int] = {id(get_module(model, q)) for q in on_the_way}
    # a checkpointed module below an island is recomputed outside the island's forward: an
    # island of its own, which the island around it leaves its values to
    ckpts = [q for q in sch.annotations.of_kind(CHECKPOINT) if within(root, q) and q not in on_the_way]
    for path, m in walk(top, root):
        parent = parent_path(path) if path != root else None
        if (parent in on_the_way or path in ckpts) and not uncalled(m) and id(m) not in islands:
            islands.add(id(m))
            inner = [relative(path, q) for q in ckpts if q != path and within(path, q)]
            m.forward = island(acts, m, m.forward, inner)  # type: ignore[method-assign]
    leaving = stated_model_output(sch) if not root else {}
    # (a module registered at two paths is never a region's root: its parameters are tied across them)
    read = read_positions(sch, root) if root else None
    stream_in, stream_out = _stream(sch, root)
    top.forward = region(acts, top.forward, leaving, whole_in=bool(root), read=read,  # type: ignore[method-assign]
                         stream_in=stream_in, stream_out=stream_out)
    return list(top.parameters())


def _stream(sch: Schedule, root: str) -> tuple[dict[str, Placement] | None, dict[str, Placement] | None]:
    """How a region rooted at ``root`` is handed its first tensor argument and returns its
    first tensor, where ``root`` is a member of a sequence-parallel chain
    (:func:`.regions.regions_of`): as the members hand the residual stream on, this rank's
    tokens; but the chain's first member is handed it whole (its entry splits it, unless
    the chain is told its input arrives split) and the last returns it whole (its exit
    gathers it). ``None`` for whole, and for a root that is no member."""
    spec = sch.annotations.get(root, SEQ) if root else None
    if spec is None:
        return None, None
    order = _run_order(sch)
    same = sorted((q for q, s in sch.annotations.of_kind(SEQ).items() if s.mesh_axis == spec.mesh_axis),
                  key=lambda q: order.get(q, 0))
    shard: dict[str, Placement] = {spec.mesh_axis: Shard(spec.seq_axis)}
    return (shard if root != same[0] or spec.sharded_input else None), (shard if root != same[-1] else None)


def _boundaries_on_dtensors(acts: Activations, mp: ModulePlan, forward: Callable[..., Any],
                            given: SeqSpec | None) -> Callable[..., Any]:
    """``mp``'s syncs and sequence-parallel entry and exit inside a region: each moves the
    DTensor it acts on to the layout it states (DTensor knows where it comes from: a
    stated ``src`` is checked by the plan, and a ``bwd_post`` sync is what DTensor's own
    backward already does). ``given``: the chain ``mp`` enters first was told its input
    arrives split, so a plain (local) tensor handed to it is taken as this rank's shard."""
    called = [s for s in mp.syncs if s.fn is not None]
    if called:  # written for local tensors (Slapo's hooks call collectives on them): never skipped
        raise LayoutError("build", [Problem(
            mp.path or "<root>",
            f"has a callable {called[0].mode} sync ({called[0]}), written for this rank's local tensors, but the "
            "plan cannot prove the model right on local shards and runs it on DTensor activations, where the "
            "callable's collectives would not be what runs",
            "make the plan hold on local shards (sf.dtensor.plan(sch).on_dtensors says why it does not), or "
            "drop fn= and let the plan derive the collective",
        )])
    # a sync from a layout to itself moves nothing and asserts nothing (a plain tensor handed on
    # through it keeps the meaning the next statement gives it)
    pre = [s for s in mp.syncs if s.mode == "fwd_pre" and s.src != s.layout]
    post = [s for s in mp.posts if s.src != s.layout]
    if not (pre or post or mp.entry or mp.exit or given):
        return forward

    def shard_of(x: torch.Tensor) -> torch.Tensor:
        assert given is not None
        places = acts.placements(**{given.mesh_axis: Shard(given.seq_axis % x.dim())})
        return x if isinstance(x, DTensor) else DTensor.from_local(x, acts.mesh, places, run_check=False)

    def move(axis: str, layout: Placement, src: Placement | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """To ``layout``: a DTensor from where it is; a plain (local) tensor, handed in by
        the caller, from ``src``, the layout the plan resolved for it."""
        def run(x: torch.Tensor) -> torch.Tensor:
            if not isinstance(x, DTensor) and isinstance(src, Shard):
                places = acts.placements(**{axis: normalized(src, x.dim())})
                x = DTensor.from_local(x, acts.mesh, places, run_check=False)
            return relayout(acts, x, axis, layout)
        return run

    def run(*args: Any, **kwargs: Any) -> Any:
        if given is not None:
            args, kwargs = map_input(args, kwargs, shard_of)
        if mp.entry is not None:
            args, kwargs = map_input(args, kwargs, move(mp.entry.mesh_axis, Shard(mp.entry.seq_axis)))
        for s in pre:
            args, kwargs = map_input(args, kwargs, move(s.mesh_axis, s.layout, s.src))
        out = forward(*args, **kwargs)
        for s in post:
            out = map_first_output(out, move(s.mesh_axis, s.layout))
        if mp.exit is not None and not post:
            out = map_first_output(out, move(mp.exit.mesh_axis, Replicate()))
        return out

    return run
