"""Calls that every rank must make: :func:`every_rank` ends one made on some ranks only
with an error naming it, instead of a hang.

``if rank == 0: print(sf.verify(sch, ids))`` would wait forever in verify's first
collective for ranks that never come. Before their first collective, :func:`slapo_fn.verify`,
:func:`slapo_fn.save` and :func:`slapo_fn.load` meet in the process group's store (the
c10d store every rank reaches): each rank counts itself in, and waits until all have —
for the process group's own timeout at most. A rank left waiting raises
:class:`PartialCallError` naming the call, the ranks that did not come and the fix. The
store pairs the n-th call of each rank by counting arrivals, so nothing is kept in the
process; a call that gives up withdraws its arrival, so that a later call on every rank
pairs up again. One store round trip per call is the cost.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["PartialCallError", "every_rank"]

#: Seconds between two looks at the store while waiting.
_POLL_S = 0.05


class PartialCallError(RuntimeError):
    """A call that needs every rank of the process group was made on some ranks only."""


def every_rank(call: str, ranks: Sequence[int] | None = None, timeout: timedelta | None = None) -> None:
    """Wait until every one of ``ranks`` (default: the whole process group) has made
    ``call`` (``"sf.verify"``) as often as this one; :class:`PartialCallError` after
    ``timeout`` (default: the process group's). Nothing without a process group, with a
    fake one (``explain``'s), or for a single rank."""
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return
    members = sorted(ranks) if ranks is not None else list(range(dist.get_world_size()))
    if len(members) <= 1:
        return
    store = c10d._get_default_store()
    world, rank = len(members), dist.get_rank()
    key = f"slapo_fn/every_rank/{call}/{','.join(map(str, members))}"
    arrived = int(store.add(key, 1))
    round_ = (arrived - 1) // world
    store.set(f"{key}/{round_}/{rank}", "1")
    wait = (timeout or _group_timeout()).total_seconds()
    deadline = time.monotonic() + wait
    while int(store.add(key, 0)) < (round_ + 1) * world:
        if time.monotonic() >= deadline:
            missing = [r for r in members if not store.check([f"{key}/{round_}/{r}"])]
            store.add(key, -1)  # withdrawn: a later call on every rank pairs up again
            store.delete_key(f"{key}/{round_}/{rank}")
            raise PartialCallError(
                f"{call} needs every rank of the process group, and rank{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))} did not call it within {wait:g} s (the process group's timeout); "
                f"fix: call it on every rank (not under `if rank == 0:`), and print on one")
        time.sleep(_POLL_S)


def _group_timeout() -> timedelta:
    """The default process group's timeout (its backend's option; 30 minutes else)."""
    try:
        group = c10d._get_default_group()
        device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
        found = group._get_backend(device).options._timeout
        return found if isinstance(found, timedelta) else c10d.default_pg_timeout
    except (AttributeError, RuntimeError, ValueError):
        return c10d.default_pg_timeout
