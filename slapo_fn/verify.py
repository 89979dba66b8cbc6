"""``verify``: forward and backward parity of a schedule against a reference model."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import distribute_tensor

from .build import _has_meta, build
from .combinators import Rewrite
from .dtensor.collectives import _all_gather
from .dtensor.sequence import SEQ
from .dtensor.shard import ROLE, mesh_dims
from .errors import Problem, ScheduleTypeError, VerificationError
from .schedule import Schedule, create_schedule
from .tree import private_copy, walk

__all__ = ["VerifyReport", "verified", "verify"]

_TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
}


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)
    return (full_tensor() if callable(full_tensor) else t).detach()


def _leaves(value: Any, name: str = "output") -> list[tuple[str, torch.Tensor]]:
    """Tensors inside nested tuples/lists/dicts (Hugging Face ``ModelOutput`` included)."""
    if isinstance(value, torch.Tensor):
        return [(name, value)]
    if isinstance(value, Mapping):
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{name}.{k}")]
    if isinstance(value, list | tuple):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{name}[{i}]")]
    return []


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else math.inf
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float | None, atol: float | None) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    r, t = _TOLERANCES.get(a.dtype, (1e-5, 1e-8))
    return torch.allclose(a, b, rtol=r if rtol is None else rtol, atol=t if atol is None else atol)


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` compared: max abs difference per output and per gradient."""

    outputs: Mapping[str, float]
    gradients: Mapping[str, float] = field(default_factory=dict)

    @property
    def max_output_diff(self) -> float:
        return max(self.outputs.values(), default=0.0)

    @property
    def max_grad_diff(self) -> float:
        return max(self.gradients.values(), default=0.0)

    def __str__(self) -> str:
        return (
            f"verified {len(self.outputs)} outputs (max |diff| {self.max_output_diff:.3g}) and "
            f"{len(self.gradients)} gradients (max |diff| {self.max_grad_diff:.3g})"
        )


def _run(model: nn.Module, inputs: tuple[Any, ...], kwargs: Mapping[str, Any], seed: int) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model(*inputs, **kwargs)


Gather = Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]


