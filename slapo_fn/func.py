"""The functional form of a built model, the way JAX users write training loops.

A model is a function plus a pytree of parameters; layouts are partition specs by
mesh-axis name; gradients, clipping and optimizer updates are functions of pytrees
(:mod:`slapo_fn.optim` holds the optimizers)::

    apply_fn, params, buffers = sf.func.functional(model)       # params: FQN -> DTensor
    def loss_fn(params, ids):
        return apply_fn(params, ids, labels=ids).loss
    loss, grads = sf.func.value_and_grad(loss_fn)(params, ids)
    grads, norm = sf.func.clip_by_global_norm(grads, 1.0)
    params, state = update(grads, state, params)                # sf.optim.adamw(...)

``params`` are the built model's own parameter tensors (DTensors on its mesh), not
copies: an update with ``donate=True`` (JAX's ``donate_argnums``) writes them in place,
so the module form sees the same numbers and nothing is allocated per step. Any other
tensors of the same layouts may be passed instead (``apply_fn`` then runs the model
through ``torch.func.functional_call``), which is what ``torch.func.grad`` over
``apply_fn`` does.

Layouts as values: :func:`specs` reads a pytree's partition specs, :func:`shard` lays a
pytree out by specs, :func:`constrain` is ``with_sharding_constraint`` (a differentiable
redistribute) and :func:`local` is ``shard_map`` (torch's ``local_map``) with
:func:`psum` for reductions inside. :func:`global_norm` and :func:`clip_by_global_norm`
are right for gradients on different meshes (a TP sub-mesh and an FSDP mesh), for plain
and DTensor leaves, and across pipeline stages; :func:`clip_grad_norm_` is the module
form for ordinary loops.

Where PyTorch itself cannot transform DTensor code (``vmap`` and ``jvp`` in torch 2.13
fail inside DTensor's sharding propagation), :func:`vmap` and :func:`jvp` raise a
:class:`TransformError` naming the DTensor leaves instead of crashing inside torch.

Example (one process, plain tensors; the same code runs on DTensors):
    >>> import torch, torch.nn as nn, slapo_fn as sf
    >>> model = nn.Linear(4, 2)
    >>> apply_fn, params, _ = sf.func.functional(model)
    >>> x = torch.randn(3, 4)
    >>> loss, grads = sf.func.value_and_grad(lambda p: apply_fn(p, x).square().mean())(params)
    >>> sorted(grads), grads["weight"].shape
    (['bias', 'weight'], torch.Size([2, 4]))
    >>> sf.func.specs(params)["weight"]
    P(None, None)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import local_map
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .dtensor.collectives import reduce as _reduce
from .dtensor.region import placed
from .dtensor.spec import P, Packed, placements_of, spec_of
from .errors import LayoutError, Problem, ScheduleError, ScheduleTypeError
from .pipelines.runner import Pipeline

__all__ = [
    "P",
    "Packed",
    "TransformError",
    "clip_by_global_norm",
    "clip_grad_norm_",
    "constrain",
    "functional",
    "global_norm",
    "grad",
    "jvp",
    "local",
    "psum",
    "shard",
    "specs",
    "value_and_grad",
    "vmap",
]

Tree = Any


class TransformError(ScheduleTypeError):
    """A transform PyTorch cannot apply to DTensor code (``vmap``/``jvp`` in torch 2.13)."""


class NonFiniteNormError(ScheduleError, FloatingPointError):
    """A global norm is ``nan`` or ``inf`` and the caller asked to stop on it."""


# ----------------------------------------------------------------------------- pytrees


def _flat(tree: Tree) -> tuple[list[tuple[str, Any]], pytree.TreeSpec]:
    """Leaves with their paths as text (``['model.embed.weight']``), and the structure."""
    pairs, spec = pytree.tree_flatten_with_path(tree)
    return [(pytree.keystr(kp) or "<root>", leaf) for kp, leaf in pairs], spec


def _mesh_names(mesh: DeviceMesh, path: str) -> tuple[str, ...]:
    names = tuple(mesh.mesh_dim_names or ())
    if len(names) != mesh.ndim:
        raise LayoutError("spec", [Problem(path, "the mesh has no dimension names, so no spec can name its axes",
                                           'init_device_mesh(..., mesh_dim_names=("dp", "tp"))')])
    return names


# ----------------------------------------------------------------------------- the model as a function


@dataclass(frozen=True, eq=False)
class Apply:
    """``apply_fn(params, *args, buffers=None, **kwargs)``: the model's forward with the
    given parameters (and buffers), e.g. ``apply_fn(params, ids, labels=ids).loss``.

    With the model's own parameter tensors (what :func:`functional` returned, updated in
    place) the model runs as it is; with other tensors it runs through
    ``torch.func.functional_call`` (a subset may be given; the rest are the model's).
    """

    module: nn.Module
    own: Mapping[str, torch.Tensor] = field(repr=False)
    fsdp: bool = field(repr=False)

    def __call__(self, params: Mapping[str, torch.Tensor], *args: Any,
                 buffers: Mapping[str, torch.Tensor] | None = None, **kwargs: Any) -> Any:
        if not isinstance(params, Mapping):
            raise ScheduleTypeError("apply_fn", [Problem("params", f"expected a dict FQN -> tensor, got "
                                                                   f"{type(params).__name__}",
                                                         "pass the params that sf.func.functional(model) returned")])
        if buffers is None and all(self.own.get(k) is v for k, v in params.items()):
            return self.module(*args, **kwargs)
        own_buffers = dict(self.module.named_buffers())
        unknown = sorted(set(params) - set(self.own)) + sorted(set(buffers or {}) - set(own_buffers))
        if unknown:
            raise ScheduleError("apply_fn", [Problem(k, "is neither a parameter nor a buffer of the model",
                                                     "use the keys of sf.func.functional(model)") for k in unknown])
        if self.fsdp:
            raise ScheduleTypeError("apply_fn", [Problem(
                "params", "the model is sharded with FSDP2 (sf.data_parallel), which owns its parameters and "
                          "gathers them itself: it cannot run with other tensors in their place",
                "pass the params that sf.func.functional(model) returned (updated in place: donate=True)")])
        return torch.func.functional_call(self.module, {**params, **(buffers or {})}, args, kwargs, strict=False)


@dataclass(frozen=True, eq=False)
class PipelineApply:
    """``apply_fn`` of a :class:`~slapo_fn.Pipeline`: its forward runs together with its
    backward (the pipeline schedule interleaves them), so it is used through
    ``value_and_grad(apply_fn)(params, *inputs, target=y)``."""

    pipeline: Pipeline

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ScheduleTypeError("apply_fn", [Problem(
            "", "a pipeline runs forward and backward together in its schedule; it has no forward on its own",
            "loss, grads = sf.func.value_and_grad(apply_fn)(params, ids, target=labels)")])


def functional(model: nn.Module | Pipeline) -> tuple[Apply | PipelineApply, dict[str, torch.Tensor],
                                                      dict[str, torch.Tensor]]:
    """``(apply_fn, params, buffers)`` of a built model or of this rank's pipeline stages.

    ``params`` maps each FQN to the model's own parameter (a DTensor on a mesh), tied
    parameters once; ``buffers`` likewise. See :class:`Apply` and :class:`PipelineApply`.

    Example:
        >>> import torch.nn as nn, slapo_fn as sf
        >>> apply_fn, params, buffers = sf.func.functional(nn.Linear(2, 3))
        >>> {k: tuple(v.shape) for k, v in params.items()}
        {'weight': (3, 2), 'bias': (3,)}
    """
    if isinstance(model, Pipeline):
        params: dict[str, torch.Tensor] = dict(model.named_parameters())
        buffers = {k: v for m in model.modules.values() for k, v in m.named_buffers()}
        return PipelineApply(model), params, buffers
    if not isinstance(model, nn.Module):
        raise ScheduleTypeError("functional", [Problem("", f"expected a built model or a pipeline, got "
                                                           f"{type(model).__name__}",
                                                       "sf.func.functional(sf.build(sch))")])
    params = {k: v for k, v in model.named_parameters()}
    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    return Apply(model, dict(params), fsdp), params, dict(model.named_buffers())


# ----------------------------------------------------------------------------- gradients


def _argnums(argnums: int | Sequence[int], n: int) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    bad = [i for i in nums if not -n <= i < n]
    if bad or not nums:
        raise ScheduleTypeError("value_and_grad", [Problem("argnums", f"{argnums!r} for a call with {n} positional "
                                                                      "arguments", "argnums=0 (the params)")])
    return tuple(i % n for i in nums)


def _differentiable(t: object) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _loss_of(out: Any, has_aux: bool) -> tuple[torch.Tensor, Any]:
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ScheduleTypeError("value_and_grad", [Problem("", "has_aux=True: the function must return "
                                                                   "(loss, aux)", "return loss, aux")])
        loss, aux = out
    else:
        loss, aux = out, None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ScheduleTypeError("value_and_grad", [Problem("", f"the function must return a scalar float loss, got "
                                                               f"{what}", "reduce it: loss.mean()"
                                                               + ("" if has_aux else ", or has_aux=True"))])
    return loss, aux


def _graph_leaves(loss: torch.Tensor) -> dict[int, torch.Tensor]:
    """The leaf tensors ``loss``'s backward would accumulate a gradient into, by id."""
    leaves: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        variable = getattr(fn, "variable", None)  # an AccumulateGrad node
        if isinstance(variable, torch.Tensor):
            leaves[id(variable)] = variable
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return leaves


def _gradients(loss: torch.Tensor, targets: list[torch.Tensor]) -> list[torch.Tensor]:
    """d loss / d target for each target (zeros where unused), leaving every ``.grad`` as
    it was. Leaves made here get theirs by ``torch.autograd.grad``; the model's own
    parameters by ``backward`` into ``.grad``: restricted to them (``inputs=``) when they
    are in the graph, and otherwise (FSDP2 gathers each parameter into a new leaf and
    reduces its gradient into the sharded one in its own hooks) a full ``backward`` with
    the ``.grad`` of every other leaf in the graph put back afterwards."""
    params = [t for t in targets if isinstance(t, nn.Parameter)]
    others = [t for t in targets if not isinstance(t, nn.Parameter)]
    out: dict[int, torch.Tensor | None] = {}
    if others:
        got = torch.autograd.grad(loss, others, allow_unused=True, retain_graph=bool(params))
        # tensors passed in place of the model's parameters (torch.func.functional_call) carry
        # none of the hooks that give its own parameters' gradients their layouts
        # (region.reduce_partial_grads): their gradients are put in their layouts here
        out.update({id(t): placed(g, t.placements) if isinstance(t, DTensor) and g is not None else g
                    for t, g in zip(others, got, strict=True)})
    if params:
        in_graph = _graph_leaves(loss)
        restricted = all(id(p) in in_graph for p in params)
        touched = {id(p): p for p in params} | ({} if restricted else in_graph)
        saved = {i: t.grad for i, t in touched.items()}
        for t in touched.values():
            t.grad = None
        try:
            torch.autograd.backward(loss, inputs=params if restricted else None)
            out.update({id(p): p.grad for p in params})
        finally:
            for i, t in touched.items():
                t.grad = saved[i]
    return [g if (g := out[id(t)]) is not None else torch.zeros_like(t) for t in targets]


def value_and_grad(
    fn: Callable[..., Any], argnums: int | Sequence[int] = 0, *, has_aux: bool = False
) -> Callable[..., tuple[Any, Tree]]:
    """``fn``'s value and its gradient with respect to argument(s) ``argnums`` (pytrees of
    tensors), on ``torch.autograd``: JAX's ``value_and_grad``.

    Returns ``(loss, grads)``, or ``((loss, aux), grads)`` with ``has_aux``; ``grads`` has
    the structure of the differentiated argument (a tuple of them for several
    ``argnums``), each leaf the layout of its parameter; integer leaves get no gradient
    (``None``). ``fn`` may be the ``apply_fn`` of a pipeline: then the call is
    ``(params, *inputs, target=y, **kwargs)`` and returns the pipeline's loss and this
    rank's gradients.

    Example:
        >>> import torch, slapo_fn as sf
        >>> loss, g = sf.func.value_and_grad(lambda t: (t["x"] ** 2).sum())({"x": torch.tensor([1.0, 2.0])})
        >>> loss.item(), g["x"].tolist()
        (5.0, [2.0, 4.0])
    """
    if isinstance(fn, PipelineApply):
        if argnums != 0 or has_aux:
            raise ScheduleTypeError("value_and_grad", [Problem("argnums", "a pipeline's gradient is with respect "
                                                                          "to its params only, with no aux",
                                                               "value_and_grad(apply_fn)(params, ids, target=y)")])
        return _pipeline_value_and_grad(fn.pipeline)

    def run(*args: Any, **kwargs: Any) -> tuple[Any, Tree]:
        nums = _argnums(argnums, len(args))
        new_args = list(args)
        specs: dict[int, tuple[pytree.TreeSpec, list[Any]]] = {}
        targets: list[torch.Tensor] = []
        for i in nums:
            leaves, spec = pytree.tree_flatten(args[i])
            new_leaves = []
            for leaf in leaves:
                if _differentiable(leaf):
                    if not (isinstance(leaf, nn.Parameter) and leaf.requires_grad and leaf.is_leaf):
                        leaf = leaf.detach().requires_grad_(True)
                    targets.append(leaf)
                new_leaves.append(leaf)
            specs[i] = (spec, new_leaves)
            new_args[i] = pytree.tree_unflatten(new_leaves, spec)
        with torch.enable_grad():
            loss, aux = _loss_of(fn(*new_args, **kwargs), has_aux)
        grads = iter(_gradients(loss, targets))
        trees = []
        for i in nums:
            spec, leaves = specs[i]
            trees.append(pytree.tree_unflatten([next(grads) if _differentiable(x) else None for x in leaves], spec))
        value = (loss.detach(), aux) if has_aux else loss.detach()
        return value, (trees[0] if isinstance(argnums, int) else tuple(trees))

    return run


def grad(fn: Callable[..., Any], argnums: int | Sequence[int] = 0, *, has_aux: bool = False) -> Callable[..., Any]:
    """The gradient of ``fn`` (see :func:`value_and_grad`): ``grads``, or ``(grads, aux)``
    with ``has_aux``.

    Example:
        >>> import torch, slapo_fn as sf
        >>> sf.func.grad(lambda x: (3 * x).sum())(torch.ones(2)).tolist()
        [3.0, 3.0]
    """
    vg = value_and_grad(fn, argnums, has_aux=has_aux)

    def run(*args: Any, **kwargs: Any) -> Any:
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return run


def _pipeline_value_and_grad(pipe: Pipeline) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    own = dict(pipe.named_parameters())

    def run(params: Mapping[str, torch.Tensor], *inputs: torch.Tensor, target: torch.Tensor,
            **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        foreign = sorted(k for k, v in params.items() if own.get(k) is not v)
        if foreign:
            raise ScheduleTypeError("value_and_grad", [Problem(
                foreign[0], f"{len(foreign)} params are not this rank's stage parameters: a pipeline runs its own "
                            "modules (the schedule owns forward and backward)",
                "pass the params that sf.func.functional(pipe) returned (updated in place: donate=True)")])
        saved = {k: p.grad for k, p in own.items()}
        for p in own.values():
            p.grad = None
        try:
            loss = pipe.step(*inputs, target=target, **kwargs)
            grads = {k: g if (g := own[k].grad) is not None else torch.zeros_like(own[k]) for k in params}
        finally:
            for k, p in own.items():
                p.grad = saved[k]
        return loss, grads

    return run


# ----------------------------------------------------------------------------- layouts as values


def specs(tree: Tree) -> Tree:
    """The partition spec of each leaf, by mesh-axis name: ``P(...)`` of a DTensor's
    placements, ``P(None, ...)`` for a plain tensor (whole on every rank), ``None`` for a
    leaf that is not a tensor. Raises :class:`LayoutError` for a ``Partial`` leaf.

    Example:
        >>> import torch, slapo_fn as sf
        >>> sf.func.specs({"w": torch.zeros(2, 3), "n": 4})
        {'w': P(None, None), 'n': None}
    """
    pairs, spec = _flat(tree)
    out: list[P | None] = []
    for path, leaf in pairs:
        if isinstance(leaf, DTensor):
            out.append(spec_of(leaf.placements, _mesh_names(leaf.device_mesh, path), ndim=leaf.ndim,
                               mesh_shape=tuple(leaf.device_mesh.shape), path=path))
        elif isinstance(leaf, torch.Tensor):
            out.append(P(*([None] * leaf.ndim)))
        else:
            out.append(None)
    return pytree.tree_unflatten(out, spec)


def _specs_for(tree: Tree, spec_tree: Tree, what: str) -> tuple[list[tuple[str, Any]], pytree.TreeSpec, list[Any]]:
    pairs, structure = _flat(tree)
    given = pytree._broadcast_to_and_flatten(spec_tree, structure, is_leaf=lambda x: isinstance(x, P))
    if given is None:
        raise ScheduleTypeError(what, [Problem("specs", f"the specs' structure {pytree.tree_structure(spec_tree)} "
                                                        "does not match the tree's (nor is a prefix of it)",
                                               "pass one P for every leaf (sf.func.specs(tree) gives the shape), or "
                                               "a single P for all")])
    return pairs, structure, given


def shard(tree: Tree, spec_tree: Tree, mesh: DeviceMesh, *, from_local: bool = False,
          src_data_rank: int | None = 0) -> Tree:
    """``tree`` laid out on ``mesh`` by ``spec_tree`` (one ``P`` per leaf, a prefix of
    the tree, or one ``P`` for all): each tensor leaf becomes a DTensor.

    A leaf is the full tensor (split here; with ``src_data_rank=None`` every rank keeps
    its own slice of its own copy, no communication), or with ``from_local=True`` this
    rank's shard; a DTensor leaf is redistributed. Every leaf is checked first: a spec
    that names no axis of the mesh, or does not divide a dimension evenly, is a
    :class:`LayoutError` naming the leaf's path, and nothing is moved.
    ``specs(shard(tree, s, mesh)) == s``. Like ``jax.device_put``, it places values: the
    full tensors are not differentiated through (:func:`constrain` is the differentiable
    form).
    """
    pairs, structure, given = _specs_for(tree, spec_tree, "shard")
    names = _mesh_names(mesh, "")
    problems: list[Problem] = []
    plans: list[tuple[Placement, ...] | None] = []
    for (path, leaf), s in zip(pairs, given, strict=True):
        if not isinstance(leaf, torch.Tensor) or s is None:
            plans.append(None)
            continue
        shape = list(leaf.shape)
        try:
            if from_local and not isinstance(leaf, DTensor):
                placements_of(s, names, tuple(mesh.shape), path=path)  # the spec itself, before its sizes
                for d in range(min(len(s), len(shape))):
                    shape[d] *= math.prod(mesh.size(names.index(a)) for a in P(*s).axes(d))
            plans.append(placements_of(s, names, tuple(mesh.shape), shape=shape, path=path))
        except LayoutError as e:
            problems.extend(e.problems)
            plans.append(None)
    if problems:
        raise LayoutError("shard", problems)
    out = []
    for (_, leaf), target in zip(pairs, plans, strict=True):
        if target is None:
            out.append(leaf)
        elif isinstance(leaf, DTensor):
            out.append(leaf.redistribute(mesh, target))
        elif from_local:
            out.append(DTensor.from_local(leaf, mesh, target, run_check=False))
        else:
            out.append(distribute_tensor(leaf.detach(), mesh, target, src_data_rank=src_data_rank))
    return pytree.tree_unflatten(out, structure)


def constrain(x: torch.Tensor, spec: P | Sequence[Any], mesh: DeviceMesh | None = None) -> DTensor:
    """``x`` in the layout ``spec`` (JAX's ``with_sharding_constraint``): a DTensor
    redistribute, differentiable (its backward moves the gradient back). A plain tensor is
    taken as whole on every rank of ``mesh``.

    Example (on a 2-rank mesh): ``constrain(h, P(None, None, "tp"))`` splits the hidden
    dimension of a replicated activation; ``constrain(h, P())`` gathers it again.
    """
    if isinstance(x, DTensor):
        if mesh is not None and mesh != x.device_mesh:
            raise LayoutError("constrain", [Problem("x", f"is on mesh {x.device_mesh}, not {mesh}",
                                                    "move it between meshes explicitly, or leave mesh=None")])
        mesh = x.device_mesh
    elif mesh is None:
        raise ScheduleTypeError("constrain", [Problem("x", "is a plain tensor and no mesh was given",
                                                      "constrain(x, spec, mesh)")])
    names = _mesh_names(mesh, "x")
    placements = placements_of(P(*spec) if not isinstance(spec, P) else spec, names, tuple(mesh.shape),
                               shape=tuple(x.shape), path="x")
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return x.redistribute(mesh, placements)


def psum(x: torch.Tensor, mesh_axis: str, mesh: DeviceMesh) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``mesh_axis`` (inside :func:`local`): an all-reduce
    whose backward passes the gradient through, which is right when the sum is used the
    same way on every rank (JAX's ``psum`` on a replicated result)."""
    names = _mesh_names(mesh, "psum")
    if mesh_axis not in names:
        raise LayoutError("psum", [Problem(mesh_axis, f"is not an axis of the mesh {names}", f"one of {names}")])
    return _reduce(x, (mesh, names.index(mesh_axis)))


def local(fn: Callable[..., Any], in_specs: Sequence[P | None], out_specs: P | Sequence[P | None] | None,
          mesh: DeviceMesh) -> Callable[..., Any]:
    """``fn`` run on each rank's local shards (JAX's ``shard_map``; torch's ``local_map``).

    ``in_specs`` has one spec per positional argument (``None`` for a non-tensor);
    DTensor arguments are redistributed to them first, and ``fn`` sees local tensors.
    ``out_specs`` (one ``P``, or one per output) says how ``fn``'s local outputs form
    DTensors. Inside, use :func:`psum` to reduce over a mesh axis.
    """
    names = _mesh_names(mesh, "local")

    def lower(s: P | None, where: str) -> tuple[Placement, ...] | None:
        return None if s is None else placements_of(s, names, tuple(mesh.shape), path=where)

    ins = tuple(lower(s, f"in_specs[{i}]") for i, s in enumerate(in_specs))
    outs: Any
    if isinstance(out_specs, P) or out_specs is None:
        single = lower(out_specs, "out_specs")
        outs = None if single is None else list(single)  # a list: local_map reads a tuple as one per output
    else:
        outs = tuple(lower(s, f"out_specs[{i}]") for i, s in enumerate(out_specs))
    return local_map(fn, out_placements=outs, in_placements=ins, device_mesh=mesh, redistribute_inputs=True)


# ----------------------------------------------------------------------------- global norms


def _sharded_dims(t: DTensor) -> tuple[int, ...]:
    return tuple(i for i, p in enumerate(t.placements) if isinstance(p, Shard | _StridedShard))


def _pipeline_duplicates(pipe: Pipeline) -> set[str]:
    """FQNs of tied parameters counted by another stage (each tie once in the norm)."""
    dup: set[str] = set()
    for tie in pipe.tied:
        first = min(tie.members)
        dup.update(fqn for s, fqn in tie.members if (s, fqn) != first and s in pipe.modules and fqn != first[1])
        if first[0] not in pipe.modules:  # the counting stage is elsewhere: skip this rank's copies
            dup.update(fqn for s, fqn in tie.members if s in pipe.modules)
    return dup


def global_norm(grads: Tree, *, norm_type: float = 2.0, pipeline: Pipeline | None = None) -> torch.Tensor:
    """The ``norm_type`` norm of all tensor leaves of ``grads`` together, as one plain
    scalar tensor equal on every rank: what the unsharded model's gradients would give.

    Each leaf's local shard contributes once; contributions are summed over the mesh axes
    that shard the leaf (one all-reduce per mesh and sharding, not per leaf), never over
    the axes that replicate it; plain tensors count once. With ``pipeline`` the stages'
    norms are combined over the pipeline group, each tied parameter counted once
    (``grads`` then maps FQNs, as :func:`functional` gives). ``norm_type=inf`` is the
    largest absolute value. A ``nan`` or ``inf`` gradient gives a ``nan``/``inf`` norm.

    Example:
        >>> import torch, slapo_fn as sf
        >>> sf.func.global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}).item()
        5.0
    """
    p = float(norm_type)
    if not (p == math.inf or p > 0):
        raise ScheduleError("global_norm", [Problem("norm_type", f"{norm_type} is not a norm", "2.0, 1.0 or inf")])
    skip = _pipeline_duplicates(pipeline) if pipeline is not None else set()
    if skip and not isinstance(grads, Mapping):
        raise ScheduleTypeError("global_norm", [Problem("grads", "the pipeline has tied parameters; grads must map "
                                                                 "FQNs to tensors to count each tie once",
                                                        "pass the grads of value_and_grad(apply_fn)")])
    counted = {k: v for k, v in grads.items() if k not in skip} if skip else grads
    leaves = pytree.tree_leaves(counted)
    groups: dict[tuple[int, tuple[int, ...]], tuple[DeviceMesh | None, list[torch.Tensor]]] = {}
    with torch.no_grad():
        for g in leaves:
            if not isinstance(g, torch.Tensor):
                continue
            if isinstance(g, DTensor):
                if any(isinstance(x, Partial) for x in g.placements):
                    g = g.redistribute(g.device_mesh, [Replicate() if isinstance(x, Partial) else x
                                                       for x in g.placements])
                key = (id(g.device_mesh), _sharded_dims(g))
                groups.setdefault(key, (g.device_mesh, []))[1].append(g.to_local())
            else:
                groups.setdefault((0, ()), (None, []))[1].append(g)
        parts: list[torch.Tensor] = []
        device = next((ts[0].device for _, ts in groups.values() if ts), torch.device("cpu"))
        for (_, dims), (mesh, tensors) in groups.items():
            norms = torch.stack([n.to(device, torch.float32) for n in torch._foreach_norm(tensors, p)])
            part = norms.max() if p == math.inf else norms.pow(p).sum()
            for d in dims:
                assert mesh is not None
                part = funcol.wait_tensor(funcol.all_reduce(part, "max" if p == math.inf else "sum", (mesh, d)))
            parts.append(part)
        if not parts:
            total = torch.zeros((), device=device)
        else:
            total = torch.stack(parts).max() if p == math.inf else torch.stack(parts).sum()
        if pipeline is not None:
            total = total.clone()
            dist.all_reduce(total, op=dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM, group=pipeline.group)
        return total if p == math.inf else total.pow(1.0 / p)


def _coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def _check_finite(norm: torch.Tensor, grads: Tree, what: str) -> None:
    if bool(torch.isfinite(norm)):
        return
    pairs, _ = _flat(grads)
    bad = []
    for path, g in pairs:
        if isinstance(g, torch.Tensor):
            local = g.to_local() if isinstance(g, DTensor) else g
            if not bool(torch.isfinite(local).all()):
                bad.append(path)
    problems = [Problem(path, "has non-finite values on this rank", "lower the learning rate, or skip the step")
                for path in bad] or [Problem("", f"the global norm is {norm.item()} (non-finite values on another "
                                                 "rank or stage)", "lower the learning rate, or skip the step")]
    raise NonFiniteNormError(what, problems)


def clip_by_global_norm(grads: Tree, max_norm: float, *, norm_type: float = 2.0, pipeline: Pipeline | None = None,
                        error_if_nonfinite: bool = False) -> tuple[Tree, torch.Tensor]:
    """``(grads scaled so that their global norm is at most max_norm, the norm before)``,
    as ``torch.nn.utils.clip_grad_norm_`` scales (``max_norm / (norm + 1e-6)``, at most 1).
    New tensors; ``grads`` is unchanged. A non-finite norm is returned as it is (and the
    scaled gradients are then non-finite too); ``error_if_nonfinite=True`` raises a
    :class:`NonFiniteNormError` naming the leaves instead. See :func:`global_norm`.

    Example:
        >>> import torch, slapo_fn as sf
        >>> g, norm = sf.func.clip_by_global_norm({"a": torch.tensor([3.0, 4.0])}, 1.0)
        >>> norm.item(), [round(x, 4) for x in g["a"].tolist()]
        (5.0, [0.6, 0.8])
    """
    norm = global_norm(grads, norm_type=norm_type, pipeline=pipeline)
    if error_if_nonfinite:
        _check_finite(norm, grads, "clip_by_global_norm")
    coef = _coefficient(norm, max_norm)

    def scale(g: Any) -> Any:  # a 0-d plain tensor is a scalar to DTensor: no from_local, no sync
        return g * coef.to(g.device) if isinstance(g, torch.Tensor) else g

    return pytree.tree_map(scale, grads), norm


def clip_grad_norm_(model: nn.Module | Pipeline, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """The module form: scale the ``.grad`` of ``model``'s parameters in place so that
    their global norm is at most ``max_norm``; returns the norm before. Right where
    ``torch.nn.utils.clip_grad_norm_`` is not: gradients on several meshes (TP and FSDP)
    and pipelines (pass the :class:`~slapo_fn.Pipeline`: the norm of all stages).

    Example:
        >>> import torch, torch.nn as nn, slapo_fn as sf
        >>> m = nn.Linear(2, 1, bias=False)
        >>> m.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> sf.clip_grad_norm_(m, 1.0).item(), m.weight.grad.norm().item() < 1.0
        (5.0, True)
    """
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    norm = global_norm(grads, norm_type=norm_type, pipeline=model if isinstance(model, Pipeline) else None)
    if error_if_nonfinite:
        _check_finite(norm, grads, "clip_grad_norm_")
    coef = _coefficient(norm, max_norm)
    with torch.no_grad():
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads.values():
            local = g.to_local() if isinstance(g, DTensor) else g
            by_device.setdefault(local.device, []).append(local)
        for device, tensors in by_device.items():
            torch._foreach_mul_(tensors, coef.to(device))
    return norm


# ----------------------------------------------------------------------------- transforms torch cannot do


def _refuse_dtensors(what: str, args: Sequence[Any], kwargs: Mapping[str, Any], name: str = "args") -> None:
    trees = [(f"{name}[{i}]", a) for i, a in enumerate(args)] + [(f"{k}=", v) for k, v in kwargs.items()]
    paths = [where + ("" if path == "<root>" else path) for where, tree in trees for path, leaf in _flat(tree)[0]
             if isinstance(leaf, DTensor)]
    if paths:
        raise TransformError(what, [Problem(path, f"is a DTensor: torch {torch.__version__.split('+')[0]} cannot "
                                                  f"{what} over DTensor code (its sharding propagation has no rule "
                                                  "for the batching / forward-mode operators)",
                                            "run the transform on local tensors inside sf.func.local(...), or use "
                                            "value_and_grad / grad (reverse mode works)") for path in paths])


def vmap(fn: Callable[..., Any], in_dims: Any = 0, out_dims: Any = 0, **kwargs: Any) -> Callable[..., Any]:
    """``torch.func.vmap``, refusing DTensor arguments with a :class:`TransformError`
    (PyTorch crashes inside DTensor on them)."""
    mapped = torch.func.vmap(fn, in_dims, out_dims, **kwargs)

    def run(*args: Any, **kw: Any) -> Any:
        _refuse_dtensors("vmap", args, kw)
        return mapped(*args, **kw)

    return run


def jvp(fn: Callable[..., Any], primals: Sequence[Any], tangents: Sequence[Any], **kwargs: Any) -> Any:
    """``torch.func.jvp``, refusing DTensor primals or tangents with a :class:`TransformError`."""
    _refuse_dtensors("jvp", primals, {}, "primals")
    _refuse_dtensors("jvp", tangents, {}, "tangents")
    return torch.func.jvp(fn, tuple(primals), tuple(tangents), **kwargs)
