"""``context_parallel(impl="ring")``: PyTorch's own ring attention on CUDA.

PyTorch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``)
dispatches SDPA's CUDA kernels (flash, memory-efficient) to ring functions that rotate
K/V over the ``cp`` process group and merge the partial outputs by their log-sum-exp,
with the head-tail load balancing that :func:`~slapo_fn.dtensor.context.chunks` also
uses (rank ``r`` holds chunks ``r`` and ``2·cp−1−r``). Its context manager reaches them
through a global DTensor dispatcher; here they are called directly on this rank's
local query, key and value, forward and backward, in one :class:`torch.autograd.Function`
(no global state changed). PyTorch's CPU SDPA kernel has no ring strategy: the schedule
refuses ``impl="ring"`` off CUDA (:func:`ring_problems`).

GQA: the key and value heads are repeated to the query's (the ring kernels take equal
heads); their gradients are summed back by autograd.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..errors import Problem
from ..kernels import RotaryAttention
from . import collectives as C

ring: Any
try:  # where PyTorch keeps its ring functions: a package since 2.10, one module before
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring
except ImportError:  # pragma: no cover - older PyTorch
    try:
        from torch.distributed.tensor.experimental import _attention as ring
    except ImportError:
        ring = None

__all__ = ["ring_attention", "ring_problems"]


def ring_problems(path: str, kernel: RotaryAttention, device_type: str, load_balance: bool) -> list[Problem]:
    """Why PyTorch's ring attention cannot run the attention ``kernel`` at ``path`` on a
    mesh of ``device_type`` (empty: it can)."""
    fix = 'impl="allgather" (an all-gather of K/V: any device, any mask)'
    problems = []
    if ring is None or not hasattr(ring, "_scaled_dot_product_ring_flash_attention"):  # pragma: no cover
        problems.append(Problem(path, f"this PyTorch ({torch.__version__}) has no ring attention functions in "
                                      "torch.distributed.tensor.experimental", fix))
    if device_type != "cuda":
        problems.append(Problem(path, f"impl='ring' runs PyTorch's ring attention, whose SDPA kernels are CUDA's: "
                                      f"PyTorch's {device_type} SDPA has no ring strategy (the mesh is on "
                                      f"{device_type!r})", fix))
    if not load_balance:
        problems.append(Problem(path, "PyTorch's ring attention holds the head-tail load-balanced chunks; "
                                      "load_balance=False is not its layout", f"load_balance=True, or {fix}"))
    if kernel.sliding_window is not None:
        problems.append(Problem(path, f"has a sliding window of {kernel.sliding_window} tokens: PyTorch's ring "
                                      "attention is plain causal attention", fix))
    if kernel.dropout_p:
        problems.append(Problem(path, f"has attention dropout {kernel.dropout_p}: each ring step would draw its "
                                      "own mask, which the backward cannot replay", f"attention_dropout=0.0, or {fix}"))
    return problems


def _cp_mesh(axis: C.Axis) -> DeviceMesh:
    mesh, dim = axis
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    assert names is not None
    return mesh[names[dim]]


class _Ring(torch.autograd.Function):
    """Forward and backward of PyTorch's ring attention (flash for fp16/bf16, the
    memory-efficient kernel for fp32) on this rank's load-balanced chunks, causal."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mesh: DeviceMesh,
                scale: float) -> torch.Tensor:
        flash = query.dtype in (torch.float16, torch.bfloat16)
        key, value = key.contiguous(), value.contiguous()
        if flash:
            out, lse, *rest = ring._scaled_dot_product_ring_flash_attention(mesh, query, key, value, is_causal=True,
                                                                             scale=scale)
            extra = tuple(rest[:6])  # cum_seq_q, cum_seq_k, max_q, max_k, philox seed and offset
        else:
            out, lse, *rest = ring._scaled_dot_product_ring_efficient_attention(mesh, query, key, value,
                                                                                is_causal=True, scale=scale)
            extra = tuple(rest[:2])  # philox seed and offset
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.mesh, ctx.scale, ctx.flash, ctx.extra = mesh, scale, flash, extra
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        if ctx.flash:
            cum_q, cum_k, max_q, max_k, seed, offset = ctx.extra
            grads = ring._scaled_dot_product_ring_flash_attention_backward(
                ctx.mesh, grad, query, key, value, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset,
                scale=ctx.scale)
        else:
            seed, offset = ctx.extra
            grads = ring._scaled_dot_product_ring_efficient_attention_backward(  # no bias: an undefined tensor
                ctx.mesh, grad, query, key, value, None, out, lse, seed, offset, 0.0,  # type: ignore[arg-type]
                (True, True, True, False), True, scale=ctx.scale)
        return grads[0], grads[1], grads[2], None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, axis: C.Axis,
                   scale: float) -> torch.Tensor:
    """Causal attention of this rank's load-balanced chunks over the ``cp`` axis by
    PyTorch's ring attention: ``query`` ``(batch, heads, local_seq, head_dim)``,
    ``key``/``value`` with ``kv_heads`` dividing ``heads``; returns ``(batch, local_seq,
    heads, head_dim)``, as :func:`~slapo_fn.kernels.attention.attention` does."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = _Ring.apply(query, key, value, _cp_mesh(axis), scale)
    return out.transpose(1, 2).contiguous()
