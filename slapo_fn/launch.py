"""A job on local processes that never outlives its launcher, and says what went wrong once.

:func:`launch` runs ``python -m slapo_fn.cli ARGV`` on ``nproc`` local processes through
torchrun's elastic agent and returns an :class:`Outcome`. The processes::

    launcher  (the caller of launch)      SIGINT, SIGTERM and SIGHUP stop the whole job
      └─ agent  python -m slapo_fn.launch   torchrun's agent, in a session of its own;
         │                                  gets SIGTERM if the launcher dies, however it dies
         └─ workers  python -m slapo_fn.cli   one per rank, each in a session of its own,
                                              PIDs written to ``pid-<rank>`` in the run folder

Whatever way the job ends — success, a failed or killed rank, a signal to the launcher —
no worker is left running when :func:`launch` returns: the launcher asks the agent to
stop its workers, then kills every process it saw below the agent and every PID the
workers wrote.

The agent is torchrun itself (``torch.distributed.run``), with two differences: its
logs stay quiet, and instead of a ``ChildFailedError`` traceback (40 lines and more) or
a ``SignalException`` traceback it leaves one line in the run folder, e.g. ``rank 1
(pid 4242) was killed by SIGKILL``, and exits with the failed rank's code. A worker that
refuses its input records the message there too (:func:`slapo_fn.processes.record_error`),
so that the launcher prints it once rather than once per rank.

:func:`run` is the launch of ``slapo-fn train`` and ``verify`` on several processes: it says
how a failed job ended in one line. This module imports torch (torchrun); ``slapo_fn.cli``
imports it only to start a job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from .processes import (
    LAUNCHER_ENV,
    RUN_DIR_ENV,
    WORKER_ENV,
    clear_run_dir,
    descendants,
    die_with_parent,
    kill,
    lost_peers,
    rank_log,
    recorded_errors,
    recorded_failure,
    wait_gone,
    worker_pids,
)

__all__ = ["STOP_SIGNALS", "Nodes", "Outcome", "agent", "describe", "launch", "root_cause", "run"]

#: The signals that stop a job when its launcher gets them (Ctrl-C, ``kill``, a closed terminal).
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Seconds the agent has to stop its workers before it is killed.
STOP_TIMEOUT_S = 10.0
#: The file in the run folder where the agent says which rank failed first and how.
FAILURE_FILE = "failure"
#: torchrun's loggers: the agent's warnings and errors repeat what the outcome says.
_TORCHRUN_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")


@dataclass(frozen=True)
class Outcome:
    """How a job ended.

    ``code``: its exit code (0 on success; the first failed rank's code, or 128 + the
    signal that killed it; 128 + the signal that stopped the launcher or the agent).
    ``errors``: the distinct messages of ranks that refused their input, in rank order.
    ``failure``: one line on how it failed (``""`` if it did not, or if its ranks refused
    their input: ``errors`` then say why): the first failed rank, its exit code or signal
    and the first line of its error, or how the agent ended.
    ``stopped_by``: the signal that stopped the launcher, if one did. ``logs``: the
    failed rank's whole output, where it has one.
    """

    code: int
    errors: tuple[str, ...] = ()
    failure: str = ""
    stopped_by: signal.Signals | None = None
    logs: Path | None = None


@dataclass(frozen=True)
class Nodes:
    """A job over several machines: ``count`` nodes, this one of rank ``rank``; the ranks
    meet at ``master_addr:master_port`` on node 0 (torchrun's static rendezvous, its
    TCP store hosted by node 0's agent). Every node runs the same command.

    >>> Nodes(2, 1, "10.0.0.1", 29500).torchrun_args()
    ['--nnodes=2', '--node-rank=1', '--master-addr=10.0.0.1', '--master-port=29500']
    """

    count: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def torchrun_args(self) -> list[str]:
        if self.count == 1:
            return ["--standalone"]
        return [f"--nnodes={self.count}", f"--node-rank={self.rank}", f"--master-addr={self.master_addr}",
                f"--master-port={self.master_port}"]


def launch(argv: Sequence[str], nproc: int, run_dir: str | os.PathLike[str] | None = None, *,
           nodes: Nodes | None = None) -> Outcome:
    """Run ``python -m slapo_fn.cli argv`` on ``nproc`` local processes (torchrun) and
    wait for it; SIGINT, SIGTERM or SIGHUP to this process stop the job. With ``nodes``
    this machine is one node of several (the others run the same command with their own
    rank): ``nproc`` is this node's share. PIDs, refusals, failure lines and each rank's
    output (``rank-<rank>.log``) go under ``run_dir`` (default: a temporary folder, removed
    afterwards unless the job failed). No worker of this node outlives this call."""
    own_dir = run_dir is None
    folder = Path(tempfile.mkdtemp(prefix="slapo-fn-run-") if run_dir is None else run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    clear_run_dir(folder)
    (folder / FAILURE_FILE).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "slapo_fn.launch", *(nodes or Nodes()).torchrun_args(), f"--nproc-per-node={nproc}",
           "--max-restarts=0", "--monitor-interval=0.5", "-m", "slapo_fn.cli", *argv]
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", threads),
               **{WORKER_ENV: "1", RUN_DIR_ENV: str(folder), LAUNCHER_ENV: str(os.getpid())})
    env.setdefault("PYTHONUNBUFFERED", "1")
    job = _Job()
    outcome = Outcome(1)
    try:
        with _handling(STOP_SIGNALS, job.stop):
            try:
                proc = subprocess.Popen(cmd, env=env, start_new_session=True)
                job.start(proc)
                code = proc.wait()
            finally:
                job.end(folder)
        if job.stopped_by is not None:
            outcome = Outcome(128 + job.stopped_by, recorded_errors(folder), stopped_by=job.stopped_by)
        else:
            outcome = _outcome(folder, code, proc.pid)
        return outcome
    finally:
        if own_dir and (outcome.code == 0 or outcome.logs is None):
            shutil.rmtree(folder, ignore_errors=True)


def _outcome(folder: Path, code: int, agent_pid: int) -> Outcome:
    """How the job ended, from the agent's exit code and what it and the ranks left in
    ``folder``: the agent's line on the first failed rank, with the first line of that
    rank's error; or how the agent itself ended (a signal from elsewhere)."""
    errors = recorded_errors(folder)
    if code == 0 or errors:
        return Outcome(code, errors)
    try:
        said = json.loads((folder / FAILURE_FILE).read_text())
    except (OSError, ValueError):
        said = None
    if isinstance(said, dict) and isinstance(said.get("rank"), int):
        rank = said["rank"]
        why = recorded_failure(folder, rank)
        log = rank_log(folder, rank)
        return Outcome(code, failure=str(said["text"]) + (f": {why}" if why else ""),
                       logs=log if log.is_file() else None)
    if isinstance(said, dict):
        return Outcome(code, failure=str(said.get("text")))
    if code < 0:  # the agent itself was killed, and could say nothing
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        return Outcome(128 - code, failure=f"the torchrun agent (pid {agent_pid}) was killed by {name}")
    return Outcome(code, failure=f"the torchrun agent (pid {agent_pid}) exited with code {code}")


def run(command: str, argv: Sequence[str], nproc: int, run_dir: str | os.PathLike[str] | None = None, *,
        nodes: Nodes | None = None) -> int:
    """``slapo-fn COMMAND`` on ``nproc`` local processes (:func:`launch`); says how it
    ended if it failed, once, on stderr: the ranks' refusal of their input (exit code 2),
    the first failed rank, or the signal that stopped the launcher. Returns the exit code."""
    outcome = launch(argv, nproc, run_dir, nodes=nodes)
    if outcome.stopped_by is not None:
        print(f"slapo-fn {command}: stopped by {outcome.stopped_by.name}; every worker is stopped",
              file=sys.stderr, flush=True)
    elif outcome.errors:
        print("\n".join(outcome.errors), file=sys.stderr, flush=True)
        return 2
    elif outcome.code and outcome.failure:
        logs = f"; its output: {outcome.logs}" if outcome.logs is not None else ""
        print(f"slapo-fn {command}: {outcome.failure}; every worker is stopped{logs}", file=sys.stderr, flush=True)
    return outcome.code


class _Job:
    """The agent of a launch, and how to stop it. The launcher's signal handler is
    :meth:`stop`: it never raises (an exception could land anywhere, the clean-up
    included); it asks the agent to stop its workers and has it killed if it has not
    stopped within :data:`STOP_TIMEOUT_S`. The launcher meanwhile just waits."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopped_by: signal.Signals | None = None
        self._deadline: threading.Timer | None = None

    def start(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        if self.stopped_by is not None:  # the signal came while the agent was starting
            self._signal(signal.SIGTERM)

    def stop(self, signum: int, frame: FrameType | None = None) -> None:
        if self.stopped_by is None:
            self.stopped_by = signal.Signals(signum)
            self._deadline = threading.Timer(STOP_TIMEOUT_S, self._signal, (signal.SIGKILL,))
            self._deadline.daemon = True
            self._deadline.start()
        self._signal(signal.SIGTERM)

    def _signal(self, sig: signal.Signals) -> None:
        """``sig`` to the agent's process group (its workers have sessions of their own)."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def end(self, folder: Path) -> None:
        """Make sure that neither the agent nor any of its workers survives. The
        processes below the agent are listed first: once it is gone, its workers are
        orphans that parent links no longer lead to."""
        if self._deadline is not None:
            self._deadline.cancel()
        if self.proc is None:
            return
        seen = descendants(self.proc.pid) | worker_pids(folder)
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        seen |= worker_pids(folder)  # a worker that wrote its PID meanwhile
        kill(seen)
        wait_gone(seen, timeout=STOP_TIMEOUT_S)


@contextlib.contextmanager
def _handling(signals: Sequence[signal.Signals], handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """``handler`` handles ``signals`` within the block. Python runs handlers in the main
    thread only: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# -- the agent ----------------------------------------------------------------------------------
def agent(argv: Sequence[str]) -> int:
    """torchrun (``argv`` are its arguments) as a launcher's agent: dies with the
    launcher, logs nothing, and reports the first failed rank as one line in the run
    folder instead of a traceback. Returns the exit code: 0, the failed rank's code (128 +
    the signal that killed it), or 128 + the signal that stopped the agent."""
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if launcher.isdigit():
        die_with_parent(signal.SIGTERM, int(launcher))
    _quiet(_TORCHRUN_LOGGERS)
    _continue_stopped_workers()
    run_dir = os.environ.get(RUN_DIR_ENV)
    rank: int | None = None
    try:
        torchrun.run(torchrun.parse_args(list(argv)))
    except ChildFailedError as failed:
        rank, first = root_cause(failed.failures, lost_peers(Path(run_dir)) if run_dir else ())
        text, code = describe(rank, first)
    except SignalException as stop:  # the launcher, or someone else, stopped the job: the workers are stopped
        sig = signal.Signals(int(stop.sigval))
        text, code = f"the torchrun agent (pid {os.getpid()}) was stopped by {sig.name}", 128 + int(sig)
    except Exception as e:  # the agent itself failed (rendezvous, arguments): one line, not its traceback
        text, code = f"torchrun could not run the job: {type(e).__name__}: {e}", 1
    else:
        return 0
    if run_dir:
        Path(run_dir, FAILURE_FILE).write_text(json.dumps({"rank": rank, "text": text}) + "\n")
    else:
        print(f"slapo-fn: {text}", file=sys.stderr, flush=True)
    return code


def root_cause(failures: Mapping[int, ProcessFailure], lost: Collection[int] = ()) -> tuple[int, ProcessFailure]:
    """The rank that failed first, of ``failures`` (global rank → failure) — the one to
    report. torchrun times failures to the second and lists those seen in one poll by
    rank, so a rank that lost its peer may look as early as the peer; within the earliest
    second, a rank killed by a signal comes first (a crash, the OOM killer, ``kill -9``),
    then one that exited non-zero on its own, then one that exited because a peer went
    missing (the ranks in ``lost``, as they recorded it), then one stopped by SIGTERM (the
    agent stops the others so).

    >>> from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    >>> lost_peer = ProcessFailure(local_rank=0, pid=7, exitcode=1, error_file="")
    >>> killed = ProcessFailure(local_rank=1, pid=8, exitcode=-9, error_file="")
    >>> root_cause({0: lost_peer, 1: killed})[0]
    1
    >>> exited = ProcessFailure(local_rank=1, pid=8, exitcode=3, error_file="")
    >>> root_cause({0: lost_peer, 1: exited}, lost={0})[0]
    1
    """
    def order(item: tuple[int, ProcessFailure]) -> tuple[int, int, int]:
        rank, failure = item
        kind = (3 if failure.exitcode == -signal.SIGTERM else 0 if failure.exitcode < 0 else 2 if rank in lost
                else 1)
        return failure.timestamp, kind, rank

    return min(failures.items(), key=order)


def describe(rank: int, failure: ProcessFailure) -> tuple[str, int]:
    """One line on a failed rank and the exit code that stands for it (a signal ``s``
    as ``128 + s``, as shells do).

    >>> from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    >>> describe(1, ProcessFailure(local_rank=1, pid=42, exitcode=-9, error_file=""))
    ('rank 1 (pid 42) was killed by SIGKILL', 137)
    >>> describe(0, ProcessFailure(local_rank=0, pid=7, exitcode=3, error_file=""))
    ('rank 0 (pid 7) exited with code 3', 3)
    """
    if failure.exitcode < 0:
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = f"signal {-failure.exitcode}"
        return f"rank {rank} (pid {failure.pid}) was killed by {name}", 128 - failure.exitcode
    return f"rank {rank} (pid {failure.pid}) exited with code {failure.exitcode}", failure.exitcode or 1


def _continue_stopped_workers() -> None:
    """Have torchrun's agent send ``SIGCONT`` after the signal that stops a worker: a
    stopped worker (``SIGSTOP``, a debugger) only acts on ``SIGTERM`` once continued, and
    the agent would otherwise wait 30 s for it before killing it."""
    close = SubprocessHandler.close

    def close_and_continue(self: SubprocessHandler, death_sig: signal.Signals | None = None) -> None:
        close(self, death_sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGCONT)

    SubprocessHandler.close = close_and_continue  # type: ignore[method-assign]


def _quiet(names: Sequence[str]) -> None:
    """Keep the records of the loggers ``names`` (and of the loggers below them) from
    every handler: ancestors' handlers are reached only through ``propagate``, and a
    ``NullHandler`` keeps ``logging.lastResort`` from printing them instead."""
    for name in names:
        logger = logging.getLogger(name)
        logger.propagate = False
        logger.addHandler(logging.NullHandler())


if __name__ == "__main__":
    raise SystemExit(agent(sys.argv[1:]))
