"""float8 training linears: torchao's own converter, where the hardware multiplies in float8.

:func:`.gpu.float8_problem` says where this process cannot train in float8.
:func:`float8_linear` converts
one ``nn.Linear`` with :func:`torchao.float8.convert_to_float8_training` (its default
config: dynamic tensorwise scales, as torchtitan's default recipe), a factory for
``sf.replace``; :func:`float8_paths` names the linear layers it converts, by torchtitan's
rule: plain linears whose widths the float8 matmul takes (multiples of 16, on each
tensor-parallel shard).

A converted layer is sharded as any ``Linear`` subclass (:mod:`slapo_fn.dtensor.roles`):
its own forward runs on each rank's shards, so a column's or row's scales are computed
from this rank's shard of the weight and of the input a row takes split (torchtitan's
float8 tensor-parallel styles all-reduce one scale over the shards): the same float8 format,
a finer scale.
"""

from __future__ import annotations

from torch import nn

from ..tree import get_module, walk

__all__ = ["float8_linear", "float8_paths"]

#: The float8 matmul (``torch._scaled_mm``) takes widths that are multiples of this.
_WIDTH = 16


def float8_paths(root: nn.Module, under: list[str], tp: int = 1) -> list[str]:
    """The linear layers inside the modules at ``under`` that :func:`float8_linear` converts:
    those whose forward is ``F.linear`` (a subclass computing something else is left as it
    is) and whose widths, split over ``tp`` ranks, stay multiples of 16."""
    found = []
    for top in under:
        for path, m in walk(get_module(root, top), top):
            if (isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
                    and m.in_features % (_WIDTH * tp) == 0 and m.out_features % (_WIDTH * tp) == 0):
                found.append(path)
    return found


def float8_linear(old: nn.Module, path: str) -> nn.Module:
    """``old`` (an ``nn.Linear``) as torchao's ``Float8Linear``, by torchao's own converter
    (its parameters are ``old``'s)."""
    from torchao.float8 import convert_to_float8_training

    assert isinstance(old, nn.Linear), path
    return convert_to_float8_training(old)
