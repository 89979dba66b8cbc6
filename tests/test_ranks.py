"""A call that needs every rank, made on some ranks only, ends with an error naming it
(slapo_fn.ranks), on 2 gloo ranks."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from dist import WorkerPool, mesh
from torch import nn

import slapo_fn as sf
from slapo_fn import ranks


def _alone(rank: int, world_size: int) -> str:
    """Rank 0 calls sf.verify, rank 1 does not: rank 0's call ends within the timeout."""
    if rank != 0:
        return ""
    waited = ranks._group_timeout
    ranks._group_timeout = lambda: timedelta(seconds=2)  # type: ignore[assignment]  # the pool's is 30 s
    try:
        sch = sf.shard(sf.create_schedule(nn.Sequential(nn.Linear(4, 4)), mesh=mesh((2,), ("tp",))), "0", axis=0)
        sf.verify(sch, torch.ones(2, 4))
    except ranks.PartialCallError as e:
        return str(e)
    finally:
        ranks._group_timeout = waited  # type: ignore[assignment]
    return "no error"


def _together(rank: int, world_size: int) -> Any:
    ranks.every_rank("test.together", timeout=timedelta(seconds=20))
    return rank


def test_a_call_made_on_one_rank_only_names_itself_and_the_missing_rank(dist2: WorkerPool) -> None:
    said = dist2.run(_alone, timeout=60)[0]
    assert said == ("sf.verify needs every rank of the process group, and rank 1 did not call it within 2 s (the "
                    "process group's timeout); fix: call it on every rank (not under `if rank == 0:`), and print on "
                    "one"), said
    assert dist2.run(_together, timeout=60) == [0, 1]  # the failed call left nothing behind
