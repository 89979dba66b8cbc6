"""T5 (encoder-decoder): Megatron TP in both stacks, cross-attention included; the
relative position bias (an embedding over heads) is sharded over heads and kept local,
so every block adds this rank's heads' bias."""

from __future__ import annotations

from types import MappingProxyType

from torch import nn
from torch.distributed.tensor import Shard as DShard

from ..dtensor import shard, sync
from ..schedule import Schedule
from ._recipe import Recipe, Shard, Stack

_ATTENTION = {"q": Shard(0), "k": Shard(0), "v": Shard(0), "o": Shard(1)}
_FF = {"DenseReluDense.{wi,wi_0,wi_1}": Shard(0), "DenseReluDense.wo": Shard(1)}


def _plan(*parts: tuple[str, dict[str, Shard]]) -> MappingProxyType[str, Shard]:
    return MappingProxyType({f"{prefix}.{k}": v for prefix, plan in parts for k, v in plan.items()})


def _position_bias(sch: Schedule) -> Schedule:
    bias = [p for p in sch.paths() if p.endswith("relative_attention_bias") and isinstance(sch[p].module,
                                                                                            nn.Embedding)]
    for path in bias:
        sch = shard(sch, path, axis=1)
        sch = sync(sch, path, "fwd_post", DShard(-1))
    return sch


T5 = Recipe(
    name="t5",
    model_types=("t5",),
    stacks=(
        Stack("encoder.block.*", _plan(("layer.0.SelfAttention", _ATTENTION), ("layer.1", _FF))),
        Stack("decoder.block.*", _plan(("layer.0.SelfAttention", _ATTENTION), ("layer.1.EncDecAttention", _ATTENTION),
                                       ("layer.2", _FF))),
    ),
    heads="num_heads",
    kv_heads=None,
    extra_tp=_position_bias,
)

