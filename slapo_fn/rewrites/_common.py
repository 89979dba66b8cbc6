"""Checks shared by the annotation primitives."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import Problem, ScheduleError
from ..schedule import Key


@dataclass(frozen=True)
class Installed:
    """What :func:`~slapo_fn.replace` installed at a path, and what it took the place of
    (a module's class, or the ops of a matched subgraph), as the tree and ``explain``
    print it.

    >>> str(Installed("RMSNorm", "LlamaRMSNorm"))
    'RMSNorm in place of LlamaRMSNorm'
    """

    module: str
    replaced: str

    def __str__(self) -> str:
        return f"{self.module} in place of {self.replaced}"


#: Set by :func:`~slapo_fn.replace` on each module it installs: the user's own code, which may
#: compute this rank's share of a value (hand-written tensor parallelism, Slapo style). The rest
#: of the tree is the single-process model's, which computes whole values on every rank.
INSTALLED: Key[Installed] = Key("installed")


def contains(outer: str, inner: str) -> bool:
    """Whether module path ``inner`` lies strictly inside ``outer``."""
    return inner != outer and (outer == "" or inner.startswith(outer + "."))


def within(outer: str, inner: str) -> bool:
    """Whether module path ``inner`` is ``outer`` or lies inside it (the root ``""`` holds all).

    >>> within("encoder.layers.0", "encoder.layers.0"), within("encoder.layers.0", "encoder.layers.0.fc1")
    (True, True)
    >>> within("encoder.layers.0", "encoder.layers.01"), within("", "lm_head")
    (False, True)
    """
    return inner == outer or contains(outer, inner)


def reject_nested(what: str, paths: Iterable[str], annotated: Iterable[str]) -> None:
    """Refuse regions of ``what`` that would nest in each other (all offenders at once)."""
    paths = tuple(paths)
    everything = sorted(set(annotated) | set(paths))
    problems = []
    for path in paths:
        for other in everything:
            if contains(other, path) or contains(path, other):
                outer, inner = (other, path) if contains(other, path) else (path, other)
                problems.append(
                    Problem(
                        path,
                        f"{what} regions cannot nest: {inner!r} is inside {outer!r}",
                        f"apply {what} to either {outer!r} or to the modules inside it",
                    )
                )
                break
    if problems:
        raise ScheduleError(what, problems)
