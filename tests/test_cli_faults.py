"""Faults injected into ``slapo-fn train`` as real subprocesses (issue 38): a NaN learning
rate, a full disk, two writers on one checkpoint directory, a stopped (SIGSTOP) rank, a
launcher killed with SIGKILL whose lock the next run takes over, and a truncated train
state the resume falls back past, bit for bit. Each test checks the exit code, the one
line printed, the directory afterwards and, where it applies, the resumed losses. (A rank
killed with SIGKILL: ``test_cli.py``; 20 bit flips, each detected: ``test_train_guard.py``;
bad data files before spawn: ``test_cli_bad_input.py``.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from slapo_fn.checkpoint_dir import checkpoints, partials
from slapo_fn.lock import LOCK
from slapo_fn.processes import alive

CLI = [sys.executable, "-m", "slapo_fn.cli"]
ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "llama-tiny", "--seq", "16", "--batch", "4", "--no-progress", "--log-every", "1"]


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def said(stderr: str) -> list[str]:
    """The command's own lines on stderr (libraries may warn before them)."""
    return [line for line in stderr.splitlines() if line.startswith("slapo-fn")]


def metrics(file: Path) -> dict[int, dict[str, object]]:
    return {row["step"]: row for row in map(json.loads, file.read_text().splitlines())}


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def pids(run_dir: Path) -> dict[int, int]:
    return {int(p.name.removeprefix("pid-")): int(p.read_text()) for p in run_dir.glob("pid-*")}


def latest(ckpt: Path) -> str:
    return (ckpt / "LATEST").read_text().strip() if (ckpt / "LATEST").exists() else ""


@pytest.mark.timeout(240)
def test_a_full_disk_skips_a_save_and_a_nan_learning_rate_stops_the_job_in_one_line(tmp_path: Path) -> None:
    """Also the debugging tools on the same run: profiler traces of every 3rd step per
    rank, an offline Weights & Biases run, and --memory-snapshot saying it is CUDA-only."""
    ckpt, runs, log, traces = tmp_path / "ckpt", tmp_path / "run", tmp_path / "m.jsonl", tmp_path / "traces"
    result = run("train", *TINY, "--dp", "2", "--steps", "8", "--save-every", "2", "--checkpoint-dir", str(ckpt),
                 "--run-dir", str(runs), "--metrics", str(log), "--fault", "full-disk:3,nan:6",
                 "--profile-every", "3", "--profile-dir", str(traces), "--memory-snapshot", "--wandb", "faults",
                 "--wandb-dir", str(tmp_path / "wandb"))
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"slapo-fn train: step 4 not saved: 0.0 MiB free at {ckpt}, the checkpoint needs about " in result.stdout
    assert "; step-00000002 stays the newest" in result.stdout and "done:" not in result.stdout
    lines = said(result.stderr)
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("slapo-fn train: rank 0 (pid ") and "exited with code 1: step 6: loss " in lines[0]
    assert "lr nan is not finite: stopped before the optimizer update, nothing saved; the newest checkpoint is " \
           "step 2; every worker is stopped; its output: " in lines[0]
    assert "Traceback" not in result.stderr
    rows = metrics(log)  # valid JSON: null where a value is not finite
    assert sorted(rows) == [1, 2, 3, 4, 5, 6] and rows[6]["lr"] is None and rows[6]["skipped"] is True
    assert [c.name for c in checkpoints(ckpt)] == ["step-00000002"] and not partials(ckpt)
    assert not (ckpt / LOCK).exists()  # released
    assert "NonFiniteError" in (runs / "rank-0.log").read_text()  # the traceback is in the rank's log
    # every 3rd step's trace, and the failed step's, stopped short (the 6th: in the profiler's window)
    assert sorted(f.name for f in traces.iterdir()) == [f"rank-{r}-step-{s}.json" for r in (0, 1) for s in (3, 6)]
    assert json.loads((traces / "rank-1-step-3.json").read_text())["traceEvents"]  # Chrome trace: Perfetto opens it
    assert "slapo-fn train: --memory-snapshot is CUDA-only" in result.stdout
    assert len(list((tmp_path / "wandb").glob("wandb/offline-run-*/run-*.wandb"))) == 1


