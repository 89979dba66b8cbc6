"""Sharding rules DTensor lacks on CPU, registered with DTensor's own ``register_sharding``.

PyTorch registers how each op maps input placements to output placements
(``torch/distributed/tensor/_ops``); an op without a rule cannot run on DTensors at all.
CPU's fused attention kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward) has none, so attention inside a DTensor region (:mod:`.region`) would fail on
CPU, in forward or in backward. The rules here are the ones PyTorch gives the CUDA flash
kernel: every operand replicated, or every operand split alike along the batch or the
heads (an attention is independent per batch row and per head); a mask or bias is split
along the same dimension where it has it whole, and replicated where it broadcasts.

DTensor picks among a rule's strategies by what moving the inputs costs in the forward,
where splitting a replicated operand is free. Its gradient then comes back split and is
gathered in the backward: a query split by heads beside whole keys and values would save
one all-gather forward and cost two backward. Each rule therefore offers, per mesh axis,
only the strategies that move the fewest of its operands either way (:func:`_cheapest`):
the forward's query, key and value; the backward's saved ones and the gradient, so that
the gradients leave in the layout the forward took. DTensor's own cost breaks the ties.

They are registered once, when this module is imported; registering adds what PyTorch
lacks and changes no rule PyTorch has.

Example:
    >>> import torch
    >>> torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in registered()
    True
"""

from __future__ import annotations

from collections.abc import Sequence
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


def _cheapest(strategies: list[tuple[list[Placement | None], list[Placement | None]]],
              operands: Sequence[Any]) -> list[tuple[list[Placement | None], list[Placement | None]]]:
    """The ``strategies`` that, on some mesh axis, move the fewest ``operands`` (their
    placements read off their specs): each operand whose placement differs from what a
    strategy wants costs one collective, forward (gathering a split one) or backward
    (gathering the gradient of a replicated one that was split)."""
    specs = [o for o in operands if hasattr(o, "placements")]
    if not specs:
        return strategies
    keep: list[int] = []
    for axis in range(len(specs[0].placements)):
        costs = [sum(spec.placements[axis] != wanted for spec, wanted in zip(specs, inputs, strict=False))
                 for _, inputs in strategies]
        keep += [i for i, c in enumerate(costs) if c == min(costs) and i not in keep]
    return [strategies[i] for i in sorted(keep)]


@register_sharding(_FORWARD)
def _forward(query: Any, key: Any, value: Any, dropout_p: float = 0.0, is_causal: bool = False, *,
             attn_mask: Any = None, scale: float | None = None) -> Any:
    return _cheapest(_strategies(2, 3, attn_mask), (query, key, value))


@register_sharding(_BACKWARD)
def _backward(grad_out: Any, query: Any, key: Any, value: Any, out: Any, logsumexp: Any, dropout_p: float,
              is_causal: bool, *, attn_mask: Any = None, scale: float | None = None) -> Any:
    return _cheapest(_strategies(3, 6, attn_mask), (grad_out, query, key, value, out, logsumexp))


def registered() -> frozenset[Any]:
    """The ops this module gave a rule."""
    return frozenset({_FORWARD, _BACKWARD})
