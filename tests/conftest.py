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

Test files sit in folders named like the package's (``tests/dtensor/``, ``tests/rewrites/graph/``,
...); helpers stay in tests/. Every test file's basename is unique (see ``_test_folders``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import pytest
from hypothesis import settings

_TESTS = os.path.dirname(os.path.abspath(__file__))


def _test_folders(root: str) -> list[str]:
    """``root`` and every folder under it (``tests/dtensor``, ``tests/rewrites/graph``, ...)."""
    folders = []
    for folder, subfolders, _ in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith((".", "__")))
        folders.append(folder)
    return folders


# Helpers (``dist``, ``models``, ``tp_checks``, ``fingerprint``) import by basename from
# tests/, and so do test modules (no ``__init__.py``: basenames are unique across folders).
# Every test folder goes on sys.path now, before any worker pool is spawned: spawned ranks
# copy this sys.path and unpickle a test's module-level functions by the module's basename,
# whichever folder's test started the pool.
_seen: dict[str, str] = {}
for _folder in _test_folders(_TESTS):
    for _name in sorted(n for n in os.listdir(_folder) if n.endswith(".py") and n != "conftest.py"):
        if _name in _seen:
            raise pytest.UsageError(
                f"two files named {_name} under tests/ ({_seen[_name]}, {_folder}): "
                "modules import by basename, rename one"
            )
        _seen[_name] = _folder
for _folder in reversed(_test_folders(_TESTS)):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)

from dist import WorkerPool  # noqa: E402 (after the sys.path set-up above)

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