@pytest.mark.timeout(400)
def test_one_writer_a_dead_holder_a_truncated_train_state_and_a_stopped_rank(tmp_path: Path) -> None:
    """One directory through four faults: a second writer is refused; the first run's
    launcher is killed (SIGKILL), and the next run takes its lock over; that run resumes
    past a truncated train state, bit for bit, until one of its ranks is stopped (SIGSTOP)
    and the collective timeout names it."""
    ckpt, runs, log = tmp_path / "ckpt", tmp_path / "run", tmp_path / "first.jsonl"
    first = start("train", *TINY, "--dp", "2", "--steps", "12", "--save-every", "2", "--checkpoint-dir", str(ckpt),
                  "--run-dir", str(runs), "--metrics", str(log), "--fault", "hang:7")
    try:
        wait_for(lambda: latest(ckpt) == "step-00000006" and 6 in metrics(log), 150, "step 6's checkpoint")
        second = run("train", *TINY, "--steps", "4", "--checkpoint-dir", str(ckpt))
        assert second.returncode == 2, second.stderr[-3000:]
        text = second.stderr[second.stderr.index("slapo-fn"):]
        assert text.startswith(f"slapo-fn train: '--checkpoint-dir': {ckpt}: is in use by another run: pid "
                               f"{first.pid} on {os.uname().nodename} (holding it since "), text
        assert text.rstrip().endswith("fix: wait for that run to end, or give this one another --checkpoint-dir"), text
        assert len(text.strip().splitlines()) == 2 and not second.stdout, text
        workers = pids(runs)
        first.kill()  # SIGKILL to the launcher: its agent and workers follow it, its lock file stays
        first.wait(timeout=30)
        wait_for(lambda: not any(alive(p) for p in workers.values()), 30, "the workers to end")
    finally:
        if first.poll() is None:
            first.kill()
    assert (ckpt / LOCK).exists()
    state = ckpt / "step-00000006" / "train-state-1.pt"
    state.write_bytes(state.read_bytes()[:100])
    resumed_log, resumed_runs = tmp_path / "resumed.jsonl", tmp_path / "resumed-run"
    resumed = start("train", *TINY, "--dp", "2", "--steps", "100000", "--checkpoint-dir", str(ckpt), "--resume",
                    "--metrics", str(resumed_log), "--run-dir", str(resumed_runs), "--collective-timeout", "5")
    try:
        wait_for(lambda: resumed_log.exists() and 6 in metrics(resumed_log), 150, "the resumed run's step 6")
        workers = pids(resumed_runs)
        os.kill(workers[1], signal.SIGSTOP)
        stopped = time.monotonic()
        code = resumed.wait(timeout=90)
        assert time.monotonic() - stopped < 45  # the collective timeout, not the default 300 s
        out, err = (resumed.stdout.read() if resumed.stdout else ""), (resumed.stderr.read() if resumed.stderr else "")
        wait_for(lambda: not any(alive(p) for p in workers.values()), 15, "the workers to end")
    finally:
        if resumed.poll() is None:
            resumed.kill()
    assert f"slapo-fn train: took over the lock of {ckpt} from pid {first.pid} on " in out, out
    assert (f"slapo-fn train: resume: checkpoint step-00000006 is unusable: {state}: is truncated: 100 bytes where "
            "the manifest says ") in out, out
    assert "; loaded step-00000004, the newest that verifies" in out and "resumed from step 4" in out, out
    before, after = metrics(log), metrics(resumed_log)
    for step in (5, 6):  # bit for bit: model, optimizer, RNG and data position restored
        assert after[step]["loss"] == before[step]["loss"] and after[step]["grad_norm"] == before[step]["grad_norm"]
    assert code == 1, err[-3000:]
    lines = said(err)
    assert len(lines) == 1 and "rank 1 did not arrive at a collective within 5 s (--collective-timeout)" in lines[0], \
        err[-3000:]
    assert "done:" not in out and not (ckpt / LOCK).exists() and not partials(ckpt)


@pytest.mark.timeout(240)
def test_the_rank_that_exits_is_named_not_the_rank_that_lost_it(tmp_path: Path) -> None:
    """The last rank exits on its own after step 2; rank 0 then loses its peer in the next
    collective (gloo: "Connection reset by peer") and exits too, often within the same
    second. The one line names rank 1, the cause, twice in a row."""
    for attempt in range(2):
        runs = tmp_path / f"run-{attempt}"
        result = run("train", *TINY, "--tp", "2", "--steps", "6", "--run-dir", str(runs), "--fault", "exit:2")
        assert result.returncode == 3, result.stderr[-3000:]
        lines = said(result.stderr)
        assert len(lines) == 1 and lines[0].startswith("slapo-fn train: rank 1 (pid ") \
            and "exited with code 3" in lines[0], result.stderr[-3000:]
        assert "injected fault 'exit' on rank 1" in (runs / "rank-1.log").read_text()
