"""One trial: a short ``slapo-fn train`` run of a candidate, in its own process tree.

:func:`train_args` turns a :class:`~slapo_fn.tune.space.Config` and the space's fixed
options into ``slapo-fn train`` flags — the same command a user runs, launched the same
way (``python -m slapo_fn.cli train …``, which relaunches itself under ``torchrun`` for
several ranks). :func:`run_trial` runs it with ``--metrics`` and ``--run-dir``, waits at
most ``timeout`` seconds, and whatever happens leaves no process behind: on a timeout it
interrupts the launcher (which stops torchrun and its workers), then kills every
descendant it can still see (``/proc``) and every worker PID written under the run
directory. A trial measures tokens/s (the median of the steps after ``warmup``) and the
peak memory of the most loaded rank (``torch.cuda.max_memory_allocated`` on GPUs; on CPU
the peak RSS from ``getrusage(RUSAGE_SELF)`` in each worker, and its growth since the
imports as ``train_mem_bytes``).

Example:
    >>> from slapo_fn.tune.space import Config
    >>> " ".join(train_args(Config.of({"tp": 2, "checkpoint": 1.0, "batch": 4}),
    ...                     {"model": "llama-tiny", "seq": 32, "steps": 3, "warmup": 1}))
    '--model llama-tiny --dp 1 --tp 2 --pp 1 --checkpoint 1.0 --batch 4 --seq 32 --steps 4'
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..processes import alive, descendants, worker_pids
from .space import DEFAULTS, Config, Value

__all__ = ["Status", "Trial", "reproduce_command", "run_trial", "train_args"]

Status = Literal["ok", "pruned", "crash", "oom", "timeout"]


@dataclass(frozen=True)
class Trial:
    """What one candidate gave: its status (``ok``, ``pruned`` by the memory estimate,
    ``crash``, ``oom`` or ``timeout``), the reason when not ``ok``, and its figures."""

    config: Config
    status: Status
    reason: str = ""
    tokens_per_s: float | None = None
    step_tokens_per_s: tuple[float, ...] = ()
    peak_mem_bytes: int | None = None
    train_mem_bytes: int | None = None
    estimate_bytes: int | None = None
    seconds: float = 0.0
    #: The cost model's tokens/s for this config (:func:`slapo_fn.tune.cost.estimate`).
    estimate_tokens_per_s: float | None = None
    command: tuple[str, ...] = field(default=(), compare=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def as_json(self) -> dict[str, Any]:
        return {"config": self.config.as_dict(), "status": self.status, "reason": self.reason,
                "tokens_per_s": self.tokens_per_s, "step_tokens_per_s": list(self.step_tokens_per_s),
                "peak_mem_bytes": self.peak_mem_bytes, "train_mem_bytes": self.train_mem_bytes,
                "estimate_bytes": self.estimate_bytes, "estimate_tokens_per_s": self.estimate_tokens_per_s,
                "seconds": round(self.seconds, 3),
                "command": list(self.command)}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def train_args(config: Config, fixed: Mapping[str, Any]) -> list[str]:
    """The ``slapo-fn train`` flags of ``config`` with the space's ``fixed`` options
    (``model``, ``seq``, ``steps`` measured after ``warmup`` steps, ``lr``, ``seed``).
    Knobs at their default are written only where they define the layout (dp/tp/pp)."""
    args = ["--model", str(fixed["model"])]
    for name in ("dp", "tp", "pp"):
        args += [_flag(name), str(config.num(name))]
    for name in ("sp", "kernels", "compile"):
        if config.get(name):
            args.append(_flag(name))
    values: dict[str, Value] = {n: config.get(n) for n in ("checkpoint", "microbatches", "batch", "dp_mode",
                                                           "schedule")}
    for name, value in values.items():
        if value is None or (value == DEFAULTS[name] and name != "batch"):
            continue
        if name in ("microbatches", "schedule") and config.num("pp") == 1:
            continue
        if name == "dp_mode" and config.num("dp") == 1:
            continue
        args += [_flag(name), str(value)]
    if "seq" in fixed:
        args += ["--seq", str(fixed["seq"])]
    if "steps" in fixed:
        args += ["--steps", str(int(fixed["steps"]) + int(fixed.get("warmup", 0)))]
    for name in ("lr", "seed"):
        if name in fixed:
            args += [_flag(name), str(fixed[name])]
    return args


def reproduce_command(config: Config, fixed: Mapping[str, Any]) -> str:
    """The ``slapo-fn train`` command that reruns ``config`` as its trial ran.

    >>> from slapo_fn.tune.space import Config
    >>> reproduce_command(Config.of({"dp": 2}), {"model": "llama-tiny", "steps": 3})
    'slapo-fn train --model llama-tiny --dp 2 --tp 1 --pp 1 --batch 8 --steps 3'
    """
    return " ".join(["slapo-fn", "train", *train_args(config, fixed)])


# -- processes --------------------------------------------------------------------------------
def _stop_tree(proc: subprocess.Popen[bytes], run_dir: Path) -> None:
    """Stop a trial and everything it started: SIGINT to the launcher (it stops torchrun and
    its workers itself), then SIGKILL to whatever is still alive."""
    seen = descendants(proc.pid) | worker_pids(run_dir)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    seen |= descendants(proc.pid) | worker_pids(run_dir)
    for pid in [proc.pid, *sorted(seen)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.1)


# -- reading the outcome --------------------------------------------------------------------------
_OOM = re.compile(r"out of memory|can't allocate memory|MemoryError|OutOfMemoryError|std::bad_alloc", re.I)
_OWN = re.compile(r"^(?:\[rank\d+\]: )?(slapo-fn[^:]*: .*)$", re.M)
_ERROR = re.compile(r"^(?:\[rank\d+\]: )?(\w+(?:Error|Exception): .*)$", re.M)
_CHILD = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def _reason(log: str, code: int) -> tuple[Status, str]:
    """Classify a failed run from its exit code and log: ``oom`` when an allocation failed
    (or the kernel's OOM killer struck), else ``crash``, with the most telling line: our own
    ``slapo-fn:`` message, else the first exception (the root cause; later ones are ranks
    losing their peer), else the last line."""
    oom = _OOM.search(log)
    if oom or code in (-signal.SIGKILL, 128 + signal.SIGKILL):
        line = next((ln for ln in log.splitlines() if _OOM.search(ln)), "")
        return "oom", line.strip()[:300] or f"killed (exit {code}), likely by the OOM killer"
    own = _OWN.findall(log)
    errors = [e for e in _ERROR.findall(log) if not e.startswith("ChildFailedError")]
    child = _CHILD.search(log)
    where = f" (rank {child.group(2)} exited {child.group(1)})" if child else ""
    text = own[0] if own else errors[0] if errors else (log.strip().splitlines() or [""])[-1]
    return "crash", f"exit {code}{where}: {text.strip()[:300]}"


def _figures(metrics: Path, warmup: int) -> tuple[tuple[float, ...], int | None, int | None]:
    rows = []
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    measured = tuple(float(r["tokens_per_s"]) for r in rows if int(r["step"]) > warmup)
    peaks = [int(r["peak_mem_bytes"]) for r in rows if "peak_mem_bytes" in r]
    grown = [int(r["train_mem_bytes"]) for r in rows if "train_mem_bytes" in r]
    return measured, max(peaks, default=None), max(grown, default=None)


def run_trial(config: Config, fixed: Mapping[str, Any], folder: Path, *, timeout: float,
              fault: str | None = None, python: Sequence[str] = (sys.executable,)) -> Trial:
    """Run ``config`` as ``python -m slapo_fn.cli train`` (``fixed["steps"]`` measured steps
    after ``fixed["warmup"]``) with its output, metrics and worker PIDs under ``folder``;
    at most ``timeout`` seconds. ``fault`` (``"exit:2"``, ``"hang:2"``) is passed as
    ``--fault`` to test failure handling. Never raises for a failed run: the
    :class:`Trial` says what happened; no process of the trial outlives this call."""
    folder.mkdir(parents=True, exist_ok=True)
    metrics, run_dir, log_path = folder / "metrics.jsonl", folder / "run", folder / "log.txt"
    metrics.unlink(missing_ok=True)
    args = [*train_args(config, fixed), "--no-progress", "--log-every", "1000000", "--metrics", str(metrics),
            "--run-dir", str(run_dir)]
    if fault:
        args += ["--fault", fault]
    cmd = [*python, "-m", "slapo_fn.cli", "train", *args]
    began = time.monotonic()
    status: Status = "ok"
    reason = ""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status, reason, code = "timeout", f"no result within {timeout:.0f} s", -1
        finally:
            _stop_tree(proc, run_dir)
    seconds = time.monotonic() - began
    warmup = int(fixed.get("warmup", 0))
    measured, peak, grown = _figures(metrics, warmup)
    if status == "ok" and code != 0:
        status, reason = _reason(log_path.read_text(errors="replace"), code)
    elif status == "ok" and not measured:
        status, reason = "crash", "exit 0 but no measured step (steps <= warmup?)"
    rate = statistics.median(measured) if status == "ok" else None
    return Trial(config, status, reason, rate, measured, peak, grown, None, seconds, command=tuple(cmd))
