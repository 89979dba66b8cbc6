"""Process bookkeeping for the launcher and the tuner: no worker is ever left behind.

torchrun starts its workers in sessions of their own, so killing the launcher's process
group does not reach them. Workers write their PIDs to ``pid-<rank>`` files in the run
folder, and parent links in ``/proc`` find the rest. A worker that refuses its input
writes the message to ``error-<rank>`` there instead of printing it, so that the
launcher says it once (:func:`record_error`, :func:`recorded_errors`); a worker that fails
leaves the first line of its error in ``failed-<rank>`` (:func:`record_failure`; a rank
that failed because another one went missing also leaves ``lost-peer-<rank>``, so that the
launcher names the rank that caused it) and its whole output in ``rank-<rank>.log``
(:func:`rank_log`). The launcher tells
its workers where that folder is, and that they are workers, through the environment
(:data:`RUN_DIR_ENV`, :func:`in_worker`).

>>> import os
>>> alive(os.getpid())
True
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "LAUNCHER_ENV",
    "RUN_DIR_ENV",
    "alive",
    "clear_run_dir",
    "descendants",
    "die_with_parent",
    "in_worker",
    "kill",
    "lost_peers",
    "rank_log",
    "record_error",
    "record_failure",
    "record_pid",
    "recorded_errors",
    "recorded_failure",
    "wait_gone",
    "worker_pids",
]

#: Files a run leaves in its run folder, by rank: worker PIDs, refused-input messages, the
#: first line of a failure's error, and the rank's output.
_PID, _ERROR, _FAILED, _LOST, _LOG = "pid-", "error-", "failed-", "lost-peer-", "rank-{rank}.log"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: Environment variables a launcher sets for its processes: the run folder, the launcher's
#: PID (its agent dies with it), and that a process is a worker of a launch.
RUN_DIR_ENV, LAUNCHER_ENV, WORKER_ENV = "SLAPO_FN_RUN_DIR", "SLAPO_FN_LAUNCHER_PID", "SLAPO_FN_WORKER"


def in_worker() -> bool:
    """Whether this process is a rank of a job (started by torchrun, or by a launch)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get(WORKER_ENV) == "1"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc to ask: the signal test said it exists


def worker_pids(run_dir: Path) -> set[int]:
    """The PIDs the workers of a run wrote under ``run_dir``."""
    pids = set()
    for path in run_dir.glob(f"{_PID}*"):
        with contextlib.suppress(ValueError, OSError):
            pids.add(int(path.read_text()))
    return pids


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``, found by parent links (sessions and process groups
    do not find torchrun's workers)."""
    if not Path("/proc").is_dir():
        return set()
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill(pids: Iterable[int]) -> None:
    """SIGKILL each of ``pids`` that still runs."""
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def wait_gone(pids: Iterable[int], timeout: float = 10.0) -> bool:
    """Wait up to ``timeout`` seconds until none of ``pids`` runs; whether none does."""
    left = set(pids)
    deadline = time.monotonic() + timeout
    while True:
        left = {p for p in left if alive(p)}
        if not left or time.monotonic() >= deadline:
            return not left
        time.sleep(0.05)


def clear_run_dir(run_dir: Path) -> None:
    """Remove what an earlier run left in ``run_dir`` (PID, error and failure files, logs)."""
    for pattern in (f"{_PID}*", f"{_ERROR}*", f"{_FAILED}*", f"{_LOST}*", _LOG.format(rank="*")):
        for stale in run_dir.glob(pattern):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()


def record_pid(run_dir: Path, rank: int) -> None:
    """Leave this process's PID for the launcher, which kills it if it outlives the job."""
    Path(run_dir, f"{_PID}{rank}").write_text(str(os.getpid()))


def record_error(run_dir: Path, rank: int, message: str) -> None:
    """Leave ``message`` (why rank ``rank`` refused its input) for the launcher; written
    whole or not at all (a rename), so the launcher never reads half a message."""
    _write_whole(run_dir / f"{_ERROR}{rank}", message)


def rank_log(run_dir: Path, rank: int) -> Path:
    """The file where rank ``rank`` of a launch writes its output (its whole errors included)."""
    return Path(run_dir, _LOG.format(rank=rank))


def record_failure(run_dir: Path, rank: int, line: str, *, lost_peer: bool = False) -> None:
    """Leave the one line that says why rank ``rank`` failed, for the launcher, and
    whether it failed because a peer went missing (a consequence, not the cause)."""
    if lost_peer:
        Path(run_dir, f"{_LOST}{rank}").touch()
    _write_whole(Path(run_dir, f"{_FAILED}{rank}"), line)


def lost_peers(run_dir: Path) -> frozenset[int]:
    """The ranks that recorded a failure caused by a peer that went missing.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     record_failure(Path(folder), 0, "rank 1 did not arrive", lost_peer=True)
    ...     record_failure(Path(folder), 1, "ValueError: bad")
    ...     sorted(lost_peers(Path(folder)))
    [0]
    """
    return frozenset(int(f.name[len(_LOST):]) for f in Path(run_dir).glob(f"{_LOST}*")
                     if f.name[len(_LOST):].isdigit())


def recorded_failure(run_dir: Path, rank: int) -> str:
    """The line rank ``rank`` left on its failure, or ``""``."""
    try:
        return Path(run_dir, f"{_FAILED}{rank}").read_text().strip()
    except OSError:
        return ""


def _write_whole(file: Path, text: str) -> None:
    """Write ``text`` to ``file`` whole or not at all (a rename): a reader never sees half."""
    tmp = file.with_name(f".{file.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, file)


def recorded_errors(run_dir: Path) -> tuple[str, ...]:
    """The distinct messages the ranks of a run recorded, in rank order (ranks refusing
    the same input say the same thing: it is said once).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     for rank in (1, 0, 2):
    ...         record_error(Path(folder), rank, "--tp 3: bad" if rank < 2 else "other")
    ...     recorded_errors(Path(folder))
    ('--tp 3: bad', 'other')
    """
    found: dict[int, str] = {}
    for path in run_dir.glob(f"{_ERROR}*"):
        rank = path.name.removeprefix(_ERROR)
        if rank.isdigit():
            with contextlib.suppress(OSError):
                found[int(rank)] = path.read_text()
    return tuple(dict.fromkeys(found[r] for r in sorted(found)))


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits, however the
    parent ends (Linux ``prctl(PR_SET_PDEATHSIG)``); ``False`` where that is not
    available. With ``parent`` (the PID the parent had), a parent that died before this
    call sends ``sig`` at once. Call it from the main thread of a process that its
    parent started from its main thread: the kernel watches the starting thread."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True
