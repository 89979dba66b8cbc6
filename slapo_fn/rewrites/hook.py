"""``hook``: forward-pre, forward and backward hooks on the built model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..combinators import primitive
from ..errors import Problem, ScheduleError, ScheduleTypeError
from ..schedule import Annotations, Key, Schedule
from ..select import Selection
from ..tree import get_module

__all__ = ["HOOKS", "HOOK_MODES", "MOVABLE_MODES", "HookSpec", "apply_hooks", "hook", "move_hooks"]

HOOKS: Key[tuple[HookSpec, ...]] = Key("hooks")
HOOK_MODES = ("fwd_pre", "fwd_post", "bwd_pre", "bwd_post")


@dataclass(frozen=True)
class HookSpec:
    mode: str
    fn: Callable[..., Any]
    with_kwargs: bool = False

    def __str__(self) -> str:
        return f"{self.mode}:{getattr(self.fn, '__qualname__', 'fn')}"


@primitive
def hook(sch: Schedule, where: Selection, mode: str, fn: Callable[..., Any], *, with_kwargs: bool = False) -> Schedule:
    """Register ``fn`` on the selected modules of the built model.

    ``mode`` is ``"fwd_pre"`` (``fn(module, args)``, may return new args),
    ``"fwd_post"`` (``fn(module, args, output)``, may return a new output), ``"bwd_pre"``
    (``fn(module, grad_output)``) or ``"bwd_post"`` (``fn(module, grad_input,
    grad_output)``, PyTorch's full backward hook). ``with_kwargs=True`` passes forward
    keyword arguments too (forward modes only). Hooks are registered in the order the
    rewrites were applied. Returns a new schedule; the input is unchanged.

    Example:
        >>> import torch, torch.nn as nn, slapo_fn as sf
        >>> sch = sf.create_schedule(nn.Sequential(nn.Linear(2, 2)))
        >>> sch = sf.hook(sch, "0", "fwd_post", lambda mod, args, out: out * 0)
        >>> sf.build(sch)(torch.ones(1, 2)).abs().sum().item()
        0.0
    """
    paths = where.modules(sch.module)
    if mode not in HOOK_MODES:
        raise ScheduleError(
            "hook", [Problem(p, f"unknown hook mode {mode!r}", f"use one of {', '.join(HOOK_MODES)}") for p in paths]
        )
    if not callable(fn):
        raise ScheduleTypeError(
            "hook",
            [
                Problem(
                    p,
                    f"the hook must be callable, got {type(fn).__name__}",
                    "pass a function, e.g. lambda module, args, output: None",
                )
                for p in paths
            ],
        )
    if with_kwargs and mode.startswith("bwd"):
        raise ScheduleError(
            "hook", [Problem(p, "with_kwargs applies to forward hooks only", "drop with_kwargs=True") for p in paths]
        )
    spec = HookSpec(mode, fn, with_kwargs)
    for path in paths:
        sch = sch.annotate_path(path, HOOKS, (*sch.annotations.get(path, HOOKS, ()), spec))
    return sch


def apply_hooks(model: nn.Module, sch: Schedule) -> None:
    """Register the schedule's hooks on ``model`` (build's private copy)."""
    for path, specs in sch.annotations.of_kind(HOOKS).items():
        module = get_module(model, path)
        for spec in specs:
            if spec.mode == "fwd_pre":
                module.register_forward_pre_hook(spec.fn, with_kwargs=spec.with_kwargs)
            elif spec.mode == "fwd_post":
                module.register_forward_hook(spec.fn, with_kwargs=spec.with_kwargs)
            elif spec.mode == "bwd_pre":
                module.register_full_backward_pre_hook(spec.fn)
            else:
                module.register_full_backward_hook(spec.fn)


#: Hook modes whose meaning survives moving them to a module that replaces a subgraph:
#: a forward-pre hook still runs before the computation, a backward-post hook still sees
#: the gradients of the inputs. Forward-post and backward-pre hooks see one inner
#: module's output, which no longer exists on its own.
MOVABLE_MODES = ("fwd_pre", "bwd_post")


def move_hooks(sch: Schedule, sources: Sequence[str], dest: str, what: str) -> Schedule:
    """A new schedule in which the schedule hooks of the modules at ``sources`` (and
    below them), whose calls a subgraph rewrite folds into the module at ``dest``, are
    registered on ``dest`` instead; forward-pre and backward-post hooks move, any other
    hook would be silently dropped and is a :class:`ScheduleError` naming it and its path.
    The input is unchanged."""
    hooked = sch.annotations.of_kind(HOOKS)
    found = [(p, hooked[p]) for p in hooked if any(p == s or p.startswith(s + ".") for s in sources)]
    problems = [
        Problem(
            p,
            f"its {spec} hook would be dropped: {dest!r} replaces the subgraph that calls it, and a "
            f"{spec.mode} hook of an inner module has no equivalent on the new module",
            "remove the hook (register it on the enclosing module or on the new one after this rewrite), "
            "or leave this module out of the matched subgraph",
        )
        for p, specs in found
        for spec in specs
        if spec.mode not in MOVABLE_MODES or p not in sources
    ]
    if problems:
        raise ScheduleError(what, problems)
    if not found:
        return sch
    moved = tuple(spec for _, specs in found for spec in specs)
    data = {p: dict(kinds) for p, kinds in sch.annotations.items()}
    for p, _ in found:
        del data[p][HOOKS.name]
        if not data[p]:
            del data[p]
    data.setdefault(dest, {})[HOOKS.name] = (*sch.annotations.get(dest, HOOKS, ()), *moved)
    return sch.evolve(annotations=Annotations(data))
