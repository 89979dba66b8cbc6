"""The multi-process harness itself: results, errors, timeouts (children killed), reuse."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from dist import DistTimeout, RankError, WorkerPool, mesh

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _all_reduce(rank: int, world_size: int, scale: float) -> tuple[float, int]:
    t = torch.tensor([float(rank + 1) * scale])
    dist.all_reduce(t)
    return t.item(), os.getpid()


def _raise_on_one(rank: int, world_size: int) -> None:
    if rank == world_size - 1:
        raise ValueError(f"boom on {rank}")
    dist.barrier()  # the others wait for a peer that never comes


def _hang(rank: int, world_size: int) -> None:
    time.sleep(3600)


def _mesh_shape(rank: int, world_size: int) -> tuple[tuple[int, ...], int]:
    m = mesh((2, world_size // 2), ("dp", "tp"))
    return tuple(m.shape), m["tp"].get_local_rank()


@pytest.mark.parametrize("n", [2, 4])
def test_collective_and_reuse(dist_pool, n: int) -> None:
    pool = dist_pool(n)
    first = pool.run(_all_reduce, 1.0, timeout=30)
    second = pool.run(_all_reduce, 2.0, timeout=30)
    total = n * (n + 1) / 2
    assert [v for v, _ in first] == [total] * n
    assert [v for v, _ in second] == [2 * total] * n
    assert [p for _, p in first] == [p for _, p in second]  # the same worker processes


def test_two_d_mesh(dist4) -> None:
    assert dist4.run(_mesh_shape, timeout=30) == [((2, 2), 0), ((2, 2), 1), ((2, 2), 0), ((2, 2), 1)]


def test_rank_error_names_rank_and_pool_recovers(dist_pool) -> None:
    pool = dist_pool(2)
    with pytest.raises(RankError, match=r"boom on 1"):
        pool.run(_raise_on_one, timeout=30)
    pool = dist_pool(2)  # a fresh pool if that one had to be killed
    assert [v for v, _ in pool.run(_all_reduce, 1.0, timeout=30)] == [3.0, 3.0]


def test_timeout_kills_every_child() -> None:
    pool = WorkerPool(2)
    pids = pool.pids
    start = time.monotonic()
    with pytest.raises(DistTimeout, match=r"did not answer within 2 s"):
        pool.run(_hang, timeout=2)
    assert time.monotonic() - start < 15
    assert not pool.alive
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
