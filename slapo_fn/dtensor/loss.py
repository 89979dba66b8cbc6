"""``vocab_parallel_cross_entropy``: cross entropy on vocab-sharded logits, never gathered.

Three all-reduces forward (max, sum of exponentials, target logit) over ``(batch × seq)``
floats, none backward — the logits stay ``Shard(-1)`` local tensors (Megatron's
vocab-parallel loss; ``torch.distributed.tensor.parallel.loss_parallel`` in spirit).

Keep a vocab-parallel head's logits sharded with
``sf.sync(sch, "lm_head", "fwd_post", Shard(-1))``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from .collectives import Axis, _all_reduce
from .shard import mesh_dims

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    """Forward returns the loss and what backward needs, as extra non-differentiable
    outputs that ``setup_context`` saves (the form ``torch.func`` needs)."""

    @staticmethod
    def forward(  # type: ignore[override]
        logits: torch.Tensor, labels: torch.Tensor, axis: Axis, ignore_index: int
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
        count = valid.sum().clamp(min=1)
        loss = ((total.log() - picked) * valid).sum() / count
        return loss.to(logits.dtype), exp, total, inside, local, valid, count

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        logits = inputs[0]
        saved = output[1:]
        ctx.mark_non_differentiable(*saved)
        ctx.save_for_backward(*saved)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        exp, total, inside, local, valid, count = ctx.saved_tensors
        g = exp / total.unsqueeze(-1)
        g[torch.arange(g.shape[0]), local] -= inside.to(g.dtype)
        g = g * (valid.to(g.dtype) * grad / count).unsqueeze(-1)
        return g.to(ctx.dtype).view(ctx.shape), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mesh: DeviceMesh,
    *,
    mesh_axis: str = "tp",
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross entropy of ``logits`` (this rank's vocab shard, ``(..., V / n)``) against
    ``labels`` (full vocab ids, ``(...)``), equal to ``F.cross_entropy`` on the gathered
    logits; the gradient is this rank's shard. Rows whose label is ``ignore_index`` are
    left out of the mean.

    Pair it with a vocab-parallel head kept sharded (run on every rank of the mesh)::

        sch = sf.shard(sch, "lm_head", axis=0)                  # vocab rows over "tp"
        sch = sf.sync(sch, "lm_head", "fwd_post", Shard(-1))   # logits stay sharded
        loss = sf.vocab_parallel_cross_entropy(built(ids), labels, mesh)
    """
    axis = (mesh, mesh_dims(mesh).index(mesh_axis))
    return _VocabParallelCE.apply(logits, labels, axis, ignore_index)[0]  # type: ignore[no-any-return]
