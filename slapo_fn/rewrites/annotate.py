"""``annotate``: user tags on parameters (or modules) that survive sharding and build."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from ..combinators import primitive
from ..errors import Problem, ScheduleError
from ..schedule import Key, Schedule
from ..select import Selection
from ..tree import get_module, split

__all__ = ["TAGS", "annotate", "apply_tags", "resolve_target"]

TAGS: Key[MappingProxyType[str, Any]] = Key("tags")


def resolve_target(root: nn.Module, path: str) -> nn.Module | torch.Tensor:
    """The module or parameter at ``path``."""
    tokens = split(path)
    try:
        return get_module(root, path)
    except KeyError:
        owner = get_module(root, ".".join(tokens[:-1]))
        param = owner._parameters[tokens[-1]]
        assert param is not None
        return param


@primitive
def annotate(sch: Schedule, where: Selection, key: str, value: Any) -> Schedule:
    """Tag the selected parameters (or modules) with ``key = value``.

    In the built model the tag is an attribute of the parameter (``param.key``), also
    after sharding; in the schedule it is ``sch[path].annotations["tags"]``. ``key`` must
    be an identifier that is not already an attribute of the target. Returns a new
    schedule; the input is unchanged.

    Example:
        >>> import torch.nn as nn, slapo_fn as sf
        >>> sch = sf.create_schedule(nn.Sequential(nn.Linear(2, 2)))
        >>> sch = sf.annotate(sch, "0.weight", "lr_scale", 0.1)
        >>> sf.build(sch)[0].weight.lr_scale
        0.1
    """
    paths = where.paths(sch.module)
    problems = []
    for path in paths:
        target = resolve_target(sch.module, path)
        tags: Mapping[str, Any] = sch.annotations.get(path, TAGS) or {}
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("__"):
            problems.append(
                Problem(
                    path,
                    f"tag key {key!r} is not a plain identifier",
                    "use a name like 'lr_scale' or 'sequence_parallel'",
                )
            )
        elif key not in tags and hasattr(target, key):
            problems.append(
                Problem(
                    path,
                    f"{key!r} is already an attribute of {type(target).__name__}; a tag would shadow it",
                    f"choose another key, e.g. 'tag_{key}'",
                )
            )
    if problems:
        raise ScheduleError("annotate", problems)
    for path in paths:
        tags = sch.annotations.get(path, TAGS) or MappingProxyType({})
        sch = sch.annotate_path(path, TAGS, MappingProxyType({**tags, key: value}))
    return sch


def apply_tags(model: nn.Module, sch: Schedule) -> None:
    """Set the tags as attributes on ``model``'s parameters/modules (build's copy)."""
    for path, tags in sch.annotations.of_kind(TAGS).items():
        target = resolve_target(model, path)
        for key, value in tags.items():
            if isinstance(target, nn.Module):
                object.__setattr__(target, key, value)
            else:
                setattr(target, key, value)
