"""Differentiable collectives on local tensors over one mesh axis (Megatron's f/g operators).

Each is an ``autograd.Function`` whose forward and backward issue one functional
collective (``torch.distributed._functional_collectives``, which ``CommDebugMode``
counts) or none:

=====================  =====================  =====================
function               forward                backward
=====================  =====================  =====================
``enter``              identity               all-reduce
``reduce``             all-reduce             identity
``gather(d)``          all-gather along d     split (no comm)
``split(d)``           split (no comm)        all-gather along d
``gather_rs(d)``       all-gather along d     reduce-scatter along d
``reduce_scatter(d)``  reduce-scatter along d all-gather along d
=====================  =====================  =====================

:func:`redistribute` maps a (src, dst) pair of placements to these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..errors import LayoutError, Problem

__all__ = ["Axis", "enter", "enter_all", "even", "gather", "gather_rs", "redistribute", "reduce", "reduce_scatter",
           "settled", "split", "unpack", "wait"]

Axis = tuple[DeviceMesh, int]


def wait(t: torch.Tensor) -> torch.Tensor:
    """A collective's result now, waited for: where nothing runs after it to overlap with
    (a gradient made at the end of backward), and where it may never be read, a pending
    one would stay in the process group's registry of unwaited work, with its buffer."""
    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _later(t: torch.Tensor) -> torch.Tensor:
    """A collective's result, waited for where it is first used (funcol's
    ``AsyncCollectiveTensor``: eager computation between the issue and the use overlaps
    the transfer; a compiled graph has the ``wait_tensor`` where its scheduler puts it);
    at once inside ``torch.func`` transforms, whose wrappers would hide the pending value."""
    if isinstance(t, funcol.AsyncCollectiveTensor) and torch._C._are_functorch_transforms_active():
        return wait(t)
    return t


# The functional collectives run under no_grad: the Functions below define every gradient
# themselves, and the ops' own autograd wrappers (autograd.Functions without setup_context)
# would otherwise refuse to run inside a torch.func transform's backward.


@torch.no_grad()
def _all_reduce(t: torch.Tensor, axis: Axis, op: str = "sum") -> torch.Tensor:
    return _later(funcol.all_reduce(t.contiguous(), op, axis))


# torch >= 2.10 names them *_single (the *_tensor names are deprecated aliases)
_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_scatter_single = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


# Along any dimension, as PyTorch's own tensor parallelism moves activations: funcol gathers
# into dimension 0 of one buffer and puts the ranks' chunks in place with one cat (a view where
# the dimensions before ``dim`` have one element), and scatters from the chunks laid out by one
# cat, the forms inductor's async-TP matcher (micro_pipeline_tp) fuses with the matmul beside
# them; their results are contiguous (a pipeline stage sizes its receive buffers by them).


@torch.no_grad()
def _all_gather(t: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    return _later(_gather_single(t.contiguous(), dim % t.dim(), axis))


@torch.no_grad()
def _reduce_scatter(t: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    return _later(_scatter_single(t.contiguous(), "sum", dim % t.dim(), axis))


def _split(t: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    mesh, mdim = axis
    size = mesh.size(mdim)
    rank = mesh.get_local_rank(mdim)
    return t.chunk(size, dim=dim % t.dim())[rank].contiguous()


# Every Function has a ``setup_context`` (forward does not take ``ctx``), as ``torch.func``
# transforms require; the saved state is plain Python values, never tensors.


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, axis: Axis) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.axis = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.axis), None


class _EnterAll(torch.autograd.Function):
    """``_Enter`` over several tensors whose gradients are reduced in one all-reduce per
    dtype (a module's replicated parameters used on activation shards): one node, so
    autograd hands it every gradient at once; an unused one arrives as zeros."""

    @staticmethod
    def forward(axis: Axis, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.axis = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        out: list[torch.Tensor] = list(grads)
        for dtype in dict.fromkeys(g.dtype for g in grads):
            idx = [i for i, g in enumerate(grads) if g.dtype == dtype]
            flat = _all_reduce(torch.cat([grads[i].reshape(-1) for i in idx]), ctx.axis)
            for i, piece in zip(idx, flat.split([grads[i].numel() for i in idx]), strict=True):
                out[i] = piece.view_as(grads[i])
        return (None, *out)


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, axis: Axis) -> torch.Tensor:
        return _all_reduce(x, axis)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, dim: int, axis: Axis, scatter_back: bool) -> torch.Tensor:
        return _all_gather(x, dim, axis)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.dim, ctx.axis, ctx.scatter_back = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.scatter_back:
            return _reduce_scatter(grad, ctx.dim, ctx.axis), None, None, None
        return _split(grad, ctx.dim, ctx.axis), None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
        return _split(x, dim, axis)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.dim, ctx.axis = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.axis), None, None