def _no_gather(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return t


class _Ranks:
    """How ``verify`` runs inside a process group (a schedule with a mesh, on every
    rank): local activation shards are all-gathered to the reference's shape, and every
    verdict is agreed on by all ranks (so that they all take the same path through the
    collectives and all raise the same error)."""

    def __init__(self, sch: Schedule) -> None:
        self.active = sch.mesh is not None and dist.is_initialized() and dist.get_world_size() > 1
        self.gather: Gather = _no_gather
        if not self.active or sch.mesh is None:
            return
        axes = {r.mesh_axis for r in sch.annotations.of_kind(ROLE).values()}
        axes |= {q.mesh_axis for q in sch.annotations.of_kind(SEQ).values()}
        if len(axes) != 1:
            return
        dims = mesh_dims(sch.mesh)
        axis = (sch.mesh, dims.index(axes.pop()))
        size = int(sch.mesh.size(axis[1]))

        def gather(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
            """A local shard (activations travel as local tensors between sharded modules:
            heads, features or sequence positions of this rank) → the full tensor. Shapes
            are the same on every rank, so every rank decides alike."""
            if tuple(t.shape) == shape or t.dim() != len(shape):
                return t
            diff = [d for d in range(t.dim()) if t.shape[d] != shape[d]]
            if len(diff) != 1 or t.shape[diff[0]] * size != shape[diff[0]]:
                return t
            return _all_gather(t.detach(), diff[0], axis)

        self.gather = gather

    def gathered(self, values: list[Any]) -> list[Any]:
        """``values`` of every rank (the local one alone outside a process group)."""
        if not self.active:
            return values
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, values)
        return [v for rank in out for v in rank]

    def agree(self, diffs: dict[str, float], bad: list[str]) -> tuple[dict[str, float], list[str]]:
        """The verdict of all ranks: per name the worst difference anywhere, bad if bad
        anywhere (``diffs``/``bad`` unchanged outside a process group)."""
        if not self.active:
            return diffs, bad
        every = self.gathered([(diffs, bad)])
        return {n: max(d[n] for d, _ in every) for n in diffs}, [n for n in diffs if any(n in b for _, b in every)]


def _module_outputs(
    model: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    seed: int,
    shapes: Mapping[str, list[tuple[int, ...]]] | None = None,
    gather: Gather = _no_gather,
) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Every module's output leaves, in the order the modules finished (first call only);
    with ``shapes`` (the reference's), local shards are gathered to those shapes."""
    seen: dict[str, list[tuple[str, torch.Tensor]]] = {}
    handles = []

    def record(path: str) -> Callable[..., None]:
        def hook(_: nn.Module, __: Any, output: Any) -> None:
            if path not in seen:
                leaves = [(n, _full(t)) for n, t in _leaves(output)]
                want = (shapes or {}).get(path)
                if want is not None and len(want) == len(leaves):
                    leaves = [(n, gather(t, w)) for (n, t), w in zip(leaves, want, strict=True)]
                seen[path] = leaves

        return hook

    for path, module in walk(model):
        handles.append(module.register_forward_hook(record(path)))
    try:
        with torch.no_grad():
            _run(model, inputs, kwargs, seed)
    finally:
        for h in handles:
            h.remove()
    return seen


def _first_divergence(
    ref: nn.Module,
    built: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    seed: int,
    rtol: float | None,
    atol: float | None,
    ranks: _Ranks,
) -> tuple[str | None, float]:
    ref_outs = _module_outputs(ref, inputs, kwargs, seed)
    shapes = {p: [tuple(t.shape) for _, t in leaves] for p, leaves in ref_outs.items()}
    built_outs = _module_outputs(built, inputs, kwargs, seed, shapes, ranks.gather)
    found: tuple[int, str, float] | None = None
    for i, (path, leaves) in enumerate(ref_outs.items()):
        other = built_outs.get(path)
        if other is None or len(other) != len(leaves):
            continue
        for (_, a), (_, b) in zip(leaves, other, strict=True):
            if not _close(b, a, rtol, atol):
                found = (i, path or "<root>", _diff(a, b))
                break
        if found is not None:
            break
    # every rank's first divergence; the earliest in execution order wins (the same on every rank)
    first = min((f for f in ranks.gathered([found]) if f is not None), default=None)
    return (None, 0.0) if first is None else (first[1], first[2])


def verify(
    sch: Schedule,
    *inputs: Any,
    reference: nn.Module | None = None,
    backward: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    train: bool = False,
    seed: int = 0,
    kwargs: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Check that the built schedule computes what ``reference`` computes.

    Runs ``reference`` (default: the model given to :func:`create_schedule`) and
    ``build(sch)`` on the same weights (no copies: both view the original storage) and
    inputs, compares every output tensor and, with ``backward=True``, every parameter
    gradient (DTensors gathered) after back-propagating the same random cotangents.
    Models run in eval mode unless ``train=True`` (then with the same RNG seed).
    Meta-device models are materialised with ``init="full"`` and ``seed``.

    Raises :class:`VerificationError` naming the first module (FQN, in execution order)
    whose output diverged, or the parameters whose gradients differ. Tolerances default
    to ``torch.testing``'s for the dtype.

    Distributed: with a mesh in a running process group, call it on every rank (each
    with the same full weights and inputs). DTensor outputs and gradients are gathered
    with ``full_tensor()``, local activation shards (features, heads or sequence
    positions of this rank) are all-gathered to the reference's shape before they are
    compared, and the verdict is agreed on by all ranks: every rank returns the same
    report or raises the same error, naming the earliest diverging module seen on any
    rank.

    Example:
        >>> import torch, torch.nn as nn, slapo_fn as sf
        >>> sch = sf.checkpoint(sf.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.Tanh())), "0")
        >>> print(sf.verify(sch, torch.randn(2, 4)))
        verified 1 outputs (max |diff| 0) and 2 gradients (max |diff| 0)
    """
    kwargs = dict(kwargs or {})
    reference = sch.original if reference is None else reference
    assert reference is not None
    if any(_has_meta(m) for m in (*reference.modules(), *sch.module.modules())):
        ref = build(create_schedule(reference), init="full", seed=seed)
        built = build(sch, init="full", seed=seed)
    else:
        ref = private_copy(reference, copy_data=False)
        built = build(sch, copy=False)
    ref.train(train)
    built.train(train)

    ranks = _Ranks(sch)
    out_ref = _leaves(_run(ref, inputs, kwargs, seed))
    out_built = _leaves(_run(built, inputs, kwargs, seed))
    if len(out_ref) == len(out_built):  # outputs left as local shards (e.g. vocab-sharded logits)
        out_built = [(n, ranks.gather(b, tuple(a.shape))) for (_, a), (n, b) in zip(out_ref, out_built, strict=True)]
    if [n for n, _ in out_ref] != [n for n, _ in out_built]:
        raise VerificationError(
            f"the outputs differ in structure: reference has {[n for n, _ in out_ref]}, "
            f"the schedule {[n for n, _ in out_built]}",
            module="<root>",
            max_abs_diff=math.inf,
        )
    full = [(n, _full(a), _full(b)) for (n, a), (_, b) in zip(out_ref, out_built, strict=True)]  # one gather each
    diffs = {n: _diff(a, b) for n, a, b in full}
    bad = [n for n, a, b in full if not _close(b, a, rtol, atol)]
    diffs, bad = ranks.agree(diffs, bad)
    if bad:
        module, diff = _first_divergence(ref, built, inputs, kwargs, seed, rtol, atol, ranks)
        where = (
            f"first diverging module: {module!r} (max |diff| {diff:.3g})"
            if module
            else "no single module's output diverged first"
        )
        raise VerificationError(
            f"outputs {', '.join(bad)} differ (max |diff| {max(diffs[n] for n in bad):.3g}); {where}",
            module=module,
            max_abs_diff=max(diffs[n] for n in bad),
        )
    if not backward:
        return VerifyReport(outputs=diffs)

    gen = torch.Generator().manual_seed(seed)
    pairs = [
        (a, b) for (_, a), (_, b) in zip(out_ref, out_built, strict=True) if a.is_floating_point() and a.requires_grad
    ]
    cotangents = [torch.randn(a.shape, generator=gen, dtype=a.dtype).to(a.device) for a, _ in pairs]
    if pairs:
        torch.autograd.backward([a for a, _ in pairs], cotangents)
        torch.autograd.backward(
            [b for _, b in pairs], [_like(c, b) for c, (_, b) in zip(cotangents, pairs, strict=True)]
        )
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    built_params = dict(built.named_parameters())
    grad_diffs: dict[str, float] = {}
    bad_grads: list[str] = []
    for name, g in ref_grads.items():
        p = built_params.get(name)
        if p is None:
            continue
        gb = torch.zeros_like(g) if p.grad is None else _full(p.grad)
        grad_diffs[name] = _diff(g, gb)
        if not _close(gb, g, rtol, atol):
            bad_grads.append(name)
    grad_diffs, bad_grads = ranks.agree(grad_diffs, bad_grads)
    if bad_grads:
        worst = max(grad_diffs[n] for n in bad_grads)
        raise VerificationError(
            f"gradients of {len(bad_grads)} parameter(s) differ (max |diff| {worst:.3g}), outputs match: "
            f"{', '.join(bad_grads[:6])}{' …' if len(bad_grads) > 6 else ''}",
            parameters=bad_grads,
            max_abs_diff=worst,
        )
    return VerifyReport(outputs=diffs, gradients=grad_diffs)


def _like(cotangent: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """The reference cotangent in the form of the scheduled output (a DTensor there)."""
    placements = getattr(output, "placements", None)
    if placements is None:
        return cotangent
    return distribute_tensor(cotangent, output.device_mesh, placements)  # type: ignore[attr-defined]


@dataclass(frozen=True, repr=False)
class Verified(Rewrite):
    rewrite: Rewrite
    inputs: tuple[Any, ...]
    options: tuple[tuple[str, Any], ...]

    def apply(self, sch: Schedule, base: str = "") -> Schedule:
        new = self.rewrite.apply(sch, base)
        verify(new, *self.inputs, **dict(self.options))
        return new

    def __repr__(self) -> str:
        return f"verified({self.rewrite!r})"


def verified(rewrite: Rewrite, *inputs: Any, **options: Any) -> Rewrite:
    """``rewrite``, checked with :func:`verify` on ``inputs`` as it is applied.

    >>> import torch, torch.nn as nn, slapo_fn as sf
    >>> rw = sf.verified(sf.checkpoint.at("0"), torch.randn(2, 4))
    >>> sch = rw(sf.create_schedule(nn.Sequential(nn.Linear(4, 4))))
    """
    if not isinstance(rewrite, Rewrite):
        raise ScheduleTypeError(
            "verified",
            [
                Problem(
                    "",
                    f"expected a Rewrite, got {type(rewrite).__name__}",
                    "sf.verified(sf.checkpoint.at('layers.0'), inputs)",
                )
            ],
        )
    return Verified(rewrite, inputs, tuple(options.items()))
