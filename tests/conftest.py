"""Shared pytest fixtures.

Distributed fixtures (multi-process gloo on CPU, see ``tests/dist.py``):

* ``dist_pool(world_size)`` — the session's persistent :class:`dist.WorkerPool` for that
  world size (2, 4 or up to 8 ranks), started on first use and restarted if a test killed
  it (timeout or a rank that failed mid-collective);
* ``dist2`` / ``dist4`` — shortcuts for 2 and 4 ranks.

A distributed test passes a module-level function ``fn(rank, world_size, *args)`` to
``pool.run(fn, *args, timeout=...)``; every call is time-bounded.

Hypothesis runs a fixed set of examples (``derandomize``), so that a test run is a
reproducible gate; ``HYPOTHESIS_PROFILE=explore`` searches new examples each run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import pytest
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

from dist import WorkerPool

settings.register_profile("gate", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gate"))


class _Pools:
    def __init__(self) -> None:
        self.pools: dict[int, WorkerPool] = {}

    def get(self, world_size: int) -> WorkerPool:
        pool = self.pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self.pools[world_size] = WorkerPool(world_size)
        return pool

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[Callable[[int], WorkerPool]]:
    """``dist_pool(n)`` -> the session's pool of ``n`` gloo ranks (started lazily, reused)."""
    pools = _Pools()
    try:
        yield pools.get
    finally:
        pools.close()


@pytest.fixture
def dist2(dist_pool: Callable[[int], WorkerPool]) -> WorkerPool:
    return dist_pool(2)


@pytest.fixture
def dist4(dist_pool: Callable[[int], WorkerPool]) -> WorkerPool:
    return dist_pool(4)
