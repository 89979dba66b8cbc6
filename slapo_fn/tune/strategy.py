"""Search strategies: which candidate to try next.

A strategy is a value (:class:`Grid`, :class:`Random`, :class:`TPE`); ``start(candidates,
space)`` gives a :class:`Sampler` for one search, which proposes candidates (``ask``) and
hears their throughput (``tell``; ``None`` for a failed trial). Every sampler proposes
only from ``candidates`` — the points that satisfy the space's constraints and fit the
memory budget — and never the same one twice.

* :class:`Grid`: every candidate in grid order (exhaustive; for small spaces);
* :class:`Random`: every candidate in a seeded random order;
* :class:`TPE`: Optuna's tree-structured Parzen estimator over the knobs (categorical
  distributions); a point outside the candidates is told to Optuna as worthless and never
  run. Needs ``optuna`` (``pip install 'slapo_fn[tune]'``); :func:`strategy` ``"auto"``
  picks it when installed and :class:`Random` otherwise.

Example:
    >>> from slapo_fn.tune.space import Config
    >>> pts = tuple(Config.of({"batch": b}) for b in (1, 2, 4))
    >>> s = Random(seed=0).start(pts, None)
    >>> sorted(s.ask()["batch"] for _ in range(3))
    [1, 2, 4]
"""

from __future__ import annotations

import importlib.util
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import Problem, ScheduleError
from .space import Config, Space

__all__ = ["TPE", "Grid", "Random", "Sampler", "Strategy", "strategy"]


class Sampler(Protocol):
    def ask(self) -> Config | None:
        """The next candidate, or ``None`` when every candidate was proposed."""

    def tell(self, config: Config, value: float | None) -> None:
        """The measured throughput of ``config`` (``None``: the trial failed)."""


class _Ordered:
    def __init__(self, order: Sequence[Config]) -> None:
        self._order = list(order)

    def ask(self) -> Config | None:
        return self._order.pop(0) if self._order else None

    def tell(self, config: Config, value: float | None) -> None:
        return None


@dataclass(frozen=True)
class Grid:
    """Every candidate, in grid order."""

    name: str = "grid"

    def start(self, candidates: Sequence[Config], space: Space | None) -> Sampler:
        return _Ordered(candidates)


@dataclass(frozen=True)
class Random:
    """Every candidate, in a random order drawn from ``seed``."""

    seed: int = 0
    name: str = "random"

    def start(self, candidates: Sequence[Config], space: Space | None) -> Sampler:
        order = list(candidates)
        random.Random(self.seed).shuffle(order)
        return _Ordered(order)


class _Optuna:
    def __init__(self, candidates: Sequence[Config], seed: int, startup: int) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        self._left = list(candidates)
        names = [k for k, _ in candidates[0].items]
        self._choices = {n: list(dict.fromkeys(c[n] for c in candidates)) for n in names}
        self._names = names
        with warnings.catch_warnings():  # multivariate TPE is marked experimental
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, multivariate=True)
        self._study = optuna.create_study(direction="maximize", sampler=sampler)
        self._pending: dict[Config, Any] = {}
        self._told: dict[Config, float] = {}

    def _distributions(self) -> dict[str, Any]:
        # indices, not the values: optuna's categorical choices may not mix None with numbers
        return {n: self._optuna.distributions.CategoricalDistribution(list(range(len(v))))
                for n, v in self._choices.items()}

    def ask(self) -> Config | None:
        if not self._left:
            return None
        dists = self._distributions()
        for _ in range(64):
            trial = self._study.ask(dists)
            config = Config(tuple((n, self._choices[n][trial.params[n]]) for n in self._names))
            if config in self._left:
                self._left.remove(config)
                self._pending[config] = trial
                return config
            # outside the candidates (a constraint or the memory budget) scores nothing;
            # an already measured point is told its value again
            self._study.tell(trial, self._told.get(config, 0.0))
        config = self._left.pop(0)  # the model keeps proposing known points: take the next untried one
        params = {n: self._choices[n].index(config[n]) for n in self._names}
        self._study.enqueue_trial(params)  # the next ask() takes these parameters
        self._pending[config] = self._study.ask(dists)
        return config

    def tell(self, config: Config, value: float | None) -> None:
        trial = self._pending.pop(config, None)
        score = 0.0 if value is None else value
        self._told[config] = score
        if trial is not None:
            self._study.tell(trial, score)


@dataclass(frozen=True)
class TPE:
    """Optuna's TPE (multivariate), the first ``startup`` trials random, seeded."""

    seed: int = 0
    startup: int = 4
    name: str = "tpe"

    def start(self, candidates: Sequence[Config], space: Space | None) -> Sampler:
        if importlib.util.find_spec("optuna") is None:
            raise ScheduleError("tune.TPE", [Problem("", "the TPE strategy needs optuna, which is not installed",
                                                     "pip install 'slapo_fn[tune]' (or optuna), or use "
                                                     "strategy='random' / 'grid'")])
        return _Optuna(candidates, self.seed, self.startup)


Strategy = Grid | Random | TPE


def strategy(name: str, *, seed: int = 0) -> Strategy:
    """A strategy by name: ``grid``, ``random``, ``tpe``, or ``auto`` (TPE when optuna is
    installed, else random).

    >>> strategy("grid")
    Grid(name='grid')
    """
    if name == "auto":
        return TPE(seed) if importlib.util.find_spec("optuna") is not None else Random(seed)
    if name == "grid":
        return Grid()
    if name == "random":
        return Random(seed)
    if name == "tpe":
        return TPE(seed)
    raise ScheduleError("tune.strategy", [Problem(name, "unknown strategy", "grid, random, tpe or auto")])
