"""``replace``: swap modules of the tree for new ones (structural, copy-on-write)."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)

from ..combinators import primitive
from ..errors import Problem, ScheduleError, ScheduleTypeError
from ..hf import is_conv1d
from ..schedule import Schedule
from ..select import Selection
from ..tree import get_module, set_at
from ._common import INSTALLED, Installed
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


#: What fake tensors cannot run (data-dependent shapes, custom kernels): no verdict, not a misfit.
_FAKE_LIMITS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedFakeTensorException,
                UnsupportedOperatorException, NotImplementedError)


def _probe_input(module: nn.Module) -> tuple[tuple[int, ...], torch.dtype] | None:
    """The shape and dtype of an input ``module`` surely accepts, from its parameters alone:
    ``(2, 3, in)`` for a Linear, Conv1D or norm (a leaf whose parameters are 1-D vectors of
    one size), ids for an Embedding; ``None`` where the parameters do not say (activations,
    containers)."""
    if any(True for _ in module.children()) or any(b is not None for b in module._buffers.values()):
        return None  # containers; modules with state a forward may update (BatchNorm's running stats)
    params = {n: p for n, p in module._parameters.items() if p is not None}
    weight = params.get("weight")
    if weight is None:
        return None
    if isinstance(module, nn.Embedding):
        return (2, 3), torch.long
    if isinstance(module, nn.LayerNorm):
        return (2, 3, *module.normalized_shape), weight.dtype
    if isinstance(module, nn.Linear):
        return (2, 3, module.in_features), weight.dtype
    if is_conv1d(module) and weight.dim() == 2:
        return (2, 3, weight.shape[0]), weight.dtype
    if all(p.dim() == 1 and p.shape == weight.shape for p in params.values()):
        return (2, 3, weight.shape[0]), weight.dtype  # a norm (RMSNorm, T5LayerNorm …)
    return None


def _shapes(value: Any) -> list[tuple[int, ...]]:
    """Shapes of the tensors in an output (tuples, lists, dicts, ``ModelOutput``s), in order."""
    if isinstance(value, torch.Tensor):
        return [tuple(value.shape)]
    if isinstance(value, Mapping):
        return [s for v in value.values() for s in _shapes(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _shapes(v)]
    return []


@contextlib.contextmanager
def _quiet_fake_mode() -> Iterator[None]:
    """Fake tensors (shapes only, no memory, no data) with real modules' parameters; the
    fake-tensor logger's report of a failing op is muted (the failure is the answer)."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        # force_eager: a torch.compile'd function must not run its compiled kernels on fake
        # tensors (they have no storage: inductor's C++ code reads null pointers and crashes)
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad(), torch.compiler.set_stance("force_eager"):
            yield
    finally:
        log.setLevel(level)


def _device_of(module: nn.Module) -> torch.device:
    first = next(iter(module.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def shape_problem(path: str, old: nn.Module, new: nn.Module) -> Problem | None:
    """Why ``new`` does not fit where ``old`` is, on an input ``old`` takes (run on fake
    tensors: no data, no memory), or ``None`` if it fits or the check cannot say. The
    forwards are called without hooks: a user's hook never sees the probe."""
    probe = _probe_input(old)
    if probe is None:
        return None
    shape, dtype = probe
    with _quiet_fake_mode():
        try:
            want = _shapes(old.forward(torch.zeros(shape, dtype=dtype, device=_device_of(old))))
        except Exception:
            return None  # the old module does not take what its parameters suggest: no verdict
        try:
            got = _shapes(new.forward(torch.zeros(shape, dtype=dtype, device=_device_of(new))))
        except _FAKE_LIMITS:
            return None
        except Exception as e:
            text = str(e).strip()
            first = text.splitlines()[0] if text else ""
            return Problem(path, f"{type(new).__name__} fails on an input {type(old).__name__} takes, of shape "
                                 f"{shape}: {type(e).__name__}: {first}", _SHAPE_FIX)
    if got != want:
        return Problem(path, f"{type(new).__name__} returns shape(s) {_fmt_shapes(got)} where "
                             f"{type(old).__name__} returns {_fmt_shapes(want)} (for an input of shape {shape})",
                       _SHAPE_FIX)
    return None


_SHAPE_FIX = ("give the replacement the old module's input and output shapes, or replace the enclosing module "
              "(and what reads its output) in one call; check_shapes=False skips this check")


def _fmt_shapes(shapes: list[tuple[int, ...]]) -> str:
    return ", ".join(str(s) for s in shapes) if shapes else "no tensor"


@primitive
def replace(
    sch: Schedule,
    where: Selection,
    new: nn.Module | Factory | Callable[..., Any],
    *,
    subgraph: Match | Sequence[Match] | None = None,
    check_shapes: bool = True,
) -> Schedule:
    """Replace every selected module by ``new`` — a module, or ``new(old_module, path)``
    returning one. Returns a new schedule; the input is unchanged.

    Only the modules on the path from the root to each replaced module are copied;
    everything else (including parameters) is shared. Annotations below a replaced path
    that no longer exist in the new module are dropped. A replacement whose ``forward``
    cannot be called the way the old one is raises :class:`ScheduleError`; so does one
    whose output shapes differ from the old module's where its parameters tell what it
    takes (a Linear, Conv1D, Embedding or norm: both run on fake tensors, no data and no
    memory), e.g. ``nn.Linear(64, 32)`` for a norm of width 64. ``check_shapes=False``
    skips that check (a widening done in two calls: the first one alone misfits).

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
    Schedule hooks of the modules inside the subgraph move to ``new`` (forward-pre,
    backward-post) or, where they would be dropped (forward-post, backward-pre), are a
    :class:`ScheduleError` naming them. An inner value also read outside the subgraph is
    computed again outside it. A *list* of matches that read the same input
    (``subgraph=[m_q, m_k, m_v]``) is replaced by one module taking their inputs (each
    once) and returning a tuple of all their outputs, in order (horizontal fusion);
    overlapping or dependent matches are a :class:`ScheduleError`.

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
        if made is not old:
            problem = signature_problem(path, old, made)
            if problem is None and check_shapes:
                problem = shape_problem(path, old, made)
            if problem is not None:
                problems.append(problem)
        replacements.append((path, made))
    if problems:
        kind = ScheduleTypeError if any("not an nn.Module" in p.reason for p in problems) else ScheduleError
        raise kind("replace", problems)
    root = sch.module
    for path, made in replacements:
        root = set_at(root, path, made)
    out = sch.with_module(root, replaced=paths)
    for path, made in replacements:
        out = out.annotate_path(path, INSTALLED, Installed(type(made).__name__, type(sch.module.get_submodule(path))
                                                           .__name__))
    return out
