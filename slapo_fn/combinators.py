"""Rewrite values and the combinators that compose them.

Every primitive ``p`` is a plain function ``p(sch, where, ...) -> Schedule`` and offers
``p.at(where, ...)``: the same call as a :class:`Rewrite` value — printable, comparable
and composable. Paths inside :func:`foreach` and :func:`scope` are relative to each match.

Example:
    >>> import torch.nn as nn, slapo_fn as sf
    >>> block = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    >>> rw = sf.checkpoint.at("0") >> sf.annotate.at("2.weight", "lr_scale", 0.5)
    >>> rw
    checkpoint.at('0') >> annotate.at('2.weight', 'lr_scale', 0.5)
    >>> sch = sf.foreach("*", rw)(sf.create_schedule(nn.Sequential(block, block)))
    >>> [str(step) for step in sch.history]
    ["checkpoint.at('0.0')", "annotate.at('0.2.weight', 'lr_scale', 0.5)", "checkpoint.at('1.0')", \
"annotate.at('1.2.weight', 'lr_scale', 0.5)"]
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec

from torch import nn

from .errors import Problem, ScheduleError, ScheduleTypeError
from .schedule import Schedule, View
from .select import Selection, Where, select
from .tree import join

__all__ = ["Primitive", "Rewrite", "chain", "foreach", "primitive", "scope", "when"]

P = ParamSpec("P")


def _fmt(value: object) -> str:
    if isinstance(value, Selection):
        return str(value)
    if isinstance(value, nn.Module):
        return f"{type(value).__name__}(…)"
    if inspect.isfunction(value) or inspect.ismethod(value) or inspect.isbuiltin(value):
        return getattr(value, "__qualname__", repr(value))
    if isinstance(value, type):
        return value.__name__
    return repr(value)


def _rebase(where: Where | None, base: str) -> Where | None:
    if not base or where is None:
        return where
    if isinstance(where, str):
        return join(base, where)
    return select(where).under(base)


class Rewrite:
    """A schedule transformation as a value: ``rw(sch) -> Schedule``.

    Compose with ``>>`` (left first) or :func:`chain`; repeat with :func:`foreach`;
    narrow with :func:`scope`; guard with :func:`when`.
    """

    def apply(self, sch: Schedule, base: str = "") -> Schedule:
        """Apply with every path read relative to ``base``."""
        raise NotImplementedError

    def __call__(self, sch: Schedule) -> Schedule:
        if not isinstance(sch, Schedule):
            raise ScheduleTypeError(
                str(self),
                [Problem("", f"expected a Schedule, got {type(sch).__name__}", "sch = sf.create_schedule(model)")],
            )
        return self.apply(sch)

    def __rshift__(self, other: Rewrite) -> Rewrite:
        if not isinstance(other, Rewrite):
            return NotImplemented
        left = self.rewrites if isinstance(self, Chain) else (self,)
        right = other.rewrites if isinstance(other, Chain) else (other,)
        return Chain(left + right)


@dataclass(frozen=True, repr=False)
class Call(Rewrite):
    """One primitive call: ``primitive(sch, where, *args, **kwargs)``."""

    primitive: Primitive[...]
    where: Where | None
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()

    def apply(self, sch: Schedule, base: str = "") -> Schedule:
        return self.primitive(sch, _rebase(self.where, base), *self.args, **dict(self.kwargs))

    def __repr__(self) -> str:
        parts = [] if self.where is None else [_fmt(self.where)]
        parts += [_fmt(a) for a in self.args] + [f"{k}={_fmt(v)}" for k, v in self.kwargs]
        return f"{self.primitive.__name__}.at({', '.join(parts)})"


@dataclass(frozen=True, repr=False)
class Chain(Rewrite):
    rewrites: tuple[Rewrite, ...]

    def apply(self, sch: Schedule, base: str = "") -> Schedule:
        for rewrite in self.rewrites:
            sch = rewrite.apply(sch, base)
        return sch

    def __repr__(self) -> str:
        return " >> ".join(repr(r) for r in self.rewrites) if self.rewrites else "chain()"


@dataclass(frozen=True, repr=False)
class ForEach(Rewrite):
    where: Where
    rewrite: Rewrite

    def apply(self, sch: Schedule, base: str = "") -> Schedule:
        for path in select(_rebase(self.where, base)).modules(sch.module):
            sch = self.rewrite.apply(sch, path)
        return sch

    def __repr__(self) -> str:
        return f"foreach({_fmt(self.where)}, {self.rewrite!r})"


@dataclass(frozen=True, repr=False)
class Scope(Rewrite):
    where: Where
    rewrite: Rewrite

    def apply(self, sch: Schedule, base: str = "") -> Schedule:
        paths = select(_rebase(self.where, base)).modules(sch.module)
        if len(paths) != 1:
            raise ScheduleError(
                "scope",
                [
                    Problem(
                        self.where if isinstance(self.where, str) else _fmt(self.where),
                        f"matches {len(paths)} modules ({', '.join(paths[:4])}…); scope needs one",
                        "use foreach(where, rewrite) to apply the rewrite under every match",
                    )
                ],
            )
        return self.rewrite.apply(sch, paths[0])

    def __repr__(self) -> str:
        return f"scope({_fmt(self.where)}, {self.rewrite!r})"


@dataclass(frozen=True, repr=False)
class When(Rewrite):
    predicate: Callable[[View], bool]
    rewrite: Rewrite

    def apply(self, sch: Schedule, base: str = "") -> Schedule:
        return self.rewrite.apply(sch, base) if self.predicate(sch[base]) else sch

    def __repr__(self) -> str:
        return f"when({_fmt(self.predicate)}, {self.rewrite!r})"


def chain(*rewrites: Rewrite) -> Rewrite:
    """Apply ``rewrites`` left to right: ``chain(a, b)(sch) == b(a(sch))`` (``a >> b`` too).

    >>> import torch.nn as nn, slapo_fn as sf
    >>> rw = sf.chain(sf.checkpoint.at("0"), sf.compile.at("1"))
    >>> sorted(rw(sf.create_schedule(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))).annotations)
    ['0', '1']
    """
    bad = [i for i, r in enumerate(rewrites) if not isinstance(r, Rewrite)]
    if bad:
        raise ScheduleTypeError(
            "chain",
            [
                Problem(
                    f"argument {i}",
                    f"is a {type(rewrites[i]).__name__}, not a Rewrite",
                    "pass rewrite values, e.g. sf.checkpoint.at('layers.0')",
                )
                for i in bad
            ],
        )
    return Chain(tuple(rewrites))


def _check_rewrite(name: str, rewrite: object) -> None:
    if not isinstance(rewrite, Rewrite):
        raise ScheduleTypeError(
            name,
            [
                Problem(
                    "",
                    f"expected a Rewrite, got {type(rewrite).__name__}",
                    "use the .at form of a primitive, e.g. sf.shard.at('up_proj', axis=0)",
                )
            ],
        )


def foreach(where: Where, rewrite: Rewrite) -> Rewrite:
    """Apply ``rewrite`` once under every module ``where`` selects; its paths are
    relative to each match (``""`` is the match itself).

    >>> import slapo_fn as sf
    >>> sf.foreach("model.layers.*", sf.checkpoint.at(""))
    foreach('model.layers.*', checkpoint.at(''))
    """
    select(where)
    _check_rewrite("foreach", rewrite)
    return ForEach(where, rewrite)


def scope(where: Where, rewrite: Rewrite) -> Rewrite:
    """Apply ``rewrite`` with paths relative to the single module ``where`` selects
    (more than one match is an error: use :func:`foreach`).

    >>> import torch.nn as nn, slapo_fn as sf
    >>> model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    >>> sch = sf.scope("0", sf.checkpoint.at("0"))(sf.create_schedule(model))
    >>> list(sch.annotations)
    ['0.0']
    """
    select(where)
    _check_rewrite("scope", rewrite)
    return Scope(where, rewrite)


def when(predicate: Callable[[View], bool], rewrite: Rewrite) -> Rewrite:
    """Apply ``rewrite`` only where ``predicate(view)`` holds; ``view`` is ``sch[base]``
    (inside :func:`foreach`, the current match).

    >>> import slapo_fn as sf
    >>> even = lambda v: int(v.path.rsplit(".", 1)[-1]) % 2 == 0
    >>> rw = sf.foreach("layers.*", sf.when(even, sf.checkpoint.at("")))
    """
    if not callable(predicate):
        raise ScheduleTypeError("when", [Problem("", "predicate must be callable(view) -> bool", "")])
    _check_rewrite("when", rewrite)
    return When(predicate, rewrite)


class Primitive(Generic[P]):
    """A schedule primitive: callable as ``p(sch, where, ...)`` and as ``p.at(where, ...)``.

    The implementation receives the schedule and the selection lowered to a
    :class:`~slapo_fn.select.Selection`; the wrapper records the call in ``history``.
    """

    def __init__(self, impl: Callable[Concatenate[Schedule, Selection, P], Schedule]) -> None:
        self._impl = impl
        self._signature = inspect.signature(impl)
        plain = [p.replace(annotation=p.empty) for p in self._signature.parameters.values()]
        where_param = list(self._signature.parameters.values())[1]
        self._where_required = where_param.default is inspect.Parameter.empty
        self._shown = str(self._signature.replace(parameters=plain, return_annotation=inspect.Signature.empty))
        functools.update_wrapper(self, impl)
        self.__name__: str = impl.__name__

    def __call__(self, sch: Schedule, where: Where | None = None, /, *args: P.args, **kwargs: P.kwargs) -> Schedule:
        if not isinstance(sch, Schedule):
            raise ScheduleTypeError(
                self.__name__,
                [
                    Problem(
                        "",
                        f"first argument must be a Schedule, got {type(sch).__name__}",
                        f"sf.{self.__name__}(sf.create_schedule(model), where, ...)",
                    )
                ],
            )
        self._bind(where, args, kwargs)
        try:
            selection = None if where is None else select(where)
        except ScheduleTypeError as e:
            raise ScheduleTypeError(self.__name__, e.problems) from None
        # None only reaches implementations whose `where` has a default (checked in _bind)
        result = self._impl(sch, selection, *args, **kwargs)  # type: ignore[arg-type]
        step = Call(self, where, tuple(args), tuple(kwargs.items()))
        return result.evolve(history=(*sch.history, step))

    def at(self, where: Where | None = None, /, *args: P.args, **kwargs: P.kwargs) -> Rewrite:
        """This primitive as a :class:`Rewrite` value (arguments checked now)."""
        if where is not None:
            select(where)
        self._bind(where, args, kwargs)
        return Call(self, where, tuple(args), tuple(kwargs.items()))

    def _bind(self, where: Where | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if where is None and self._where_required:
            raise ScheduleTypeError(
                self.__name__,
                [Problem("", "missing the selector `where`", f"call it as {self.__name__}{self._shown}")],
            )
        try:
            self._signature.bind(None, where, *args, **kwargs)
        except TypeError as e:
            raise ScheduleTypeError(
                self.__name__,
                [Problem(str(where), f"bad arguments: {e}", f"call it as {self.__name__}{self._shown}")],
            ) from None

    def __repr__(self) -> str:
        return f"<primitive slapo_fn.{self.__name__}{self._shown}>"


def primitive(impl: Callable[Concatenate[Schedule, Selection, P], Schedule]) -> Primitive[P]:
    """Make ``impl(sch, selection, ...)`` a :class:`Primitive`: callable as
    ``p(sch, where, ...)``, as a value with ``p.at(where, ...)``, recorded in the history.

    >>> import torch.nn as nn, slapo_fn as sf
    >>> FROZEN: sf.Key[bool] = sf.Key("frozen")
    >>> @sf.primitive
    ... def freeze(sch, where):
    ...     for path in where.parameters(sch.module):
    ...         sch = sch.annotate_path(path, FROZEN, True)
    ...     return sch
    >>> sch = freeze(sf.create_schedule(nn.Sequential(nn.Linear(2, 2))), "0")
    >>> sorted(sch.annotations), sch.history
    (['0.bias', '0.weight'], (freeze.at('0'),))
    """
    return Primitive(impl)