class _SplitPadded(_Split):
    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, ctx.dim, ctx.axis = inputs
        ctx.whole = x.shape[ctx.dim]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        mesh, mdim = ctx.axis
        n, d = grad.shape[ctx.dim], ctx.dim % grad.dim()
        before = mesh.get_local_rank(mdim) * n
        pad = [0, 0] * (grad.dim() - 1 - d) + [before, ctx.whole - before - n]
        return torch.nn.functional.pad(grad, pad), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
        return _reduce_scatter(x, dim, axis)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.dim, ctx.axis = inputs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.axis), None, None


class _Settle(torch.autograd.Function):
    """A pending collective result waited for, its gradient passed back as it comes."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return funcol.wait_tensor(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def settled(value: Any) -> Any:
    """``value`` (a tensor, or a tuple, list, dict or ``ModelOutput`` of them) with every
    pending collective result in it waited for, its gradient kept: what an installed
    forward hands on. Code past a module boundary is not slapo_fn's, and a block compiled
    on its own loses the gradient of a pending input (torch 2.13's AOT runtime wrapper
    unwraps an ``AsyncCollectiveTensor`` outside autograd: the gradient reaching it is
    zero, silently). The caller uses a module's result at once, so nothing is lost to
    overlap; within a forward, results are still waited where first used.

    >>> settled((torch.ones(2), None))[0]
    tensor([1., 1.])
    """
    pending = funcol.AsyncCollectiveTensor
    if isinstance(value, pending):
        return _Settle.apply(value)
    if type(value) in (tuple, list) and any(isinstance(v, pending) for v in value):
        return type(value)(settled(v) for v in value)
    if (type(value) is dict or (isinstance(value, Mapping) and hasattr(value, "to_tuple"))) and any(
            isinstance(v, pending) for v in value.values()):
        return type(value)(**{k: settled(v) for k, v in value.items()})  # a ModelOutput keeps its type
    return value


def enter(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (enter a TP region)."""
    return _Enter.apply(x, axis)  # type: ignore[no-any-return]


def enter_all(xs: Sequence[torch.Tensor], axis: Axis) -> tuple[torch.Tensor, ...]:
    """:func:`enter` over several tensors at once: their gradients are all-reduced in one
    collective per dtype, flattened together (as Megatron-LM buckets its sequence-parallel
    norms' gradients), instead of one each.

    Example (a module's weight and bias, one all-reduce backward)::

        w, b = enter_all([weight, bias], (mesh, 0))
    """
    return _EnterAll.apply(axis, *xs)  # type: ignore[no-any-return]


