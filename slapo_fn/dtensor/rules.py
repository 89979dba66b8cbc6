"""Sharding rules DTensor lacks on CPU, registered with DTensor's own ``register_sharding``.

PyTorch registers how each op maps input placements to output placements
(``torch/distributed/tensor/_ops``); an op without a rule cannot run on DTensors at all.
CPU's fused attention kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward) has none, so attention inside a DTensor region (:mod:`.region`) would fail on
CPU, in forward or in backward. The rules here are the ones PyTorch gives the CUDA flash
kernel: every operand replicated, or every operand split alike along the batch or the
heads (an attention is independent per batch row and per head); a mask or bias is split
along the same dimension where it has it whole, and replicated where it broadcasts.

They are registered once, when this module is imported; registering adds what PyTorch
lacks and changes no rule PyTorch has.

Example:
    >>> import torch
    >>> torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in registered()
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding
from torch.distributed.tensor.placement_types import Placement

__all__ = ["registered"]

aten = torch.ops.aten
_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _mask(mask: Any, dim: int) -> Placement | None:
    """A mask's placement beside operands split along ``dim``: split where it has that
    dimension whole, replicated where it broadcasts there; ``None`` without a mask."""
    if mask is None:
        return None
    shape = mask.tensor_meta.shape if hasattr(mask, "tensor_meta") else mask.shape
    d = dim - 4 + len(shape)
    return Shard(d) if d >= 0 and shape[d] > 1 else Replicate()


def _strategies(n_out: int, n_in: int, mask: Any) -> list[tuple[list[Placement | None], list[Placement | None]]]:
    """All replicated, or all split along the batch (0) or the heads (1): ``n_out``
    outputs and ``n_in`` tensor inputs, then two non-tensor arguments, then the mask."""
    out: list[tuple[list[Placement | None], list[Placement | None]]] = [
        ([Replicate()] * n_out, [*([Replicate()] * n_in), None, None, _mask(mask, -1) and Replicate()])]
    for dim in (0, 1):
        out.append(([Shard(dim)] * n_out, [*([Shard(dim)] * n_in), None, None, _mask(mask, dim)]))
    return out


@register_sharding(_FORWARD)
def _forward(query: Any, key: Any, value: Any, dropout_p: float = 0.0, is_causal: bool = False, *,
             attn_mask: Any = None, scale: float | None = None) -> Any:
    return _strategies(2, 3, attn_mask)


@register_sharding(_BACKWARD)
def _backward(grad_out: Any, query: Any, key: Any, value: Any, out: Any, logsumexp: Any, dropout_p: float,
              is_causal: bool, *, attn_mask: Any = None, scale: float | None = None) -> Any:
    return _strategies(3, 6, attn_mask)


def registered() -> frozenset[Any]:
    """The ops this module gave a rule."""
    return frozenset({_FORWARD, _BACKWARD})
