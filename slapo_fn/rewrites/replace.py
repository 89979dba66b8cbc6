"""``replace``: swap modules of the tree for new ones (structural, copy-on-write)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from ..combinators import primitive
from ..errors import Problem, ScheduleError, ScheduleTypeError
from ..schedule import Schedule
from ..select import Selection
from ..tree import get_module, set_at
from .graph.find import Match
from .graph.subgraph import replace_subgraph

__all__ = ["replace"]

Factory = Callable[[nn.Module, str], nn.Module]


def _params(module: nn.Module) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None


def signature_problem(path: str, old: nn.Module, new: nn.Module) -> Problem | None:
    """Why ``new`` cannot be called where ``old`` is called, or ``None`` if it can."""
    old_ps, new_ps = _params(old), _params(new)
    if old_ps is None or new_ps is None:
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    old_names = {p.name for p in old_ps if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    old_pos = [p for p in old_ps if p.kind in positional]
    old_required = [p for p in old_pos if p.default is p.empty]
    new_pos = [p for p in new_ps if p.kind in positional]
    new_var_pos = any(p.kind is p.VAR_POSITIONAL for p in new_ps)
    new_var_kw = any(p.kind is p.VAR_KEYWORD for p in new_ps)
    old_var_pos = any(p.kind is p.VAR_POSITIONAL for p in old_ps)
    reasons = []
    if not new_var_pos and not old_var_pos and len(new_pos) < len(old_required):
        reasons.append(f"it takes {len(new_pos)} positional arguments, but callers pass {len(old_required)}")
    for i, p in enumerate(new_ps):
        if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name not in old_names and not (p.kind in positional and i < len(old_pos)) and not old_var_pos:
            reasons.append(f"it requires {p.name!r}, which {type(old).__name__}.forward does not take")
    kw_only = [p.name for p in old_ps if p.kind is p.KEYWORD_ONLY]
    missing_kw = [n for n in kw_only if n not in {p.name for p in new_ps} and not new_var_kw]
    if missing_kw:
        reasons.append(f"it does not accept keyword(s) {', '.join(missing_kw)}")
    if not reasons:
        return None
    return Problem(
        path,
        f"{type(new).__name__}.forward{inspect.signature(new.forward)} cannot stand in for "
        f"{type(old).__name__}.forward{inspect.signature(old.forward)}: " + "; ".join(reasons),
        "give the replacement a forward with the same parameters (extra ones need defaults, or take **kwargs)",
    )


@primitive
def replace(
    sch: Schedule,
    where: Selection,
    new: nn.Module | Factory | Callable[..., Any],
    *,
    subgraph: Match | None = None,
) -> Schedule:
    """Replace every selected module by ``new`` — a module, or ``new(old_module, path)``
    returning one. Returns a new schedule; the input is unchanged.

    Only the modules on the path from the root to each replaced module are copied;
    everything else (including parameters) is shared. Annotations below a replaced path
    that no longer exist in the new module are dropped. A replacement whose ``forward``
    cannot be called the way the old one is raises :class:`ScheduleError`.

    Example:
        >>> import torch.nn as nn, slapo_fn as sf
        >>> sch = sf.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        >>> sch = sf.replace(sch, "1", nn.GELU())
        >>> type(sch["1"].module).__name__
        'GELU'
        >>> sch = sf.replace(sch, "*", lambda old, path: old)   # a factory, per match

    With ``subgraph=match`` (from :func:`slapo_fn.find` on the traced module at
    ``where``), only that subgraph is replaced: ``new`` (a module or a function) is
    called with the subgraph's inputs, in the order of the pattern's parameters, and
    must return its outputs (a tuple if several). A replacement whose parameters are
    the pattern's in another order, whose arity differs, or (when the trace recorded
    shapes) whose output shapes differ is refused with a :class:`ScheduleError`.

        >>> import torch, torch.nn.functional as F
        >>> sch = sf.trace(sf.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.ReLU())), "")
        >>> relu, = sf.find(sch, "", lambda x: F.relu(x))
        >>> sch = sf.replace(sch, "", lambda x: F.gelu(x), subgraph=relu)
        >>> [n.target for n in sch.module.graph.nodes if n.op == "call_module"]
        ['0', 'replaced']
    """
    paths = where.modules(sch.module)
    if subgraph is not None:
        if len(paths) != 1:
            raise ScheduleError(
                "replace", [Problem(p, "a subgraph lives in one traced module", "select one") for p in paths]
            )
        return replace_subgraph(sch, paths[0], new, subgraph)
    if isinstance(new, nn.Module):
        if len(paths) > 1:
            raise ScheduleError(
                "replace",
                [
                    Problem(
                        p,
                        "one module instance would be placed at several paths (sharing its parameters)",
                        "pass a factory, e.g. replace(sch, where, lambda old, path: MyModule(...))",
                    )
                    for p in paths
                ],
            )
        factory: Factory = lambda old, path: new
    elif callable(new):
        factory = new
    else:
        raise ScheduleTypeError(
            "replace",
            [
                Problem(
                    p,
                    f"the replacement must be an nn.Module or fn(old, path) -> nn.Module, got {type(new).__name__}",
                    "replace(sch, where, MyModule()) ",
                )
                for p in paths
            ],
        )
    nested = [p for p in paths if any(q != p and p.startswith(q + ".") for q in paths)]
    if nested:
        raise ScheduleError(
            "replace",
            [
                Problem(p, "is inside another selected module", "select either the outer or the inner modules")
                for p in nested
            ],
        )
    problems: list[Problem] = []
    replacements: list[tuple[str, nn.Module]] = []
    for path in paths:
        old = get_module(sch.module, path)
        made = factory(old, path)
        if not isinstance(made, nn.Module):
            problems.append(
                Problem(
                    path,
                    f"the factory returned {type(made).__name__}, not an nn.Module",
                    "return a module from fn(old, path)",
                )
            )
            continue
        if made is not old and (problem := signature_problem(path, old, made)) is not None:
            problems.append(problem)
        replacements.append((path, made))
    if problems:
        kind = ScheduleTypeError if any("not an nn.Module" in p.reason for p in problems) else ScheduleError
        raise kind("replace", problems)
    root = sch.module
    for path, made in replacements:
        root = set_at(root, path, made)
    return sch.with_module(root, replaced=paths)
