"""One writer per checkpoint directory: :func:`acquire` takes an exclusive lock on it.

The lock is a file, ``LOCK``, in the directory, held with ``flock`` for as long as the
run lasts and naming its holder: host, PID, the process's start (its ticks since boot in
``/proc``, so that a reused PID is not taken for the holder) and the wall-clock time it
took the lock. A second run is refused with a :class:`LockedError` naming the holder. The
kernel drops an ``flock`` when its process dies, however it dies; the file then still
names the dead holder, and the next run on the same host takes the lock over (the
returned lock's ``took_over`` says from whom). A holder on another host cannot be asked
whether it runs: its lock is refused until it is removed by hand.

>>> import tempfile
>>> folder = tempfile.mkdtemp()
>>> lock = acquire(folder)
>>> try:
...     acquire(folder)
... except LockedError as e:
...     print(e.holder.pid == os.getpid())
True
>>> lock.release()
>>> acquire(folder).release()
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import Problem, ScheduleError
from .processes import alive

__all__ = ["LOCK", "DirectoryLock", "Holder", "LockedError", "acquire"]

#: The lock file of a directory.
LOCK = "LOCK"


@dataclass(frozen=True)
class Holder:
    """The process that holds (or held) a directory's lock."""

    host: str
    pid: int
    started: float  # wall-clock seconds when it took the lock
    ticks: int | None = None  # the process's start, in clock ticks since boot (Linux)

    def __str__(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host} (holding it since {when})"

    @staticmethod
    def me() -> Holder:
        return Holder(socket.gethostname(), os.getpid(), time.time(), _start_ticks(os.getpid()))

    def runs(self) -> bool | None:
        """Whether this holder still runs: ``None`` where that cannot be told (another host)."""
        if self.host != socket.gethostname():
            return None
        if not alive(self.pid):
            return False
        ticks = _start_ticks(self.pid)
        return self.ticks is None or ticks is None or ticks == self.ticks  # else: the PID was reused


class LockedError(ScheduleError):
    """The directory's lock is held by another run (``holder``), or by one on another
    host that may still run. A ``ValueError``: the command line refuses it before any
    rank starts."""

    def __init__(self, directory: Path, holder: Holder | None, reason: str) -> None:
        fix = ("wait for that run to end, or give this one another --checkpoint-dir"
               + (f"; if that run is gone, remove {directory / LOCK}" if holder is None or holder.runs() is None
                  else ""))
        super().__init__("lock", [Problem(str(directory), reason, fix)])
        self.holder = holder


class DirectoryLock:
    """A held lock; :meth:`release` (or leaving a ``with`` block) gives it back and
    removes the file. ``took_over``: the dead holder whose lock this one took, if any."""

    def __init__(self, directory: Path, fd: int, holder: Holder, took_over: Holder | None) -> None:
        self.directory, self.holder, self.took_over = directory, holder, took_over
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if _read(self.directory / LOCK) == self.holder:
                (self.directory / LOCK).unlink()
        os.close(self._fd)  # drops the flock
        self._fd = None

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(directory: str | os.PathLike[str]) -> DirectoryLock:
    """Take ``directory``'s lock (creating the directory), or raise :class:`LockedError`
    naming its holder."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(root / LOCK)
            raise LockedError(root, holder, f"is in use by another run: {holder or 'a process that is starting'}"
                              ) from None
        before = _read(root / LOCK)
        if before is not None and before.runs() is not False:
            reason = (f"is locked by {before}, which still runs" if before.runs() else
                      f"is locked by {before}, a host this run cannot ask whether it still runs")
            raise LockedError(root, before, reason)
        me = Holder.me()
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(me)).encode(), 0)
        os.fsync(fd)
        return DirectoryLock(root, fd, me, before)
    except BaseException:
        os.close(fd)
        raise


def _read(file: Path) -> Holder | None:
    """The holder ``file`` names, or ``None`` (empty, unreadable, or not a lock's)."""
    try:
        data = json.loads(file.read_text())
        return Holder(str(data["host"]), int(data["pid"]), float(data["started"]),
                      None if data.get("ticks") is None else int(data["ticks"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``'s 22nd
    field), or ``None`` without ``/proc``."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None
