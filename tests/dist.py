"""A multi-process gloo harness for CPU tests: persistent worker pools, one per world size.

Launching ranks costs seconds (mostly imports), so a :class:`WorkerPool` starts its
``world_size`` processes once (``spawn``, never ``fork``), joins them in one gloo process
group with a short timeout, and then runs any number of picklable functions on them::

    def check(rank: int, world_size: int, x: int) -> int:   # module level: picklable
        return rank * x

    results = pool.run(check, 3, timeout=60)                 # [0, 3] on 2 ranks

Each call is time-bounded: if any rank does not answer in ``timeout`` seconds, every
child is killed by PID, the pool is marked dead (the fixture starts a fresh one for the
next test) and :class:`DistTimeout` is raised with what the ranks that answered said. If
a rank raises, its traceback is re-raised here as :class:`RankError`; the other ranks get
a few seconds to finish (they may be stuck in a collective the failing rank never
joined) before the pool is killed. Shut down cleanly: ``dist.barrier()`` then
``destroy_process_group()`` in every rank (a teardown without the barrier aborts now
and then), then a join with a deadline, then kill.

Worker-side helpers: :func:`mesh` returns a cached ``DeviceMesh`` (creating process
groups per test would pile them up in the persistent workers).

Pytest use (fixtures in ``conftest.py``): ``dist_pool(world_size)`` returns the
session's pool for that world size; ``dist2``/``dist4`` are shortcuts.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["DistTimeout", "RankError", "WorkerPool", "mesh", "rank_and_world"]

#: Seconds a collective may wait for a peer before the process group gives up.
PG_TIMEOUT_S = 30.0
#: Seconds to start a pool (spawn + imports + rendezvous).
START_TIMEOUT_S = 90.0
#: Seconds the other ranks get to finish after one rank failed.
GRACE_S = 5.0


class DistTimeout(AssertionError):
    """Some rank did not answer in time; every worker of the pool was killed."""


class RankError(AssertionError):
    """A function raised on some rank(s); ``tracebacks`` maps rank -> formatted traceback."""

    def __init__(self, message: str, tracebacks: dict[int, str]) -> None:
        self.tracebacks = tracebacks
        super().__init__(message)


@dataclass(frozen=True)
class _Ok:
    value: Any


@dataclass(frozen=True)
class _Err:
    traceback: str


_SHUTDOWN = "__shutdown__"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, conn: Connection) -> None:  # runs in the child
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    faulthandler.enable()  # a rank killed natively (SIGSEGV, SIGABRT) prints its Python stack
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
        conn.send(_Ok("ready"))
    except BaseException:
        conn.send(_Err(traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent went away
            os._exit(1)
        if message == _SHUTDOWN:
            break
        fn, args, kwargs = message
        try:
            result: _Ok | _Err = _Ok(fn(rank, world_size, *args, **kwargs))
        except BaseException:
            result = _Err(traceback.format_exc())
        try:
            conn.send(result)
        except Exception:  # an unpicklable result
            conn.send(_Err(traceback.format_exc()))
    dist.barrier()
    dist.destroy_process_group()
    conn.send(_Ok("bye"))


class WorkerPool:
    """``world_size`` persistent gloo ranks on this machine (see the module docstring)."""

    def __init__(self, world_size: int) -> None:
        if not 1 <= world_size <= 8:
            raise ValueError(f"world_size must be in 1..8, got {world_size}")
        self.world_size = world_size
        self.alive = False
        self.crashed: dict[int, int] = {}  # rank -> the signal that killed it during the last call
        ctx = get_context("spawn")
        port = _free_port()
        self._conns: list[Connection] = []
        self._procs: list[BaseProcess] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world_size, port, child), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self.alive = True
        answers = self._collect(START_TIMEOUT_S, "start")
        errors = {r: a.traceback for r, a in answers.items() if isinstance(a, _Err)}
        if errors:
            self.kill()
            raise RankError(f"pool of {world_size} failed to start", errors)

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self._procs if p.pid is not None)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0, **kwargs: Any) -> list[Any]:
        """``[fn(rank, world_size, *args, **kwargs) for rank in ranks]``, run concurrently.

        ``fn`` and its arguments must be picklable (a module-level function). Raises
        :class:`RankError` if any rank raised, :class:`DistTimeout` after ``timeout``
        seconds (all workers killed).

        A rank killed by a signal (a native crash in torch or gloo, as seen three times in
        many hundreds of calls: "malloc(): unaligned tcache chunk detected", a segfault
        inside gloo's all_gather) is no verdict on ``fn``: the call is run once more on a
        fresh pool, with a warning naming the signal (the dead rank's Python stack is on
        stderr, from faulthandler). A second crash, or any Python error, is raised; a pool
        with a dead rank is killed, so the next ``dist_pool`` call starts a new one.
        """
        try:
            return self._run(fn, args, kwargs, timeout)
        except (RankError, DistTimeout):
            crashed = dict(self.crashed)
            if any(not p.is_alive() for p in self._procs):
                self.kill()
            if not crashed:
                raise
        name = getattr(fn, "__qualname__", repr(fn))
        print(f"\ndist: rank(s) {sorted(crashed)} killed by signal(s) {sorted({-c for c in crashed.values()})} "
              f"during {name}; running it once more on a fresh pool", file=sys.stderr, flush=True)
        self.__init__(self.world_size)  # type: ignore[misc]
        try:
            return self._run(fn, args, kwargs, timeout)
        except (RankError, DistTimeout):
            if any(not p.is_alive() for p in self._procs):
                self.kill()
            raise

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float) -> list[Any]:
        if not self.alive:
            raise RuntimeError("this worker pool was killed; start a new one")
        self.crashed = {}
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        answers = self._collect(timeout, getattr(fn, "__qualname__", repr(fn)))
        errors = {r: a.traceback for r, a in answers.items() if isinstance(a, _Err)}
        if errors:
            first = min(errors)
            raise RankError(
                f"{getattr(fn, '__qualname__', fn)} raised on rank(s) {sorted(errors)}; rank {first}:\n{errors[first]}",
                errors,
            )
        return [answers[r].value for r in range(self.world_size)]  # type: ignore[union-attr]

    def _collect(self, timeout: float, what: str) -> dict[int, _Ok | _Err]:
        deadline = time.monotonic() + timeout
        answers: dict[int, _Ok | _Err] = {}
        while len(answers) < self.world_size:
            if any(isinstance(a, _Err) for a in answers.values()):
                deadline = min(deadline, time.monotonic() + GRACE_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            pending = [r for r in range(self.world_size) if r not in answers]
            for rank in pending:
                conn = self._conns[rank]
                if conn.poll(min(0.05, max(remaining, 0.0))):
                    try:
                        answers[rank] = conn.recv()
                    except EOFError:
                        answers[rank] = self._died(rank)
                elif not self._procs[rank].is_alive() and not conn.poll():
                    answers[rank] = self._died(rank)
        if len(answers) < self.world_size:
            missing = [r for r in range(self.world_size) if r not in answers]
            self.kill()
            errors = {r: a.traceback for r, a in answers.items() if isinstance(a, _Err)}
            if errors:
                first = min(errors)
                raise RankError(
                    f"{what} raised on rank(s) {sorted(errors)} and rank(s) {missing} did not finish; "
                    f"rank {first}:\n{errors[first]}",
                    errors,
                )
            raise DistTimeout(f"{what}: rank(s) {missing} did not answer within {timeout:.0f} s; pool killed")
        return answers

    def _died(self, rank: int) -> _Err:
        proc = self._procs[rank]
        proc.join(timeout=5)
        if proc.exitcode is not None and proc.exitcode < 0:
            self.crashed[rank] = proc.exitcode
        return _Err(f"rank {rank} died (exit code {proc.exitcode})")

    def kill(self) -> None:
        """Kill every worker by PID (no cleanup in the children)."""
        self.alive = False
        for proc in self._procs:
            if proc.pid is not None and proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        for proc in self._procs:
            proc.join(timeout=5)
        for conn in self._conns:
            conn.close()

    def close(self, timeout: float = 20.0) -> None:
        """Barrier + ``destroy_process_group`` in every rank, then join; kill what is left."""
        if not self.alive:
            return
        try:
            for conn in self._conns:
                conn.send(_SHUTDOWN)
            self._collect(timeout, "shutdown")
            for proc in self._procs:
                proc.join(timeout=max(0.0, timeout))
        except (AssertionError, OSError):
            pass
        finally:
            self.kill()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- worker side

_MESHES: dict[tuple[tuple[int, ...], tuple[str, ...]], Any] = {}


def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """A ``DeviceMesh`` of ``shape`` with ``names`` over all ranks, cached per worker."""
    key = (tuple(shape), tuple(names))
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[key] = init_device_mesh("cpu", key[0], mesh_dim_names=key[1])
    return _MESHES[key]


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the current process group."""
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()
