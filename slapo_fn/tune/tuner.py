"""The search loop: constraints, then the cost model, then trials, under a budget.

:func:`tune` takes a :class:`~slapo_fn.tune.space.Space` and

1. enumerates its valid points (a :class:`~slapo_fn.tune.space.NoValidPointError` names
   the constraints when there are none: nothing impossible is ever run);
2. estimates each one's per-rank memory and step time (:func:`~slapo_fn.tune.cost.estimate`,
   fake process group, meta device, the CPU hardware profile), records those over
   ``memory_budget`` as ``pruned`` without running them (a :class:`NoValidPointError`
   again when none fits) and orders the rest by estimated tokens/s, fastest first;
3. asks the strategy for candidates and runs each as a trial
   (:func:`~slapo_fn.tune.trial.run_trial`), until the candidates, ``max_trials`` or
   ``time_budget`` seconds run out, or the best has not improved for ``patience`` trials.

Every trial (pruned, failed or measured) is in the returned :class:`TuneResult`, which
also tells how long the tuner itself took outside the trials (``overhead_s``).
``run`` replaces the trial runner (tests, or a simulated objective in benchmarks).

Example (a simulated objective: no process is started):
    >>> from slapo_fn.tune.space import space_for
    >>> from slapo_fn.tune.trial import Trial
    >>> space = space_for("llama-tiny", 2, sp=[False], checkpoint=[None, 1.0], batch=[2, 4])
    >>> def fake(config, folder):
    ...     speed = config.num("batch") * (2 if config.get("checkpoint") else 1) + config.num("tp")
    ...     return Trial(config, "ok", tokens_per_s=speed)
    >>> result = tune(space, run=fake)
    >>> len(result.trials), str(result.best.config)
    (8, 'dp=1 tp=2 pp=1 sp=false checkpoint=1.0 batch=4 dp_mode=fsdp kernels=false compile=false')
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..dtensor.testing import fake_world
from ..errors import Problem
from ..presets import build_model
from .cost import Estimate, estimate
from .space import Config, NoValidPointError, Space
from .strategy import Grid, Strategy
from .trial import Trial, reproduce_command, run_trial

__all__ = ["TuneResult", "summary", "tune"]

Runner = Callable[[Config, Path], Trial]


@dataclass(frozen=True)
class TuneResult:
    """Every trial in the order it was decided (pruned ones first), the best measured
    one, and where the time went."""

    space: Space
    strategy: str
    trials: tuple[Trial, ...]
    elapsed_s: float
    trial_s: float
    stopped: str
    memory_budget: int | None = None

    @property
    def best(self) -> Trial | None:
        ran = [t for t in self.trials if t.ok and t.tokens_per_s is not None]
        return max(ran, key=lambda t: t.tokens_per_s or 0.0) if ran else None

    @property
    def overhead_s(self) -> float:
        """Seconds the tuner spent outside trials (enumeration, estimates, strategy, reports)."""
        return self.elapsed_s - self.trial_s

    @property
    def best_command(self) -> str | None:
        best = self.best
        if best is None or "model" not in self.space.fixed:
            return None
        fixed = {k: v for k, v in self.space.fixed.items() if k != "world_size"}
        return reproduce_command(best.config, fixed)

    @property
    def trials_to_best(self) -> int | None:
        """How many trials ran (pruned ones not counted) until the best was first measured."""
        ran = [t for t in self.trials if t.status != "pruned"]
        best = self.best
        return None if best is None else ran.index(best) + 1


def _estimates(space: Space, points: tuple[Config, ...], seq: int) -> dict[Config, Estimate]:
    model, world = build_model(str(space.fixed["model"]), meta=True), int(space.fixed.get("world_size", 1))
    with fake_world(world):
        return {c: estimate(c, model, world_size=world, seq=seq) for c in points}


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def tune(space: Space, *, strategy: Strategy | None = None, memory_budget: int | None = None,
         max_trials: int | None = None, patience: int | None = None, time_budget: float | None = None,
         trial_timeout: float = 300.0, folder: Path | None = None, run: Runner | None = None,
         faults: Mapping[Config, str] | None = None,
         on_trial: Callable[[Trial, int, int], None] | None = None) -> TuneResult:
    """Search ``space`` (see the module's docstring); ``on_trial(trial, done, total)`` is
    called after each decided trial (progress display). ``faults`` maps a config to a
    ``--fault`` spec injected into its trial (for testing failure handling)."""
    began = time.monotonic()
    chosen = strategy or Grid()
    points = space.valid()
    seq = int(space.fixed.get("seq", 64))
    estimates = _estimates(space, points, seq) if "model" in space.fixed else {}
    trials: list[Trial] = []
    candidates = []
    for config in points:
        est = estimates.get(config)
        if est is not None and not est.fits(memory_budget):
            reason = f"estimated {_mib(est.total_bytes)} per rank > budget {_mib(memory_budget or 0)}"
            trials.append(Trial(config, "pruned", reason, estimate_bytes=est.total_bytes))
        else:
            candidates.append(config)
    # the same estimate as explain's ranks them: the fastest predicted first (a grid runs
    # them in this order; a sampling strategy starts from it)
    candidates.sort(key=lambda c: -(estimates[c].tokens_per_s or 0.0) if c in estimates else 0.0)
    if not candidates:
        smallest = min(trials, key=lambda t: t.estimate_bytes or 0)
        raise NoValidPointError("tune", [Problem("memory", f"none of the {len(points)} valid points fits the budget "
                                                           f"{_mib(memory_budget or 0)}; the smallest estimate is "
                                                           f"{_mib(smallest.estimate_bytes or 0)} ({smallest.config})",
                                                 "raise the memory budget, or add checkpointing / more tp or pp")])
    total = len(trials) + len(candidates)
    for i, t in enumerate(trials, 1):
        if on_trial is not None:
            on_trial(t, i, total)
    root = folder or Path(tempfile.mkdtemp(prefix="slapo-fn-tune-"))
    fixed = {k: v for k, v in space.fixed.items() if k != "world_size"}

    def default_run(config: Config, where: Path) -> Trial:
        return run_trial(config, fixed, where, timeout=trial_timeout, fault=(faults or {}).get(config))

    runner = run or default_run
    sampler = chosen.start(candidates, space)
    trial_s, best, since_best, ran, stopped = 0.0, None, 0, 0, "every candidate ran"
    while True:
        if max_trials is not None and ran >= max_trials:
            stopped = f"max_trials={max_trials}"
            break
        if time_budget is not None and time.monotonic() - began >= time_budget:
            stopped = f"time budget {time_budget:.0f} s"
            break
        if patience is not None and since_best >= patience:
            stopped = f"no improvement in {patience} trials"
            break
        proposed = sampler.ask()
        if proposed is None:
            break
        config = proposed
        started = time.monotonic()
        trial = runner(config, root / f"trial-{ran:03d}")
        trial_s += time.monotonic() - started
        est = estimates.get(config)
        if est is not None:
            trial = dataclasses.replace(trial, estimate_bytes=est.total_bytes, estimate_tokens_per_s=est.tokens_per_s)
        sampler.tell(config, trial.tokens_per_s if trial.ok else None)
        trials.append(trial)
        ran += 1
        if trial.ok and trial.tokens_per_s is not None and (best is None or trial.tokens_per_s > best):
            best, since_best = trial.tokens_per_s, 0
        else:
            since_best += 1
        if on_trial is not None:
            on_trial(trial, len(trials), total)
    return TuneResult(space, chosen.name, tuple(trials), time.monotonic() - began, trial_s, stopped, memory_budget)


def summary(result: TuneResult) -> dict[str, Any]:
    """The figures of a search as plain data."""
    best = result.best
    return {"strategy": result.strategy, "trials": len(result.trials),
            "ran": sum(t.status != "pruned" for t in result.trials),
            "pruned": sum(t.status == "pruned" for t in result.trials),
            "failed": sum(t.status in ("crash", "oom", "timeout") for t in result.trials),
            "best_tokens_per_s": None if best is None else best.tokens_per_s,
            "trials_to_best": result.trials_to_best, "elapsed_s": round(result.elapsed_s, 3),
            "overhead_s": round(result.overhead_s, 3), "stopped": result.stopped}
