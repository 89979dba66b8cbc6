"""``checkpoint``: activation checkpointing, full or selective, without renaming FQNs."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..combinators import primitive
from ..errors import Problem, ScheduleError, ScheduleTypeError
from ..hf import train_without_cache
from ..schedule import Key, Schedule
from ..select import Selection
from ..tree import get_module
from ._common import contains, reject_nested
from .graph.find import Match
from .graph.subgraph import checkpoint_subgraph

__all__ = ["CHECKPOINT", "CheckpointSpec", "apply_checkpoints", "checkpoint"]

CHECKPOINT: Key[CheckpointSpec] = Key("checkpoint")
PolicyFn = Callable[..., CheckpointPolicy]


@dataclass(frozen=True)
class CheckpointSpec:
    """How a module is checkpointed: ``save`` ops (selective), a policy function, or
    neither (full recomputation)."""

    save: frozenset[torch._ops.OpOverload] | None = None
    policy_fn: PolicyFn | None = None

    def __str__(self) -> str:
        if self.policy_fn is not None:
            return f"checkpoint(policy={getattr(self.policy_fn, '__name__', 'fn')})"
        if self.save is not None:
            return f"checkpoint(save={sorted(str(op) for op in self.save)})"
        return "checkpoint"

    def policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if self.policy_fn is not None:
            return self.policy_fn(ctx, op, *args, **kwargs)
        assert self.save is not None
        return CheckpointPolicy.MUST_SAVE if op in self.save else CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn(self) -> Callable[[], Any] | None:
        if self.save is None and self.policy_fn is None:
            return None
        return functools.partial(create_selective_checkpoint_contexts, self.policy)


def _spec(policy: object, paths: tuple[str, ...]) -> CheckpointSpec:
    if policy is None:
        return CheckpointSpec()
    if isinstance(policy, torch._ops.OpOverloadPacket | torch._ops.OpOverload):
        policy = [policy]
    if isinstance(policy, Sequence) and not isinstance(policy, str):
        ops: set[torch._ops.OpOverload] = set()
        bad = []
        for op in policy:
            if isinstance(op, torch._ops.OpOverloadPacket):
                ops.update(getattr(op, name) for name in op.overloads())
            elif isinstance(op, torch._ops.OpOverload):
                ops.add(op)
            else:
                bad.append(op)
        if not bad:
            return CheckpointSpec(save=frozenset(ops))
    elif callable(policy):
        return CheckpointSpec(policy_fn=policy)  # type: ignore[arg-type]
    raise ScheduleTypeError(
        "checkpoint",
        [
            Problem(
                p,
                f"policy must be None, a list of aten ops to save, or fn(ctx, op, *args, **kwargs) -> "
                f"CheckpointPolicy; got {policy!r}",
                "checkpoint(sch, where, policy=[torch.ops.aten.mm, torch.ops.aten.addmm])",
            )
            for p in paths
        ],
    )


@primitive
def checkpoint(sch: Schedule, where: Selection, *, policy: object = None, subgraph: Match | None = None) -> Schedule:
    """Recompute the selected modules' activations in backward instead of keeping them.

    ``policy=None`` recomputes everything; a list of aten ops (``torch.ops.aten.mm``)
    keeps those ops' outputs and recomputes the rest (selective checkpointing); a
    ``torch.utils.checkpoint`` policy function decides per op. Built with PyTorch's
    composable checkpoint: parameter names (FQNs) are unchanged. Regions cannot nest.
    With ``subgraph=match`` (from :func:`slapo_fn.find` on the traced module at
    ``where``) only that subgraph is checkpointed: it becomes a module of its own
    (``checkpointed``), called where it was. Returns a new schedule; the input is unchanged.

    Example:
        >>> import torch, torch.nn as nn, slapo_fn as sf
        >>> sch = sf.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
        >>> sch = sf.checkpoint(sch, "0")
        >>> sch = sf.checkpoint(sch, "1", policy=[torch.ops.aten.addmm])
        >>> print(sch["1"].annotations["checkpoint"])
        checkpoint(save=['aten.addmm.default', 'aten.addmm.dtype', 'aten.addmm.dtype_out', 'aten.addmm.out'])
    """
    paths = where.modules(sch.module)
    spec = _spec(policy, paths)
    if subgraph is not None:
        if len(paths) != 1:
            raise ScheduleError(
                "checkpoint", [Problem(p, "a subgraph lives in one traced module", "select one") for p in paths]
            )
        outer = [p for p in sch.annotations.of_kind(CHECKPOINT) if p == paths[0] or contains(p, paths[0])]
        if outer:
            raise ScheduleError(
                "checkpoint",
                [
                    Problem(
                        paths[0],
                        f"checkpoint regions cannot nest: {outer[0]!r} is checkpointed already",
                        "checkpoint either the whole module or subgraphs of it",
                    )
                ],
            )
        return checkpoint_subgraph(sch, paths[0], subgraph, CHECKPOINT, spec)
    existing = [p for p in sch.annotations.of_kind(CHECKPOINT) if p not in paths]
    reject_nested("checkpoint", paths, existing)
    for path in paths:
        sch = sch.annotate_path(path, CHECKPOINT, spec)
    return sch


def apply_checkpoints(model: nn.Module, sch: Schedule) -> None:
    """Install the schedule's checkpoint regions on ``model`` (build's private copy); a
    Hugging Face model then trains without a key/value cache, since recomputation would
    append to it twice (:func:`slapo_fn.hf.train_without_cache`)."""
    regions = sch.annotations.of_kind(CHECKPOINT)
    if regions:
        train_without_cache(model)
    for path, spec in regions.items():
        module = get_module(model, path)
        context_fn = _under_forward_modes(_keeping_running_stats(module, spec.context_fn()))
        # the recomputation restores the forward's RNG state: a dropout in the region draws
        # the forward's masks again (pipeline schedules run other forwards in between)
        composable_checkpoint(module, context_fn=context_fn, preserve_rng_state=True)


Contexts = tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]

#: Whether the code running now is a checkpointed module's forward or its recomputation.
#: The two must run the same ops (the recomputation stops at the forward's last saved
#: tensor): a cache that one of them could read and the other not is left alone in both
#: (a DTensor region's shared moves, :meth:`slapo_fn.dtensor.region.Activations.moved`).
CHECKPOINTED: ContextVar[bool] = ContextVar("slapo_fn_checkpointed", default=False)


def _under_forward_modes(context_fn: Callable[[], Contexts] | None) -> Callable[[], Contexts]:
    """``context_fn`` with a recomputation that runs under the torch-function modes its
    forward ran under. A checkpoint inside a region whose forward runs under such a mode
    (a DTensor region's, :mod:`slapo_fn.dtensor.region`, which promotes plain tensors and
    settles layouts) is recomputed in backward, where no mode is active: the same code
    would meet other values there (plain tensors beside DTensors)."""

    def contexts() -> Contexts:
        forward, recompute = context_fn() if context_fn is not None else (contextlib.nullcontext(),
                                                                          contextlib.nullcontext())
        modes: list[Any] = []

        @contextlib.contextmanager
        def capturing() -> Iterator[None]:
            if not torch.compiler.is_compiling():  # a compiled forward replays its own graph
                modes[:] = torch.overrides._get_current_function_mode_stack()
            token = CHECKPOINTED.set(True)
            try:
                with forward:
                    yield
            finally:
                CHECKPOINTED.reset(token)

        @contextlib.contextmanager
        def replaying() -> Iterator[None]:
            token = CHECKPOINTED.set(True)
            try:
                with contextlib.ExitStack() as stack:
                    for mode in modes:
                        stack.enter_context(mode)
                    with recompute:
                        yield
            finally:
                CHECKPOINTED.reset(token)

        return capturing(), replaying()

    return contexts


def _keeping_running_stats(module: nn.Module, context_fn: Callable[[], Contexts] | None
                           ) -> Callable[[], Contexts] | None:
    """``context_fn`` with a recomputation that leaves the running statistics of the
    region's batch norms as the forward left them: recomputing a batch norm in training
    mode would otherwise fold the same batch into them twice (and count it twice)."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms:
        return context_fn

    def contexts() -> Contexts:
        forward, recompute = context_fn() if context_fn is not None else (contextlib.nullcontext(),
                                                                          contextlib.nullcontext())
        return forward, _stats_frozen(recompute, norms)

    return contexts


@contextlib.contextmanager
def _stats_frozen(inner: contextlib.AbstractContextManager[Any],
                  norms: Sequence[nn.modules.batchnorm._BatchNorm]) -> Iterator[None]:
    """Inside ``inner``, each norm updates its running statistics by a factor of 0 (the
    same kernels and saved tensors as the forward, the statistics unchanged), and its
    batch count is put back after."""
    # set and put back outside ``inner``: a selective checkpoint's recomputation mode would
    # take the copy back for an op of the region
    saved = [(m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        with inner:
            yield
    finally:
        with torch.no_grad():
            for m, (momentum, count) in zip(norms, saved, strict=True):
                m.momentum = momentum
                if count is not None and m.num_batches_tracked is not None:
                    m.num_batches_tracked.copy_(count)
