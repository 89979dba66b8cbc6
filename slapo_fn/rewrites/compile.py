"""``compile``: ``torch.compile`` a module in place, keeping FQNs."""

from __future__ import annotations

import inspect
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from ..combinators import primitive
from ..errors import Problem, ScheduleError
from ..schedule import Key, Schedule
from ..select import Selection
from ..tree import get_module
from ._common import reject_nested

__all__ = ["COMPILE", "apply_compile", "compile"]

COMPILE: Key[MappingProxyType[str, Any]] = Key("compile")
_OPTIONS = tuple(n for n in inspect.signature(torch.compile).parameters if n != "model")


@primitive
def compile(sch: Schedule, where: Selection, **options: Any) -> Schedule:  # noqa: A001
    """Compile the selected modules with ``torch.compile(**options)`` when built.

    Uses ``Module.compile``, so parameter names gain no ``_orig_mod.`` segment.
    Options are those of ``torch.compile`` (``backend``, ``mode``, ``fullgraph``,
    ``dynamic``, ``options``, ``disable``). Regions cannot nest. Returns a new schedule;
    the input is unchanged.

    Example:
        >>> import torch.nn as nn, slapo_fn as sf
        >>> sch = sf.create_schedule(nn.Sequential(nn.Linear(2, 2), nn.GELU()))
        >>> sch = sf.compile(sch, "0", dynamic=False)
        >>> dict(sch["0"].annotations["compile"])
        {'dynamic': False}
    """
    paths = where.modules(sch.module)
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ScheduleError(
            "compile",
            [
                Problem(p, f"unknown torch.compile option(s) {', '.join(unknown)}", f"use only {', '.join(_OPTIONS)}")
                for p in paths
            ],
        )
    existing = [p for p in sch.annotations.of_kind(COMPILE) if p not in paths]
    reject_nested("compile", paths, existing)
    for path in paths:
        sch = sch.annotate_path(path, COMPILE, MappingProxyType(dict(options)))
    return sch


def apply_compile(model: nn.Module, sch: Schedule) -> None:
    """Compile the schedule's regions of ``model`` in place (build's private copy)."""
    for path, options in sch.annotations.of_kind(COMPILE).items():
        get_module(model, path).compile(**options)
