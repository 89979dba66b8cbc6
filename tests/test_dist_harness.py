"""The multi-process harness itself: results, errors, timeouts (children killed), reuse."""

from __future__ import annotations

import os
import signal
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


def _crash_once(rank: int, world_size: int, flag: str) -> float:
    """Rank 1 dies by SIGSEGV the first time (``flag`` not there yet), as a native crash would."""
    if rank == 1 and not os.path.exists(flag):
        open(flag, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _crash_always(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


def test_a_rank_killed_natively_is_run_again_once_on_a_fresh_pool(tmp_path, capfd) -> None:
    pool = WorkerPool(2)
    try:
        first_pids = pool.pids
        assert pool.run(_crash_once, str(tmp_path / "crashed"), timeout=60) == [3.0, 3.0]
        assert pool.alive and set(pool.pids).isdisjoint(first_pids)  # a fresh pool ran it
        assert "killed by signal(s) [11]" in capfd.readouterr().err
        with pytest.raises(RankError, match=r"raised on rank\(s\) \[0, 1\]"):  # twice: raised, pool killed
            pool.run(_crash_always, timeout=60)
        assert pool.crashed == {1: -11} and not pool.alive
    finally:
        pool.kill()
