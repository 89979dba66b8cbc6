"""Process bookkeeping for the launcher and the tuner: no worker is ever left behind.

torchrun starts its workers in sessions of their own, so killing the launcher's process
group does not reach them. Workers write their PIDs to ``pid-<rank>`` files in the run
folder, and parent links in ``/proc`` find the rest.

>>> import os
>>> alive(os.getpid())
True
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from pathlib import Path

__all__ = ["alive", "descendants", "kill", "worker_pids"]


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
    for path in run_dir.glob("pid-*"):
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
