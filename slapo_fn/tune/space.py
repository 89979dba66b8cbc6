"""Search spaces as values: knobs, the constraints between them, and their valid points.

A :class:`Space` is a tuple of knobs (:class:`Categorical`, :class:`IntRange`,
:class:`PowersOfTwo`), a tuple of :class:`Constraint` values and the fixed options of
every trial (model, sequence length, steps …). Its points are :class:`Config` values
(frozen, hashable, ordered like the knobs). Knob names are the ``slapo-fn train`` flags
they set: ``dp``, ``tp``, ``pp``, ``sp``, ``checkpoint`` (a ratio of the layers, ``None``
= off), ``microbatches``, ``batch`` (global), ``dp_mode``, ``kernels``, ``compile``,
``schedule``.

Example:
    >>> space = Space((Categorical("tp", (1, 2, 4)), PowersOfTwo("dp", 1, 4)),
    ...               (world_size_is(4),))
    >>> [(c["dp"], c["tp"]) for c in space.valid()]
    [(4, 1), (2, 2), (1, 4)]
    >>> space.size
    9
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..errors import Problem, ScheduleError
from ..hf import LAYER_COUNT_ATTRS, config_value, model_type
from ..options import FLAGS, Split
from ..presets import config_for
from ..recipes import RECIPES

__all__ = [
    "DEFAULTS",
    "Categorical",
    "Config",
    "Constraint",
    "IntRange",
    "Knob",
    "NoValidPointError",
    "PowersOfTwo",
    "Space",
    "Value",
    "batch_divides",
    "heads_divisible",
    "layers_at_least_pp",
    "microbatches_at_least_pp",
    "one_value_when_unused",
    "sp_needs_tp",
    "space_for",
    "world_size_is",
]

Value = int | float | str | bool | None

#: The value of a knob a space leaves out (``slapo-fn train``'s defaults).
DEFAULTS: Mapping[str, Value] = MappingProxyType({
    "dp": 1, "tp": 1, "pp": 1, "sp": False, "checkpoint": None, "microbatches": None, "batch": 8,
    "dp_mode": "fsdp", "kernels": False, "compile": False, "schedule": "1f1b",
})


# -- knobs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Categorical:
    """A knob taking one of ``choices`` (in that order).

    >>> Categorical("checkpoint", (None, 1.0)).values()
    (None, 1.0)
    """

    name: str
    choices: tuple[Value, ...]

    def __post_init__(self) -> None:
        if not self.choices:
            raise ScheduleError("tune.Categorical", [Problem(self.name, "no choices", "give at least one value")])
        if len(set(map(repr, self.choices))) != len(self.choices):
            raise ScheduleError("tune.Categorical", [Problem(self.name, f"repeated choices {self.choices}",
                                                             "list each value once")])

    def values(self) -> tuple[Value, ...]:
        return self.choices


@dataclass(frozen=True)
class IntRange:
    """A knob taking ``low, low + step, …`` up to ``high`` (inclusive).

    >>> IntRange("microbatches", 2, 8, step=2).values()
    (2, 4, 6, 8)
    """

    name: str
    low: int
    high: int
    step: int = 1

    def __post_init__(self) -> None:
        if self.step < 1 or self.high < self.low:
            raise ScheduleError("tune.IntRange", [Problem(self.name, f"empty range {self.low}..{self.high} step "
                                                                     f"{self.step}", "low <= high, step >= 1")])

    def values(self) -> tuple[Value, ...]:
        return tuple(range(self.low, self.high + 1, self.step))


@dataclass(frozen=True)
class PowersOfTwo:
    """A knob taking the powers of two from ``low`` to ``high`` (inclusive).

    >>> PowersOfTwo("batch", 1, 16).values()
    (1, 2, 4, 8, 16)
    """

    name: str
    low: int
    high: int

    def __post_init__(self) -> None:
        bad = [v for v in (self.low, self.high) if v < 1 or v & (v - 1)]
        if bad or self.high < self.low:
            raise ScheduleError("tune.PowersOfTwo", [Problem(self.name, f"bounds {self.low}..{self.high} are not "
                                                                        "increasing powers of two",
                                                             "e.g. PowersOfTwo('batch', 1, 16)")])

    def values(self) -> tuple[Value, ...]:
        return tuple(2**k for k in range(int(math.log2(self.low)), int(math.log2(self.high)) + 1))


Knob = Categorical | IntRange | PowersOfTwo


# -- points -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """One point of a space: knob name → value, in the space's knob order (hashable).

    >>> c = Config.of({"tp": 2, "checkpoint": None})
    >>> c["tp"], c.get("pp"), str(c)
    (2, 1, 'tp=2 checkpoint=none')
    """

    items: tuple[tuple[str, Value], ...]

    @staticmethod
    def of(values: Mapping[str, Value]) -> Config:
        return Config(tuple(values.items()))

    def __getitem__(self, name: str) -> Value:
        for key, value in self.items:
            if key == name:
                return value
        raise KeyError(name)

    def get(self, name: str) -> Value:
        """The value of ``name``, or its default (:data:`DEFAULTS`) when the space leaves it out."""
        for key, value in self.items:
            if key == name:
                return value
        return DEFAULTS.get(name)

    def num(self, name: str) -> int:
        value = self.get(name)
        return int(value) if isinstance(value, (int, float)) and value is not None else 0

    def as_dict(self) -> dict[str, Value]:
        return dict(self.items)

    def __str__(self) -> str:
        return " ".join(f"{k}={_show(v)}" for k, v in self.items)


def _show(value: Value) -> str:
    if value is None:
        return "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


# -- constraints --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Constraint:
    """A rule between knobs: ``why_not(config)`` is ``None`` when ``config`` satisfies it,
    else the reason it does not (a sentence naming the values)."""

    name: str
    why_not: Callable[[Config], str | None] = field(compare=False)

    def __repr__(self) -> str:
        return f"Constraint({self.name!r})"


def world_size_is(world_size: int) -> Constraint:
    """``dp * tp * pp == world_size``.

    >>> world_size_is(4).why_not(Config.of({"dp": 2, "tp": 1}))
    'dp*tp*pp = 2*1*1 = 2, not the world size 4'
    """

    def check(c: Config) -> str | None:
        dp, tp, pp = c.num("dp"), c.num("tp"), c.num("pp")
        if dp * tp * pp == world_size:
            return None
        return f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp}, not the world size {world_size}"

    return Constraint(f"dp*tp*pp == {world_size}", check)


def heads_divisible(heads: int, kv_heads: int | None = None) -> Constraint:
    """The attention heads (and key/value heads) divide evenly over ``tp``."""

    def check(c: Config) -> str | None:
        tp = c.num("tp")
        for label, count in (("heads", heads), ("kv_heads", kv_heads)):
            if count is not None and count % tp:
                return f"{label}={count} is not divisible by tp={tp}"
        return None

    return Constraint(f"heads % tp == 0 (heads={heads}, kv_heads={kv_heads})", check)


def microbatches_at_least_pp() -> Constraint:
    """With pipeline stages, at least one microbatch per stage (``microbatches >= pp``;
    unset means ``2 * pp``, as ``slapo-fn train`` does)."""

    def check(c: Config) -> str | None:
        pp, micro = c.num("pp"), c.get("microbatches")
        if pp > 1 and micro is not None and c.num("microbatches") < pp:
            return f"microbatches={micro} < pp={pp}: a stage would idle"
        return None

    return Constraint("microbatches >= pp", check)


def layers_at_least_pp(layers: int) -> Constraint:
    """No more pipeline stages than layers."""

    def check(c: Config) -> str | None:
        return f"pp={c.num('pp')} stages for {layers} layers" if c.num("pp") > layers else None

    return Constraint(f"pp <= layers ({layers})", check)


def batch_divides() -> Constraint:
    """The global batch splits evenly over ``dp``, and each data-parallel rank's share over
    the pipeline microbatches: the check ``slapo-fn train`` and ``explain`` make
    (:class:`slapo_fn.options.Split`), so that no trial is one ``train`` refuses.

    >>> batch_divides().why_not(Config.of({"batch": 8, "dp": 4, "pp": 4}))
    '2 sequences per data-parallel rank and micro-step (batch 8 / dp 4) do not split into 8 microbatches (the \
default: 2 x pp)'
    """

    def check(c: Config) -> str | None:
        micro = c.get("microbatches")
        split = Split(batch=c.num("batch"), dp=c.num("dp"), pp=c.num("pp"),
                      microbatches=None if micro is None else c.num("microbatches"))
        problems = split.problems({k: k for k in FLAGS})
        return problems[0].reason if problems else None

    return Constraint("batch % dp == 0 (and % microbatches)", check)


def sp_needs_tp() -> Constraint:
    """Sequence parallelism needs ``tp > 1``."""

    def check(c: Config) -> str | None:
        return "sp=true needs tp > 1" if c.get("sp") and c.num("tp") < 2 else None

    return Constraint("sp needs tp > 1", check)


def one_value_when_unused(space_knobs: Sequence[Knob]) -> Constraint:
    """Knobs that change nothing in a config (``dp_mode`` with ``dp=1``; ``microbatches`` and
    ``schedule`` with ``pp=1``) keep their first value only, so that one run is never
    repeated under two names."""
    firsts = {k.name: k.values()[0] for k in space_knobs}
    unused = (("dp_mode", "dp"), ("microbatches", "pp"), ("schedule", "pp"))

    def check(c: Config) -> str | None:
        for knob, axis in unused:
            if knob in firsts and c.num(axis) == 1 and c.get(knob) != firsts[knob]:
                return f"{knob}={_show(c.get(knob))} changes nothing with {axis}=1 (same run as {_show(firsts[knob])})"
        return None

    return Constraint("unused knobs keep their first value", check)


# -- spaces --------------------------------------------------------------------------------------
class NoValidPointError(ScheduleError):
    """A space has no point that satisfies its constraints. ``problems`` name each
    constraint with how many points it rejected and one example."""


@dataclass(frozen=True)
class Space:
    """Knobs, the constraints between them, and the fixed options of every trial."""

    knobs: tuple[Knob, ...]
    constraints: tuple[Constraint, ...] = ()
    fixed: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        names = [k.name for k in self.knobs]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ScheduleError("tune.Space", [Problem(n, "knob given twice", "one knob per name") for n in repeated])

    @property
    def size(self) -> int:
        """Points before constraints."""
        return math.prod(len(k.values()) for k in self.knobs)

    def points(self) -> Iterator[Config]:
        """Every point, valid or not, in grid order (the last knob varies fastest)."""
        names = [k.name for k in self.knobs]
        for values in itertools.product(*(k.values() for k in self.knobs)):
            yield Config(tuple(zip(names, values)))

    def why_not(self, config: Config) -> str | None:
        """The first constraint ``config`` breaks (its reason), or ``None``."""
        for constraint in self.constraints:
            reason = constraint.why_not(config)
            if reason is not None:
                return reason
        return None

    def valid(self) -> tuple[Config, ...]:
        """The points that satisfy every constraint, in grid order; a
        :class:`NoValidPointError` when there are none."""
        good = tuple(c for c in self.points() if self.why_not(c) is None)
        if not good:
            raise NoValidPointError("tune.Space", self._rejections())
        return good

    def _rejections(self) -> list[Problem]:
        counts: dict[str, tuple[int, str]] = {}
        for config in self.points():
            for constraint in self.constraints:
                reason = constraint.why_not(config)
                if reason is not None:
                    n, example = counts.get(constraint.name, (0, f"{config}: {reason}"))
                    counts[constraint.name] = (n + 1, example)
        return [Problem(name, f"no valid point: rejects {n} of {self.size} points, e.g. {example}",
                        "widen the knobs' values or change the world size")
                for name, (n, example) in counts.items()]


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _values(name: str, given: Sequence[Value] | Knob | None, default: Sequence[Value]) -> Knob:
    if isinstance(given, (Categorical, IntRange, PowersOfTwo)):
        return given
    return Categorical(name, tuple(default if given is None else given))


def space_for(model: str, world_size: int, *, fixed: Mapping[str, Any] | None = None,
              **knobs: Sequence[Value] | Knob | None) -> Space:
    """The search space of a preset (or ``config.json``) model on ``world_size`` ranks,
    from its recipe's knobs: ``dp``/``tp``/``pp`` over the divisors of the world size
    (``tp`` only where the heads divide; ``pp`` 1 unless given), ``sp`` and ``kernels``
    only where the recipe has them, ``checkpoint`` none or all layers, ``batch`` 8 — each
    overridable by a keyword (a list of values or a knob). The constraints follow from the
    model (heads, layers) and the world size.

    >>> space = space_for("llama-tiny", 2, checkpoint=[None, 1.0], batch=[2, 4])
    >>> [k.name for k in space.knobs]
    ['dp', 'tp', 'pp', 'sp', 'checkpoint', 'batch', 'dp_mode', 'kernels', 'compile']
    >>> len(space.valid()), space.fixed["model"]
    (12, 'llama-tiny')
    """
    hf = config_for(model)
    recipe = next((r for r in RECIPES.values() if model_type(hf) in r.model_types), None)
    if recipe is None:
        raise ScheduleError("tune.space_for", [Problem(model, f"no recipe for model_type {model_type(hf)!r}",
                                                       "build the Space by hand")])
    heads = int(getattr(hf, recipe.heads))
    kv = getattr(hf, recipe.kv_heads, None) if recipe.kv_heads else None
    layers = int(config_value(hf, *LAYER_COUNT_ATTRS))
    divisors = _divisors(world_size)
    defaults: dict[str, Sequence[Value]] = {
        "dp": divisors,
        "tp": tuple(d for d in divisors if heads % d == 0 and (kv is None or int(kv) % d == 0)),
        "pp": (1,),
        "sp": (False, True) if recipe.sp and world_size > 1 else (False,),
        "checkpoint": (None, 1.0),
        "batch": (8,),
        "dp_mode": ("fsdp",),
        "kernels": (False,),
        "compile": (False,),
    }
    unknown = sorted(set(knobs) - set(DEFAULTS))
    if unknown:
        raise ScheduleError("tune.space_for", [Problem(k, "not a knob", f"knobs: {', '.join(DEFAULTS)}")
                                               for k in unknown])
    order = [*defaults, *(k for k in DEFAULTS if k not in defaults and knobs.get(k) is not None)]
    built = tuple(_values(name, knobs.get(name), defaults.get(name, (DEFAULTS[name],))) for name in order)
    constraints = (world_size_is(world_size), heads_divisible(heads, None if kv is None else int(kv)),
                   layers_at_least_pp(layers), microbatches_at_least_pp(), batch_divides(), sp_needs_tp(),
                   one_value_when_unused(built))
    options = {"model": model, "world_size": world_size, **(fixed or {})}
    return Space(built, constraints, MappingProxyType(options))
