"""Pure optimizers over pytrees of (D)Tensors, optax's shape on torch's own kernels.

``init, update = sf.optim.adamw(3e-4, weight_decay=0.1)`` gives two functions:

* ``init(params) -> state``: a pytree (plain dicts of tensors) with every moment in its
  parameter's layout, so ``sf.save(model, state, path)`` / ``sf.load`` checkpoint it and
  load it under another layout;
* ``update(grads, state, params, *, donate=True) -> (params, state)``: one step. With
  ``donate=True`` (JAX's ``donate_argnums``) the given parameter and state tensors are
  updated in place and returned; with ``donate=False`` new ones are returned and the
  inputs are unchanged.

The arithmetic is ``torch.optim``'s own functional kernels (``torch.optim.adamw.adamw``
and ``torch.optim.sgd.sgd``, their ``foreach`` and ``fused`` paths), so the numbers are
those of ``torch.optim.AdamW``/``SGD`` step for step. They run on each leaf's local shard
(the update is elementwise, and a parameter, its gradient and its moments share one
layout), which also makes gradients on different meshes (TP and FSDP) one call. A
gradient in another layout than its parameter is redistributed to it first; a ``None``
gradient leaves its parameter and state as they are (as ``torch.optim`` skips it).

Example:
    >>> import torch, slapo_fn as sf
    >>> init, update = sf.optim.sgd(0.1)
    >>> params = {"w": torch.ones(2)}
    >>> state = init(params)
    >>> params, state = update({"w": torch.ones(2)}, state, params)
    >>> [round(x, 6) for x in params["w"].tolist()]
    [0.9, 0.9]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as _adamw_kernel
from torch.optim.sgd import sgd as _sgd_kernel

from .errors import Problem, ScheduleError, ScheduleTypeError

__all__ = ["Optimizer", "adamw", "sgd"]

Tree = Any
LearningRate = float | Callable[[int], float]


class Optimizer(NamedTuple):
    """``(init, update)``: unpack it as ``init, update = sf.optim.adamw(...)``."""

    init: Callable[[Tree], dict[str, Any]]
    update: Callable[..., tuple[Tree, dict[str, Any]]]


def _check(name: str, value: float, low: float = 0.0, high: float | None = None) -> Problem | None:
    if value < low or (high is not None and value >= high):
        span = f"in [{low}, {high})" if high is not None else f">= {low}"
        return Problem(name, f"is {value}, must be {span}", f"{name}={low if high is None else (low + high) / 2}")
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _leaves(tree: Tree, structure: pytree.TreeSpec, what: str) -> list[Any]:
    leaves, spec = pytree.tree_flatten(tree)
    if spec != structure:
        raise ScheduleTypeError("update", [Problem(what, f"has structure {spec}, the params {structure}",
                                                   f"pass {what} for the same params (same keys)")])
    return leaves


def _like_param(g: torch.Tensor, p: torch.Tensor, path: int) -> torch.Tensor:
    """``g`` in ``p``'s layout (a no-op when they agree, the usual case)."""
    if isinstance(p, DTensor):
        if not isinstance(g, DTensor):
            raise ScheduleTypeError("update", [Problem(f"grads leaf {path}", "is a plain tensor for a DTensor "
                                                                            "parameter", "pass the gradients "
                                                                                         "value_and_grad returned")])
        if g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
            g = g.redistribute(p.device_mesh, p.placements)
    elif isinstance(g, DTensor):
        g = g.full_tensor()
    return g


def _copy(tree: Tree) -> Tree:
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


class _Step(NamedTuple):
    """What an ``update`` works on: the (copied, without donation) params and state, the
    params' leaves and structure, the gradient leaves, and the indices of the leaves that
    have both a tensor and a gradient (the others are left alone, as ``torch.optim`` skips
    a ``None`` gradient)."""

    params: Tree
    state: dict[str, Any]
    leaves: list[Any]
    structure: pytree.TreeSpec
    grads: list[Any]
    keep: list[int]


def _step(grads: Tree, state: dict[str, Any], params: Tree, donate: bool) -> _Step:
    if not donate:
        params, state = _copy(params), _copy(state)
    ps, structure = pytree.tree_flatten(params)
    gs = _leaves(grads, structure, "grads")
    keep = [i for i, (p, g) in enumerate(zip(ps, gs, strict=True))
            if isinstance(p, torch.Tensor) and isinstance(g, torch.Tensor)]
    return _Step(params, state, ps, structure, gs, keep)


def _zeros(params: Tree) -> Tree:
    """A tree like ``params`` with a zero tensor of each tensor leaf's layout (``None``
    for other leaves)."""
    with torch.no_grad():
        return pytree.tree_map(
            lambda p: torch.zeros_like(p, memory_format=torch.preserve_format)
            if isinstance(p, torch.Tensor) else None, params)


def _step_counter(p: torch.Tensor, *, on_device: bool) -> torch.Tensor:
    """A zero step count for ``p`` where ``torch.optim`` hosts it (its ``_init_group``):
    float32 on ``p``'s (local) device for the fused and capturable kernels, else on the
    CPU in the default float dtype's precision (float64 under a float64 default)."""
    if on_device:
        return torch.zeros((), dtype=torch.float32, device=_local(p).device)
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.zeros((), dtype=dtype)


def _lr(lr: LearningRate, step: int) -> float:
    return float(lr(step)) if callable(lr) else float(lr)


