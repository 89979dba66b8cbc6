"""The auto-tuner: search spaces as values, a cost model before any cost, trials that
cannot take the machine down, and reports.

* :mod:`~slapo_fn.tune.space` — knobs (:class:`Categorical`, :class:`IntRange`,
  :class:`PowersOfTwo`), constraints, :class:`Space`, :func:`space_for` (from a recipe);
* :mod:`~slapo_fn.tune.cost` — :func:`estimate`: per-rank memory before running;
* :mod:`~slapo_fn.tune.strategy` — :class:`Grid`, :class:`Random`, :class:`TPE` (Optuna);
* :mod:`~slapo_fn.tune.trial` — :func:`run_trial`: one ``slapo-fn train`` run, bounded;
* :mod:`~slapo_fn.tune.tuner` — :func:`tune`: the search loop and its :class:`TuneResult`;
* :mod:`~slapo_fn.tune.report` — JSON, console table, plot.

On the command line: ``slapo-fn tune --model llama-tiny --world-size 2 --tp 1,2
--checkpoint none,all --batch 2,4``.

Example:
    >>> from slapo_fn import tune
    >>> space = tune.space_for("llama-tiny", 2, tp=[1, 2], sp=[False], checkpoint=[None], batch=[4])
    >>> [(c["dp"], c["tp"]) for c in space.valid()]  # dp*tp == the world size
    [(1, 2), (2, 1)]
"""

from .cost import Estimate, ModelShape, activation_bytes, estimate
from .space import (
    Categorical,
    Config,
    Constraint,
    IntRange,
    NoValidPointError,
    PowersOfTwo,
    Space,
    space_for,
    world_size_is,
)
from .strategy import TPE, Grid, Random, strategy
from .trial import Trial, reproduce_command, run_trial, train_args
from .tuner import TuneResult, tune

__all__ = [
    "TPE",
    "Categorical",
    "Config",
    "Constraint",
    "Estimate",
    "Grid",
    "IntRange",
    "ModelShape",
    "NoValidPointError",
    "PowersOfTwo",
    "Random",
    "Space",
    "Trial",
    "TuneResult",
    "activation_bytes",
    "estimate",
    "reproduce_command",
    "run_trial",
    "space_for",
    "strategy",
    "train_args",
    "tune",
    "world_size_is",
]
