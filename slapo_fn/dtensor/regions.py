"""Where DTensor regions sit: the smallest subtrees that hold what the plan cannot prove
on local shards (:attr:`.planned.Plan.on_dtensors`), so that the rest of the model runs on
local shards with the plan's own collectives.

A region is entered with whole activations and left with whole ones (:func:`.region.region`):
a subtree qualifies only where the plan outside it hands it and takes from it nothing
else. So a subtree ``r`` is a region when

* it is called (a ``ModuleList`` is not) and is not the root;
* no planned module inside it is paired with one outside, nor the other way round (a
  column's split output would cross the boundary);
* no sync outside every region, or on a region's root, states a layout other than whole,
  nor one inside whose split output reaches the region's result (a split it states would
  cross a boundary; one that stays inside a region is left there);
* where sequence-parallel chains are planned, it is a member of one, with no sync of its
  own: the residual stream between members is the chain's token shard, so a member is
  handed its first argument and returns its first result as that shard (the first member
  is handed it whole, the last returns it whole: the chain's entry and exit, which the
  member's own plan runs) and everything else whole; no chain's exit whose gather enters
  its readers' columns (an LM head after the final norm) lies on the other side;
* no parameter inside it is tied to one outside;
* no FSDP block is declared (its hooks swap the parameters a region reads).

Each problem's region is the smallest such subtree above the module the problem names
(its parent's code is what the problem is about); where none qualifies, the whole model
is one region, as before. Nested regions merge into the outer one.

Example:
    >>> region_roots(("model.layers.0.self_attn.q_proj",), lambda r: r.startswith("model.layers.0"))
    ('model.layers.0.self_attn',)
    >>> region_roots(("lm_head",), lambda r: False)
    ('',)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn
from torch.distributed.tensor import Replicate

from ..rewrites._common import contains, within
from ..schedule import Schedule
from ..tree import get_module, parent_path, uncalled
from .data_parallel import DATA_PARALLEL
from .flow import OUTPUT
from .lookups import _downstream, _flows_memo
from .planned import Plan
from .sequence import SEQ
from .shard import tied_paths
from .sync import SYNC

__all__ = ["region_roots", "regions_of"]


def region_roots(paths: Iterable[str], fits: Callable[[str], bool]) -> tuple[str, ...]:
    """The region roots for problems naming ``paths``: per path, the nearest ancestor
    (strictly above it) that ``fits``, else the root ``""``; nested roots merged."""
    roots: set[str] = set()
    for path in paths:
        r = parent_path(path) if path else ""
        while r and not fits(r):
            r = parent_path(r)
        roots.add(r)
    if "" in roots:
        return ("",)
    return tuple(sorted(r for r in roots if not any(o != r and contains(o, r) for o in roots)))


def regions_of(sch: Schedule, p: Plan) -> tuple[str, ...]:
    """The roots of the DTensor regions of ``sch`` under plan ``p`` (``()`` where the plan
    proves everything; ``("",)`` where the whole model must run on DTensors). The data
    flows it reads are looked up once per path, as within :func:`.plan.plan`."""
    with _flows_memo():
        return _regions_of(sch, p)


def _regions_of(sch: Schedule, p: Plan) -> tuple[str, ...]:
    if not p.on_dtensors:
        return ()
    spec = sch.annotations.get("", DATA_PARALLEL)
    if spec is not None and spec.blocks:
        return ("",)
    model = sch.module
    members = sch.annotations.of_kind(SEQ)
    syncs = sch.annotations.of_kind(SYNC)
    ties = {tuple(parent_path(q) for q in group) for group in tied_paths(model).values()}
    # a Megatron pair, and a chain's exit with the columns its gather enters, on one side
    paired = [(path, q) for path, mp in p.modules.items() for q in (*mp.partners, *mp.exit_columns)]
    stated = [path for path, specs in syncs.items() if any(not isinstance(s.layout, Replicate) for s in specs)]

    def fits(r: str, strict: bool) -> bool:
        m = get_module(model, r)
        return (not uncalled(m) and type(m).forward is not nn.Module.forward
                and (not members or (r in members and r not in syncs))
                and all(within(r, a) == within(r, b) for a, b in paired)
                and all(len({within(r, o) for o in group}) == 1 for group in ties)
                and (not strict or all(contains(r, q) for q in stated))
                and not any(contains(r, q) and _leaves(sch, q, r) for q in stated))

    paths = [q.path if q.path != "<root>" else "" for q in p.on_dtensors]
    # a split stated inside any region stays there (each region is left whole); one stated
    # outside them all, or on a region's root, would reach a boundary
    roots = region_roots(paths, lambda r: fits(r, strict=False))
    if all(any(contains(r, q) for r in roots) for q in stated):
        return roots
    return region_roots(paths, lambda r: fits(r, strict=True))


def _leaves(sch: Schedule, path: str, root: str) -> bool:
    """Whether ``path``'s output (which a sync states split) may reach ``root``'s result by
    the data flow: the region would hand it on whole where the plan outside takes it split.
    Where a flow on the way is unknown, it may."""
    levels, stop = _downstream(sch, path)
    for level in levels:
        if level.parent == root:
            return OUTPUT in level.users
    return stop is not None