def reduce(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """All-reduce forward (a partial sum becomes replicated); identity backward."""
    return _Reduce.apply(x, axis)  # type: ignore[no-any-return]


def gather(x: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    """All-gather along ``dim`` forward; this rank's slice of the (replicated) gradient backward."""
    return _Gather.apply(x, dim, axis, False)  # type: ignore[no-any-return]


def gather_rs(x: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    """All-gather along ``dim`` forward; reduce-scatter of the (partial) gradient backward
    (entering a TP region from sequence shards)."""
    return _Gather.apply(x, dim, axis, True)  # type: ignore[no-any-return]


def even(x: torch.Tensor, dim: int, axis: Axis, what: str) -> None:
    """Refuse, on every rank alike (shapes are the same everywhere), a dimension that does
    not divide over the mesh axis: uneven shards would make the ranks' next collectives
    disagree in size, which aborts the process group instead of raising."""
    mesh, mdim = axis
    size, n = mesh.size(mdim), x.shape[dim % x.dim()]
    if n % size:
        name = (mesh.mesh_dim_names or ())[mdim] if mesh.mesh_dim_names else str(mdim)
        raise LayoutError(what, [Problem(
            "", f"dimension {dim} of an activation of shape {tuple(x.shape)} has {n} elements, which do not split "
            f"evenly over the {size} ranks of mesh axis {name!r}",
            f"pad that dimension (the sequence) to a multiple of {size}, or leave the module out of "
            "sequence parallelism",
        )])


def split(x: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    """This rank's chunk along ``dim`` forward (no communication); all-gather backward."""
    even(x, dim, axis, "split")
    return _Split.apply(x, dim, axis)  # type: ignore[no-any-return]


def split_padded(x: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    """This rank's chunk along ``dim`` forward; backward, the gradient put back in its place
    among zeros (no communication). Right only where what reads the whole gradient keeps this
    rank's chunk alone: ``x`` made by a :func:`gather` of this rank's chunk through
    elementwise code (a row splitting a column's output that a sync gathered), whose
    backward slices it back, as :func:`split` then :func:`gather` would leave it."""
    even(x, dim, axis, "split")
    return _SplitPadded.apply(x, dim, axis)  # type: ignore[no-any-return]


def reduce_scatter(x: torch.Tensor, dim: int, axis: Axis) -> torch.Tensor:
    """Reduce-scatter along ``dim`` forward (a partial sum becomes sharded); all-gather backward."""
    even(x, dim, axis, "reduce_scatter")
    return _ReduceScatter.apply(x, dim, axis)  # type: ignore[no-any-return]


def unpack(gathered: torch.Tensor, packed: int, size: int) -> torch.Tensor:
    """``[A_0 B_0 C_0 | A_1 B_1 C_1]`` (each rank's packed chunks, all-gathered along the last
    dimension) → ``[A_0 A_1 | B_0 B_1 | C_0 C_1]`` (the unsharded module's order). A view,
    not ``Tensor.unflatten``: that Python method calls ``super()``, which dynamo cannot
    trace under the torch-function mode of a DTensor region (:mod:`.region`).

    >>> unpack(torch.tensor([0, 10, 20, 1, 11, 21]), packed=3, size=2).tolist()
    [0, 1, 10, 11, 20, 21]
    """
    return gathered.view(*gathered.shape[:-1], size, packed, -1).transpose(-3, -2).flatten(-3)


def redistribute(x: torch.Tensor, src: Placement, dst: Placement, axis: Axis) -> torch.Tensor:
    """Convert a local tensor of layout ``src`` to ``dst`` over one mesh axis.

    Raises ``ValueError`` for a conversion to ``Partial`` (not a layout anyone needs).
    """
    if isinstance(src, Shard):
        src = Shard(src.dim % x.dim())
    if isinstance(dst, Shard):
        dst = Shard(dst.dim % x.dim())
    if src == dst or (isinstance(src, Replicate) and isinstance(dst, Replicate)):
        return x
    if isinstance(dst, Partial):
        raise ValueError("redistributing to Partial is not supported")
    if isinstance(src, Partial):
        return reduce(x, axis) if isinstance(dst, Replicate) else reduce_scatter(x, dst.dim, axis)  # type: ignore[attr-defined]
    if isinstance(src, Replicate):
        assert isinstance(dst, Shard)
        return split(x, dst.dim, axis)
    assert isinstance(src, Shard)
    full = gather(x, src.dim, axis)
    return full if isinstance(dst, Replicate) else split(full, dst.dim, axis)  # type: ignore[attr-defined]
