"""``vocab_parallel_cross_entropy``: cross entropy on vocab-sharded logits, never gathered.

Three all-reduces forward (max, sum of exponentials, target logit) over ``(batch × seq)``
floats, none backward — the logits stay ``Shard(-1)`` local tensors (Megatron's
vocab-parallel loss; ``torch.distributed.tensor.parallel.loss_parallel`` in spirit). It
takes what ``F.cross_entropy`` takes of a classification over the vocabulary: a class
``weight`` and a ``reduction`` (``"mean"``, ``"sum"`` or ``"none"``).

Keep a vocab-parallel head's logits sharded with
``sf.sync(sch, "lm_head", "fwd_post", Shard(-1))``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..errors import LayoutError, Problem
from .collectives import Axis, _all_reduce
from .shard import mesh_dims

__all__ = ["vocab_parallel_cross_entropy"]

Reduction = Literal["mean", "sum", "none"]
_REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCE(torch.autograd.Function):
    """Forward returns the loss and what backward needs, as extra non-differentiable
    outputs that ``setup_context`` saves (the form ``torch.func`` needs)."""

    @staticmethod
    def forward(  # type: ignore[override]
        logits: torch.Tensor, labels: torch.Tensor, axis: Axis, ignore_index: int, weight: torch.Tensor | None,
        reduction: str,
    ) -> tuple[torch.Tensor, ...]:
        mesh, dim = axis
        vocab = logits.shape[-1]
        lo = mesh.get_local_rank(dim) * vocab
        x = logits.reshape(-1, vocab).float()
        y = labels.reshape(-1)
        top = _all_reduce(x.max(dim=-1).values, axis, "max")
        shifted = x - top.unsqueeze(-1)
        exp = shifted.exp()
        total = _all_reduce(exp.sum(dim=-1), axis, "sum")
        inside = (y >= lo) & (y < lo + vocab)
        local = (y - lo).clamp(0, vocab - 1)
        picked = shifted.gather(1, local.unsqueeze(1)).squeeze(1) * inside
        picked = _all_reduce(picked, axis, "sum")
        valid = y != ignore_index
        # each row's share: its class's weight (1 without one), 0 for an ignored row
        scale = valid.float() if weight is None else weight.float()[y.clamp(0, weight.numel() - 1)] * valid
        rows = (total.log() - picked) * scale
        if reduction == "none":
            loss = rows.view(labels.shape)
        else:  # the mean over the rows' weights (their count without a weight); 0 where none counts
            den = scale.sum() if reduction == "mean" else torch.ones((), dtype=scale.dtype, device=scale.device)
            den = torch.where(den > 0, den, torch.ones_like(den))
            scale = scale / den
            loss = rows.sum() / den
        return loss.to(logits.dtype), exp, total, inside, local, scale

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        logits = inputs[0]
        saved = output[1:]
        ctx.mark_non_differentiable(*saved)
        ctx.save_for_backward(*saved)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        exp, total, inside, local, scale = ctx.saved_tensors
        g = exp / total.unsqueeze(-1)
        g[torch.arange(g.shape[0]), local] -= inside.to(g.dtype)
        g = g * (scale * grad.reshape(-1).to(scale.dtype)).unsqueeze(-1)  # grad: one per row, or the loss's one
        return g.to(ctx.dtype).view(ctx.shape), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mesh: DeviceMesh,
    *,
    mesh_axis: str = "tp",
    ignore_index: int = -100,
    weight: torch.Tensor | None = None,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Cross entropy of ``logits`` (this rank's vocab shard, ``(..., V / n)``) against
    ``labels`` (full vocab ids, ``(...)``, one per row of ``logits``), equal to
    ``F.cross_entropy`` on the gathered logits with the classes last; the gradient is this
    rank's shard. Rows whose label is ``ignore_index`` count for nothing. ``weight``: one
    per class of the whole vocabulary (``(V,)``, the same on every rank); ``reduction``:
    ``"mean"`` (over the rows' weights), ``"sum"``, or ``"none"`` (the loss of each row,
    shaped like ``labels``).

    Labels that are not one per row (the whole batch's for this rank's rows) are refused
    with a :class:`~slapo_fn.errors.LayoutError`.

    Pair it with a vocab-parallel head kept sharded (run on every rank of the mesh)::

        sch = sf.shard(sch, "lm_head", axis=0)                  # vocab rows over "tp"
        sch = sf.sync(sch, "lm_head", "fwd_post", Shard(-1))   # logits stay sharded
        loss = sf.vocab_parallel_cross_entropy(built(ids), labels, mesh)
    """
    problems = []
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        problems.append(Problem("labels", f"shape {tuple(labels.shape)} does not match the logits' rows "
                                          f"{tuple(logits.shape[:-1])} (logits {tuple(logits.shape)}, classes last)",
                                "pass this rank's labels, one per row of its logits (where the rows are split over "
                                "another mesh axis, its share of them)"))
    if reduction not in _REDUCTIONS:
        problems.append(Problem("reduction", f"{reduction!r} is not one of {', '.join(_REDUCTIONS)}",
                                "reduction='mean'"))
    size = mesh.size(mesh_dims(mesh).index(mesh_axis))
    if weight is not None and tuple(weight.shape) != (logits.shape[-1] * size,):
        problems.append(Problem("weight", f"shape {tuple(weight.shape)}: one weight per class of the whole "
                                          f"vocabulary is {logits.shape[-1] * size}",
                                "a 1-D weight of the vocabulary's size, the same on every rank"))
    if problems:
        raise LayoutError("vocab_parallel_cross_entropy", problems)
    axis = (mesh, mesh_dims(mesh).index(mesh_axis))
    return _VocabParallelCE.apply(logits, labels, axis, ignore_index, weight, reduction)[0]  # type: ignore[no-any-return]
