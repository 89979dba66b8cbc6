"""Partial ``replace`` and ``checkpoint``: act on a matched subgraph of a traced module."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ...errors import Problem, ScheduleError, ScheduleTypeError
from ...schedule import Key, Schedule
from .find import Match
from .outline import Outlined, outline

__all__ = ["checkpoint_subgraph", "replace_subgraph"]

T = TypeVar("T")


class FunctionModule(nn.Module):
    """A function as a module (a replacement given as a plain function)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn
        self.__signature__ = inspect.signature(fn)

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def _positional(fn: Callable[..., Any]) -> tuple[list[str], bool] | None:
    try:
        sig = getattr(fn, "__signature__", None) or inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in sig.parameters.values() if p.kind in kinds]
    return names, any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values())


def _meta(node: fx.Node) -> Any:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), val.dtype)
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return (tuple(tm.shape), tm.dtype)
    return None


def _check(path: str, match: Match, new: nn.Module, o: Outlined) -> list[Problem]:
    problems: list[Problem] = []
    forward = new.fn if isinstance(new, FunctionModule) else new.forward
    pos = _positional(forward)
    wanted = list(match.input_names)
    shown = f"({', '.join(wanted)})"
    if pos is not None:
        names, var = pos
        if not var and len(names) != len(wanted):
            problems.append(
                Problem(
                    path,
                    f"the replacement takes {len(names)} inputs ({', '.join(names)}), the subgraph has "
                    f"{len(wanted)} {shown}",
                    f"write it as forward{shown}",
                )
            )
        elif not var and set(names) == set(wanted) and names != wanted:
            problems.append(
                Problem(
                    path,
                    f"the replacement's inputs ({', '.join(names)}) are the subgraph's {shown} in another order; "
                    "they are passed in the subgraph's order",
                    f"reorder its parameters to forward{shown}",
                )
            )
    if o.declared_inputs != len(o.inputs):
        problems.append(Problem(path, "the subgraph reads values it does not declare", "match a larger pattern"))
    if problems:
        return problems
    metas = [_meta(n) for n in o.inputs]
    outs = [_meta(n) for n in o.outputs]
    if any(m is None for m in metas) or any(m is None for m in outs):
        return problems  # no shapes recorded (trace with example_inputs to check them)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            args = [mode.from_tensor(torch.empty(s, dtype=d)) for s, d in metas]  # type: ignore[misc]
            got = new(*args)
    except Exception as e:
        return [Problem(path, f"the replacement fails on the subgraph's inputs: {type(e).__name__}: {e}", "")]
    got_list = list(got) if isinstance(got, tuple | list) else [got]
    shapes = [(tuple(g.shape), g.dtype) if isinstance(g, torch.Tensor) else None for g in got_list]
    if shapes != outs:
        problems.append(
            Problem(
                path,
                f"the replacement returns {shapes}, the subgraph {outs}",
                "return the subgraph's outputs, in its order",
            )
        )
    return problems


def replace_subgraph(sch: Schedule, path: str, new: nn.Module | Callable[..., Any], match: Match) -> Schedule:
    """``replace(sch, path, new, subgraph=match)``: see :func:`slapo_fn.replace`."""
    if isinstance(new, nn.Module):
        module = new
    elif callable(new):
        module = FunctionModule(new)
    else:
        raise ScheduleTypeError(
            "replace",
            [Problem(path, f"the replacement must be a module or a function, got {type(new).__name__}", "")],
        )
    problems: list[Problem] = []

    def make(o: Outlined) -> nn.Module:
        problems.extend(_check(path, match, module, o))
        return module

    result, _ = outline(sch, path, match, "replace", "replaced", make, inline_leaves=False)
    if problems:
        raise ScheduleError("replace", problems)
    return result


def checkpoint_subgraph(sch: Schedule, path: str, match: Match, key: Key[T], spec: T) -> Schedule:
    """``checkpoint(sch, path, subgraph=match)``: the subgraph becomes a module, checkpointed."""
    result, new_path = outline(sch, path, match, "checkpoint", "checkpointed", lambda o: o.region)
    return result.annotate_path(new_path, key, spec)