def adamw(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
) -> Optimizer:
    """AdamW (decoupled weight decay), the numbers of ``torch.optim.AdamW`` with the same
    arguments. ``lr`` may be a schedule ``step -> lr`` (``step`` counts from 1).

    State: ``{"step": tree, "exp_avg": tree, "exp_avg_sq": tree}`` (and
    ``"max_exp_avg_sq"`` with ``amsgrad``), each tree shaped like the params; ``step``
    holds one scalar per parameter where ``torch.optim.AdamW`` keeps it: on the
    parameter's device with ``fused=True`` (the fused kernels count steps there, and a
    CUDA parameter with a CPU step would not run), else on the CPU (the foreach and
    for-loop kernels read it on the host each step) — see :func:`_step_counter`.

    Example:
        >>> import torch, slapo_fn as sf
        >>> init, update = sf.optim.adamw(0.1, weight_decay=0.0)
        >>> p = {"w": torch.tensor([1.0])}
        >>> p, s = update({"w": torch.tensor([0.5])}, init(p), p)
        >>> round(p["w"].item(), 4), s["step"]["w"].item()
        (0.9, 1.0)
    """
    problems = [x for x in (_check("betas[0]", betas[0], 0.0, 1.0), _check("betas[1]", betas[1], 0.0, 1.0),
                            _check("eps", eps), _check("weight_decay", weight_decay),
                            None if callable(lr) else _check("lr", lr)) if x is not None]
    if problems:
        raise ScheduleError("sf.optim.adamw", problems)
    moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())

    def init(params: Tree) -> dict[str, Any]:
        state: dict[str, Any] = {"step": pytree.tree_map(
            lambda p: _step_counter(p, on_device=bool(fused)) if isinstance(p, torch.Tensor) else None, params)}
        for name in moments:
            state[name] = _zeros(params)
        return state

    def update(grads: Tree, state: dict[str, Any], params: Tree, *, donate: bool = True) -> tuple[Tree, dict[str, Any]]:
        params, state, ps, structure, gs, keep = _step(grads, state, params, donate)
        columns = {name: _leaves(state[name], structure, f"state[{name!r}]") for name in ("step", *moments)}
        if not keep:
            return params, state
        with torch.no_grad():
            steps = [columns["step"][i] for i in keep]
            rate = _lr(lr, int(steps[0].item()) + 1) if callable(lr) else float(lr)
            _adamw_kernel(
                [_local(ps[i]) for i in keep],
                [_local(_like_param(gs[i], ps[i], i)) for i in keep],
                [_local(columns["exp_avg"][i]) for i in keep],
                [_local(columns["exp_avg_sq"][i]) for i in keep],
                [_local(columns["max_exp_avg_sq"][i]) for i in keep] if amsgrad else [],
                steps,
                foreach=foreach,
                fused=fused,
                has_complex=any(torch.is_complex(ps[i]) for i in keep),
                amsgrad=amsgrad,
                beta1=betas[0],
                beta2=betas[1],
                lr=rate,
                weight_decay=weight_decay,
                eps=eps,
                maximize=maximize,
            )
        return params, state

    return Optimizer(init, update)


def sgd(
    lr: LearningRate,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    *,
    nesterov: bool = False,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
) -> Optimizer:
    """SGD with momentum, the numbers of ``torch.optim.SGD`` with the same arguments.

    State: ``{"step": scalar, "momentum_buffer": tree}`` (``momentum_buffer`` only with
    ``momentum``); as in ``torch.optim``, the first step starts the buffer at the gradient.
    """
    problems = [x for x in (_check("momentum", momentum), _check("dampening", dampening),
                            _check("weight_decay", weight_decay), None if callable(lr) else _check("lr", lr))
                if x is not None]
    if nesterov and (momentum <= 0 or dampening != 0):
        problems.append(Problem("nesterov", "needs momentum > 0 and dampening 0", "nesterov=False"))
    if problems:
        raise ScheduleError("sf.optim.sgd", problems)

    def init(params: Tree) -> dict[str, Any]:
        state: dict[str, Any] = {"step": torch.zeros((), dtype=torch.float32)}
        if momentum:
            state["momentum_buffer"] = _zeros(params)
        return state

    def update(grads: Tree, state: dict[str, Any], params: Tree, *, donate: bool = True) -> tuple[Tree, dict[str, Any]]:
        params, state, ps, structure, gs, keep = _step(grads, state, params, donate)
        bufs = _leaves(state["momentum_buffer"], structure, "state['momentum_buffer']") if momentum else None
        with torch.no_grad():
            step = int(state["step"].item())
            first = step == 0
            buffers: list[torch.Tensor | None] = (
                [None if first else _local(bufs[i]) for i in keep] if bufs is not None else [None for _ in keep])
            if keep:
                _sgd_kernel(
                    [_local(ps[i]) for i in keep],
                    [_local(_like_param(gs[i], ps[i], i)) for i in keep],
                    buffers,
                    foreach=foreach,
                    fused=fused,
                    weight_decay=weight_decay,
                    momentum=momentum,
                    lr=_lr(lr, step + 1),
                    dampening=dampening,
                    nesterov=nesterov,
                    maximize=maximize,
                )
            if bufs is not None and first:  # torch started each buffer at the gradient: keep it in its layout
                for i, buf in zip(keep, buffers, strict=True):
                    assert buf is not None
                    _local(bufs[i]).copy_(buf)
            state["step"].add_(1)
        return params, state

    return Optimizer(init, update)
